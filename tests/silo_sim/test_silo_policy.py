"""silo-sim gives its silos branch policies through the same code as silo-client --policy: one file for every
silo, or N=FILE for silo N; a bad file fails before anything starts. In a run, the silo whose policy the hub's
terms fall short of refuses at join and the others train."""

import json
import subprocess
import sys

import pytest

from silo_client.policy import PolicyError
from silo_sim.cli import silo_policies
from tests.conftest import ROOT


def test_one_policy_for_every_silo_and_one_for_a_chosen_silo(tmp_path):
    every, strict = tmp_path / "every.yaml", tmp_path / "strict.yaml"
    every.write_text("clear_metrics: false\n")
    strict.write_text("secure_aggregation: {required: true}\n")
    assert silo_policies([], 3) == {}
    assert silo_policies([str(every), f"2={strict}"], 3) == {
        "silo-001": str(every.resolve()), "silo-002": str(strict.resolve()), "silo-003": str(every.resolve())}
    assert silo_policies([f"3={strict}"], 3) == {"silo-003": str(strict.resolve())}


def test_a_bad_choice_or_file_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="--silo-policy '4=x.yaml': N must be a silo number from 1 to --silos"):
        silo_policies(["4=x.yaml"], 3)
    (tmp_path / "bad.yaml").write_text("client_dp: {min_noise: 1}\n")
    with pytest.raises(PolicyError, match="unknown key 'client_dp.min_noise'"):
        silo_policies([str(tmp_path / "bad.yaml")], 3)


def test_a_simulated_silo_whose_policy_refuses_the_run_leaves_and_the_others_train(tmp_path):
    (tmp_path / "strict.yaml").write_text("client_dp: {required: true}\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "silo_sim.cli", "--silos", "3", "--workers", "1", "--rounds", "1",
         "--labels-per-class", "2", "--unlabeled", "60", "--option", "hub_epochs=1", "--option", "tau=0.0",
         "--option", "local_epochs=1", "--silo-policy", f"3={tmp_path / 'strict.yaml'}",
         "--hub-set", "rounds.min_silos=2", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    worker = (tmp_path / "work" / "logs" / "worker-0.log").read_text()
    assert ("silo silo-003 left the run by its policy (client_dp.required): policy requires client-level DP; this "
            "run has none") in worker
    hub = (tmp_path / "work" / "logs" / "hub.log").read_text()
    assert "silo silo-003 refuses the run's terms (client_dp.required)" in hub
    rounds = json.loads((out / "summary.json").read_text())["rounds"]
    assert len(rounds) == 1 and rounds[0]["silos_reported"] == 2


def test_a_run_left_with_fewer_silos_than_the_hub_waits_for_stops_and_says_how_to_go_on(tmp_path):
    # silo-sim stages rounds.min_silos = --silos: once one silo left by its policy, the hub waited for it forever.
    (tmp_path / "strict.yaml").write_text("client_dp: {required: true}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "silo_sim.cli", "--silos", "3", "--workers", "1", "--rounds", "1",
         "--labels-per-class", "2", "--unlabeled", "60", "--option", "hub_epochs=1", "--no-baseline",
         "--silo-policy", f"3={tmp_path / 'strict.yaml'}", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    said = " ".join((proc.stdout + proc.stderr).split())
    assert ("1 of 3 silos stopped before the run's end (silo-003 left by its policy (client_dp.required)" in said
            and "--hub-set rounds.min_silos=2" in said), said[-2000:]
