"""Every algorithm for 2 rounds through silo-sim over the real wire (hub and silo processes, mutual TLS), on tiny
data; each checks that every tensor group the hub planned came back. SemiFL's run is tests/e2e/test_sim.py."""

import json
import subprocess
import sys

import pytest

BASE = ["--rounds", "2", "--labels-per-class", "2", "--unlabeled", "48", "--test-per-class", "3", "--workers", "1",
        "--no-baseline"]
CASES = {
    "fedseal": (["--silos", "2", "--validation-per-class", "2", "--option", "local_epochs=1",
                 "--option", "hub_epochs=1", "--option", "threshold_min=0.0", "--option", "theta=0.3"]),
    "hassle": (["--silos", "2", "--labeled-silos", "1", "--silo-labels-per-class", "2", "--option", "local_epochs=1",
                "--option", "hub_warmup_epochs=1", "--option", "batch_size=16"]),
    # A validation split for an algorithm that does not need one: the hub scores every round and keeps the best.
    "fedavg-fixmatch": (["--silos", "2", "--validation-per-class", "2", "--option", "local_epochs=1",
                         "--option", "hub_epochs=1", "--option", "init_epochs=1", "--option", "tau=0.0"]),
    "supervised": (["--silos", "2", "--option", "local_epochs=1", "--option", "hub_epochs=1"]),
    "server-only": (["--silos", "1", "--option", "hub_epochs=1"]),
}


def run_sim(tmp_path, algorithm):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "silo_sim.cli", "--algorithm", algorithm, *BASE, *CASES[algorithm],
                           "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rounds = json.loads((out / "summary.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in rounds)
    return rounds, (tmp_path / "work" / "logs" / "hub.log").read_text()


@pytest.mark.parametrize("algorithm", ["fedseal", "fedavg-fixmatch", "supervised"])
def test_single_model_algorithms_get_every_sampled_silos_update(tmp_path, algorithm):
    rounds, _ = run_sim(tmp_path, algorithm)
    for r in rounds:
        assert r["silos_sampled"] == 2 and r["silos_reported"] == 2 and r["silos_skipped"] == 0
        assert r["bytes_up"] >= 2 * 100_000  # two whole model deltas (33k float32 parameters each)
        assert r["aggregated_weight"] > 0
    if algorithm == "fedseal":
        # The hub's per-class thresholds are in the history (and went out with the model as a typed field).
        for r in rounds:
            taus = [r[f"threshold_class_{m}"] for m in range(10)]
            assert all(0.0 <= t <= 0.99 + 1e-6 for t in taus)  # float32 on the wire
            assert 0.0 <= r["validation_accuracy"] <= 1.0 and r["pseudo_label_ratio"] + r["negative_label_ratio"] > 0
    if algorithm == "supervised":
        assert rounds[-1]["aggregated_weight"] == 48  # FedAvg weights: every silo image, with its true label
    if algorithm == "fedavg-fixmatch":
        assert rounds[0]["pseudo_label_ratio"] == 1.0  # tau = 0: every batch fully pseudo-labeled
        # Round 0 is the initial model (the hub's labels alone), a candidate too; a tie goes to the later round.
        state = tmp_path / "work" / "hub" / "state"
        initial = json.loads((state / "history.json").read_text())["initial"]["validation_accuracy"]
        scores = [initial, *(r["validation_accuracy"] for r in rounds)]
        best = max(range(3), key=lambda r: (scores[r], r))
        card = json.loads((state / "model_card.json").read_text())
        assert card["best_round"]["round"] == best and card["best_round"]["validation_accuracy"] == scores[best]
        assert (tmp_path / "work" / "hub" / "state" / "best_model.safetensors").is_file()
    else:
        assert all("validation_accuracy" not in r for r in rounds) or algorithm == "fedseal"


def test_hassle_with_a_partly_labeled_silo_gets_all_four_model_groups_back(tmp_path):
    rounds, hub_log = run_sim(tmp_path, "hassle")
    assert "silo silo-001 joined (" in hub_log and "labeled images" in hub_log
    assert "0 labeled images" not in hub_log.split("silo silo-001 joined")[1].splitlines()[0]
    for r in rounds:
        assert r["silos_reported"] == 2
        # silo-001 holds labeled and unlabeled images: it sends all four groups; silo-002 only U and r_SU.
        assert (r["contributors_S"], r["contributors_rUS"], r["contributors_U"], r["contributors_rSU"]) == (1, 1, 2, 2)
        assert r["samples_S"] == r["samples_rUS"] > 0 and r["samples_U"] == r["samples_rSU"] > 0
        assert r["samples_S"] + r["samples_U"] == 48


def test_server_only_runs_at_the_hub_alone(tmp_path):
    rounds, hub_log = run_sim(tmp_path, "server-only")
    assert "joined" not in hub_log  # no silo was started: it would have nothing to do
    assert all("hub_loss" in r for r in rounds)
