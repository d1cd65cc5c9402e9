"""One attacking silo over the real wire (silo-sim: hub and silo processes, mutual TLS): a silo that sends a noise
update (silo-sim --attackers 1 --attack noise, silo_sim/attacks.py) drags the plain mean far below what
hub.yaml aggregation.rule: median keeps (measured over the wire: clean 53.0%, mean 32.4%, median 53.2%), and the
median names the attacker in the round history. Two runs of one round (the clean run's comparison, for every rule
against both attacks, is tests/silo_sim/test_robust_inprocess.py, in process: the same round loop and rules)."""

import json
import subprocess
import sys

# Six silos of 50 images in one worker, 10 labels per class at the hub, one round, 500 test images (one point: five
# images): each run costs about half a minute on two cores.
BASE = ["--silos", "6", "--workers", "1", "--rounds", "1", "--labels-per-class", "10", "--unlabeled", "300",
        "--test-per-class", "50", "--option", "hub_epochs=3", "--option", "tau=0.0", "--option", "local_epochs=1",
        "--no-baseline"]


def run_sim(tmp_path, name, *args):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "silo_sim.cli", *BASE, *args, "--workdir", str(tmp_path / f"{name}-work"),
                           "--out", str(out)], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1]
    return summary


def test_one_noise_silo_drags_the_mean_down_and_the_median_holds(tmp_path):
    attacked_mean = run_sim(tmp_path, "mean", "--attackers", "1", "--attack", "noise")
    attacked_median = run_sim(tmp_path, "median", "--attackers", "1", "--attack", "noise",
                              "--hub-set", "aggregation.rule=median")
    accuracy = {name: 100 * s["final"]["test_accuracy"] for name, s in
                (("mean", attacked_mean), ("median", attacked_median))}
    assert accuracy["median"] > 45, accuracy  # the median run learns as a clean one does (34% before round 1)
    assert accuracy["mean"] < accuracy["median"] - 10, accuracy  # measured 32.4 against 53.2
    assert attacked_median["settings"]["attackers"] == 1 and attacked_median["settings"]["attack"] == "noise"
    decision = attacked_median["rounds"][0]
    assert decision["aggregation_rule"] == "median" and decision["aggregation_updates"] == 6
    # silo-001, the attacker, is left out of the median or kept under half its share of the mean; no one else is
    assert decision["aggregation_excluded_silos"] + decision["aggregation_down_weighted_silos"] == ["silo-001"]
    assert all("aggregation_rule" not in r for r in attacked_mean["rounds"])  # the mean records no decision
    logs = tmp_path / "mean-work" / "logs"
    attackers = [line for p in logs.glob("worker-*.log") for line in p.read_text().splitlines()
                 if "SIMULATED ATTACK" in line]
    assert attackers and all("silo-001" in line for line in attackers)
