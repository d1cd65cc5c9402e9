"""silo-sim --engine ray end to end: the silos hosted by Ray actors on a local Ray the sim starts and stops, each silo
over its own mutual-TLS connection; the same numbers as the worker pool; a killed actor reported and replaced.

Small on purpose (6 silos, 2 rounds): the suite runs these on two cores. Bigger runs carry the ray_large marker."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for

pytest.importorskip("ray")

SMALL = ["--silos", "6", "--workers", "2", "--rounds", "2", "--labels-per-class", "5", "--unlabeled", "240",
         "--test-per-class", "20", "--option", "hub_epochs=2", "--option", "tau=0.0", "--option", "local_epochs=1",
         "--no-baseline"]


def start_sim(processes, tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    return processes.start(name, "-m", "silo_sim.cli", *SMALL, *extra, "--workdir", str(tmp_path / name / "work"),
                           "--out", str(tmp_path / name / "out"))


def finished_sim(processes, sim: subprocess.Popen, tmp_path: Path) -> tuple[str, dict, Path]:
    """The sim's output, its summary.json and its workdir, once it exited 0."""
    assert sim.wait(timeout=400) == 0, processes.log(sim.name)[-3000:]
    summary = json.loads((tmp_path / sim.name / "out" / "summary.json").read_text())
    return processes.log(sim.name), summary, tmp_path / sim.name / "work"


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (Ray's raylet, GCS and workers name their session dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return found


def assert_ray_gone(work: Path) -> dict:
    """Ray's session dir is removed and none of its processes (raylet, GCS, the actors) outlived the sim."""
    hosts = json.loads((work / "logs" / "ray-actors.json").read_text())
    temp_dir = hosts["ray_temp_dir"]
    assert temp_dir and not Path(temp_dir).exists()
    assert processes_mentioning(temp_dir) == []
    for actor in hosts["actors"]:
        assert not Path(f"/proc/{actor['pid']}").exists()
    return hosts


def test_ray_actors_host_every_silo_over_mtls_and_match_the_worker_pool(tmp_path, processes):
    # Both engines at once (each host on one thread either way, so sharing the cores changes no number): the
    # suite waits for the longer run only.
    ray_sim = start_sim(processes, tmp_path, "ray", "--engine", "ray")
    pool_sim = start_sim(processes, tmp_path, "workers")
    ray_output, ray_run, work = finished_sim(processes, ray_sim, tmp_path)
    hosts = assert_ray_gone(work)
    # Two actors share the six silos as two worker processes would; each silo joined with its own certificate.
    assert [a["silos"] for a in hosts["actors"]] == [["silo-001", "silo-003", "silo-005"],
                                                     ["silo-002", "silo-004", "silo-006"]]
    assert hosts["events"] == []
    hub_log = (work / "logs" / "hub.log").read_text()
    for i in range(1, 7):
        assert f"silo silo-00{i} joined" in hub_log and f"update from silo-00{i}" in hub_log
    assert "mutual TLS" in hub_log
    for r in ray_run["rounds"]:
        assert r["silos_sampled"] == r["silos_reported"] == r["silos_contributed"] == 6
        assert r["bytes_up"] >= 6 * 10_000 and r["bytes_down"] >= 6 * 10_000
    for i in (0, 1):  # the actors' own logs, in the sim's logs folder: three silos each, every round trained
        actor_log = (work / "logs" / f"actor-{i}.log").read_text()
        assert actor_log.count("2 rounds contributed") == 3
    assert "Token authentication" not in ray_output  # Ray kept quiet

    # The worker pool with the same seeds: the same numbers, not merely close (same kernels, same thread count
    # per host, the same silos per host, float64 sums at the hub).
    _, pool_run, pool_work = finished_sim(processes, pool_sim, tmp_path)
    assert sorted(p.name for p in (pool_work / "logs").iterdir()) == ["hub.log", "worker-0.log", "worker-1.log"]
    assert len(ray_run["rounds"]) == len(pool_run["rounds"]) == 2
    for ray_round, pool_round in zip(ray_run["rounds"], pool_run["rounds"], strict=True):
        for key in ("test_accuracy", "test_loss", "hub_loss", "silo_train_loss", "pseudo_label_accuracy"):
            assert ray_round[key] == pool_round[key], key
    assert ray_run["final"]["test_accuracy"] > 0.1  # above chance on 10 classes: the equality means something


def test_a_killed_actor_is_reported_and_replaced_and_the_round_goes_on(tmp_path, processes):
    """The actor hosting silo-001, -003 and -005 is SIGKILLed while round 1 runs: the sim names the actor and its
    silos, the round closes on the quorum (or with the silos back), and a new actor brings those silos back with
    their certificates: round 2 has all six.

    Run as on a cluster without a shared file system: the actors get their silos' files shipped (the replacement
    again) and unpack them in folders of their own, and the hub listens on an address other than 127.0.0.1
    (127.0.0.2, still loopback), which the silos dial and its certificate names."""
    work, out = tmp_path / "work", tmp_path / "out"
    sim = processes.start("sim", "-m", "silo_sim.cli", *SMALL, "--unlabeled", "1200", "--engine", "ray",
                          "--ship-silo-files", "--hub-host", "127.0.0.2",
                          "--hub-set", "rounds.quorum_silos=3", "--hub-set", "rounds.deadline_s=60",
                          "--workdir", str(work), "--out", str(out))
    hub_log = work / "logs" / "hub.log"
    wait_for(lambda: hub_log.exists() and "round 1 attempt 1: sampled" in hub_log.read_text(), 180, "round 1")
    hosts = json.loads((work / "logs" / "ray-actors.json").read_text())
    victim = hosts["actors"][0]
    assert victim["silos"] == ["silo-001", "silo-003", "silo-005"]
    os.kill(victim["pid"], signal.SIGKILL)
    assert sim.wait(timeout=300) == 0, processes.log("sim")[-3000:]

    output = processes.log("sim")
    assert f"silo host actor 0 (pid {victim['pid']}) died, hosting silo-001, silo-003, silo-005" in output
    hosts = assert_ray_gone(work)
    (event,) = hosts["events"]
    assert "started a new actor" in event and "restart 1" in event
    assert hosts["actors"][0]["restarts"] == 1 and hosts["actors"][0]["pid"] != victim["pid"]
    assert hosts["actors"][1]["restarts"] == 0

    summary = json.loads((out / "summary.json").read_text())
    first, second = summary["rounds"]
    assert first["silos_sampled"] == 6 and 3 <= first["silos_contributed"] <= 6  # the quorum carried round 1
    assert second["silos_sampled"] == second["silos_contributed"] == 6  # the replaced silos are back
    log = hub_log.read_text()
    rejoined = log.split("round 1 attempt 1: sampled")[1]
    for silo in victim["silos"]:  # each joined again (its own certificate) after the kill
        assert f"silo {silo} joined" in rejoined
    assert "hub listening on 127.0.0.2:" in log

    # Every actor, the replacement too, read its silos' files from its own unpacked copy, removed at the end, and
    # told its /metrics address.
    for i in (0, 1):
        actor_log = (work / "logs" / f"actor-{i}.log").read_text()
        unpacked = [line.split("silo files unpacked in ")[1].strip() for line in actor_log.splitlines()
                    if "silo files unpacked in " in line]
        assert len(unpacked) == (2 if i == 0 else 1)  # the replacement got the archive again
        if i == 0:
            unpacked_by_victim = unpacked[0]
        loaded = [line for line in actor_log.splitlines() if "images from" in line]
        assert loaded and all(any(f"from {u}/" in line for u in unpacked) for line in loaded)
        assert str(work) not in "".join(loaded) and not any(Path(u).exists() for u in unpacked)
        assert hosts["actors"][i]["metrics_address"].startswith("127.0.0.1:")
    # The killed actor could not remove its copy (its silos' keys): an actor of the same run on the node did.
    assert any(f"removed {unpacked_by_victim}, the silo files of a killed actor" in
               (work / "logs" / f"actor-{i}.log").read_text() for i in (0, 1))


def test_without_ray_the_engine_fails_with_the_install_line(tmp_path):
    """Ray made unimportable in a fresh interpreter: one line that says what to install, nothing staged."""
    code = ("import sys; sys.modules['ray'] = None; from silo_sim.cli import main; "
            f"sys.exit(main(['--engine', 'ray', '--workdir', {str(tmp_path / 'work')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ['error: the Ray engine needs Ray: pip install -e ".[ray]"']
    assert not (tmp_path / "work").exists()


def test_silo_sim_without_the_ray_engine_never_imports_ray():
    code = ("import sys; import silo_sim.cli, silo_sim.worker; from silo_sim.cli import build_parser; "
            "from silo_sim.ray_engine import check_engine_args; "
            "check_engine_args(build_parser().parse_args([])); print('ray' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]


@pytest.mark.ray_large
@pytest.mark.skipif(not os.environ.get("SILOKIT_RAY_LARGE"), reason="set SILOKIT_RAY_LARGE=1 (minutes)")
def test_many_silos_on_a_few_ray_actors(tmp_path):
    """60 silos, 10 sampled per round, on as many actors as the local Ray's CPUs allow: every silo joins."""
    started = time.time()
    work, out = tmp_path / "work", tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "silo_sim.cli", "--engine", "ray", "--silos", "60",
                           "--silos-per-round-count", "10", "--rounds", "3", "--labels-per-class", "5",
                           "--unlabeled", "3000", "--test-per-class", "20", "--option", "hub_epochs=1",
                           "--option", "local_epochs=1", "--option", "tau=0.0", "--no-baseline", "--workdir", str(work), "--out", str(out)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hosts = assert_ray_gone(work)
    assert len(hosts["actors"]) == min(60, os.cpu_count() or 1)
    assert sorted(s for a in hosts["actors"] for s in a["silos"]) == [f"silo-{i:03d}" for i in range(1, 61)]
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["silos_reported"], r["silos_contributed"]) for r in summary["rounds"]] == [(10, 10)] * 3
    print(f"60 silos over Ray in {time.time() - started:.0f}s")
