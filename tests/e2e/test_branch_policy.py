"""Branches that need not trust the hub, over the real wire: a hub and four silo-client processes over mutual TLS.
Three silos' policies (signed secure aggregation over at least 3 branches, distributed client-level DP with z >= 1,
epsilon ceilings, no clear metrics) are met by the hub's terms, and they train; the fourth's policy asks for a
cohort of 5, so it refuses at join, before reading an image, and the hub logs and counts why. Afterwards
`silo-audit verify` passes on every silo's state folder (its chain, and that it agrees with the silo's ledger) and
on the hub's, and fails on one edited byte, naming the line."""

import json
import re
import subprocess
import sys
import urllib.request

from security.audit import AUDIT_FILE, read_records
from silo_client.ledger import LEDGER_FILE
from silo_sim.stage import stage_federation
from tests.conftest import ROOT, free_port, wait_for

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}

POLICY = """
secure_aggregation: {required: true, min_cohort: %d, min_threshold: 2}
client_dp: {required: true, min_noise_multiplier: 1.0, max_clip_norm: 0.1, max_epsilon_per_run: 60}
lifetime_epsilon: 200
algorithms: [semifl]
models: [small_cnn]
clear_metrics: false
"""


def silo_audit(*args):
    return subprocess.run([sys.executable, "-m", "silo_tools.audit", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_three_branches_train_under_their_policies_a_fourth_refuses_and_the_audits_verify(tmp_path, processes):
    port, metrics_port = free_port(), free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=4, labels_per_class=2, unlabeled_limit=80, test_per_class=5, seed=3,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 1.0, "linger_s": 5.0},
            "metrics": {"port": metrics_port, "final_scrape_s": 0},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 2, "min_silos": 3, "quorum": 1.0, "deadline_s": 120},
            "privacy": {
                "secure_aggregation": {"enabled": True, "threshold": 0.5, "dropouts": 0, "min_cohort": 3,
                                       "stage_deadline_s": 30},
                "dp": {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 0.05},
            },
        },
    )
    (tmp_path / "lenient.yaml").write_text(POLICY % 3)
    (tmp_path / "strict.yaml").write_text(POLICY % 5)
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    *members, stricter = staged.silos
    silos = {s.name: processes.start_silo(s, port, "--policy", str(tmp_path / "lenient.yaml")) for s in members}
    refuser = processes.start_silo(stricter, port, "--policy", str(tmp_path / "strict.yaml"))

    # The fourth branch refuses at join, before it reads an image; the hub says why once, and counts it.
    assert refuser.wait(timeout=240) == 3, processes.log(stricter.name)
    line = ("policy requires secure aggregation over at least 5 silos; this run sums as few as 3 (policy clause "
            "secure_aggregation.min_cohort)")
    assert f"error: {line}" in processes.log(stricter.name)
    assert "loaded" not in processes.log(stricter.name)  # no image was read
    reason = f"silo {stricter.name} refuses the run's terms (secure_aggregation.min_cohort): policy requires"
    wait_for(lambda: reason in processes.log("hub"), 60, "the hub's line about the refusal")
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert ('silokit_hub_silo_departures_total{clause="secure_aggregation.min_cohort",kind="refused"} 1.0'
            in scraped)

    assert hub.wait(timeout=420) == 0, processes.log("hub")
    assert processes.log("hub").count(reason) == 1
    for name, proc in silos.items():
        assert proc.wait(timeout=60) == 0, processes.log(name)
    rounds = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["secagg_u3"] == 3 and r["secagg_consistency"] == 3 for r in rounds)
    card = json.loads((staged.hub_state_dir / "model_card.json").read_text())
    assert card["silos_departed"][stricter.name]["clause"] == "secure_aggregation.min_cohort"

    for silo in members:
        state = silo.state_dir
        ok = silo_audit("verify", state)
        assert ok.returncode == 0 and ok.stdout.startswith("audit intact:"), ok.stdout + ok.stderr
        assert re.search(r"agrees with the ledger \(2 rounds in 1 runs\)", ok.stdout), ok.stdout
        records = [r for _, r in read_records(state / AUDIT_FILE)]
        masked = [r for r in records if r["kind"] == "secagg:masked_input"]
        ledger = json.loads((state / LEDGER_FILE).read_text())
        (run,) = ledger["runs"].values()
        assert [r["epsilon"]["client"] for r in masked] == [e["client"] for e in run["rounds"]]
        assert 0 < run["rounds"][0]["client"] < run["rounds"][1]["client"] <= 60
        assert not [r for r in records if r["kind"] == "upload"]  # nothing in the clear under secure aggregation
        text = (state / AUDIT_FILE).read_text()
        assert str(silo.data) not in text and ".png" not in text  # no image path enters the audit
    hub_audit = silo_audit("verify", staged.hub_state_dir)
    assert hub_audit.returncode == 0, hub_audit.stdout + hub_audit.stderr
    report = silo_audit("report", members[0].state_dir)
    assert report.returncode == 0 and "secagg:masked_input" in report.stdout

    # One edited byte in a silo's audit is found and named.
    audit = members[0].state_dir / AUDIT_FILE
    lines = audit.read_bytes().splitlines(keepends=True)
    target = next(i for i, raw in enumerate(lines) if b'"secagg:masked_input"' in raw)
    at = lines[target].index(b'"bytes":') + len(b'"bytes":')
    edited = lines[target][:at] + bytes([ord("9") if lines[target][at] != ord("9") else ord("8")]) \
        + lines[target][at + 1:]
    audit.write_bytes(b"".join(lines[:target] + [edited] + lines[target + 1:]))
    bad = silo_audit("verify", members[0].state_dir)
    assert bad.returncode == 1
    assert f"line {target + 1} (seq {target + 1}, kind secagg:masked_input)" in bad.stdout, bad.stdout
