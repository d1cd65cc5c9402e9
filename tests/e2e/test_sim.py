"""silo-sim end to end: a hub and silos hosted by a worker pool over mutual TLS, a summary with the baseline."""

import json
import subprocess
import sys


def test_sim_hosts_silos_in_a_worker_pool_and_writes_a_summary(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "silo_sim.cli", "--silos", "6", "--workers", "2", "--rounds", "2",
         "--labels-per-class", "2", "--unlabeled", "120", "--option", "hub_epochs=1", "--option", "tau=0.0",
         "--option", "local_epochs=1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    for r in summary["rounds"]:
        assert r["silos_sampled"] == 6 and r["silos_reported"] == 6
        assert r["bytes_down"] >= 6 * 10_000 and r["bytes_up"] >= 6 * 10_000
        assert 0.0 <= r["test_accuracy"] <= 1.0 and 0.0 <= r["pseudo_label_accuracy"] <= 1.0
    assert 0.0 <= summary["baseline"]["test_accuracy"] <= 1.0
    assert summary["settings"]["silos"] == 6 and summary["settings"]["algorithm_options"]["tau"] == 0.0
    assert "server-only" in proc.stdout and "test acc" in proc.stdout
    # Six silos, each with its own certificate and connection, hosted by two worker processes.
    logs = sorted(p.name for p in (tmp_path / "work" / "logs").iterdir())
    assert logs == ["hub.log", "worker-0.log", "worker-1.log"]
    hub_log = (tmp_path / "work" / "logs" / "hub.log").read_text()
    assert all(f"silo silo-00{i} joined" in hub_log for i in range(1, 7))


def test_sim_rejects_a_bad_option_by_name():
    proc = subprocess.run([sys.executable, "-m", "silo_sim.cli", "--option", "tua=0.9"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "tua" in proc.stderr and "Traceback" not in proc.stderr
