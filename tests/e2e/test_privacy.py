"""Hub + 4 silo processes over mutual TLS with secure aggregation and distributed DP: one silo is killed in the
middle of round 1 (after it committed its keys), the round still completes without it; the silo is restarted and
takes part again; epsilon is logged and checkpointed every round, and the hub stops at the epsilon budget before
its planned rounds."""

import json
import os
import re
import signal

from silo_sim.stage import stage_federation
from tests.conftest import free_port, wait_for


def history(staged):
    try:
        return json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    except (OSError, ValueError):
        return []


TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}


def test_secure_aggregation_and_dp_over_the_wire_with_a_silo_killed_mid_round(tmp_path, processes):
    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=4, labels_per_class=2, unlabeled_limit=80, test_per_class=5, seed=2,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 1.0, "linger_s": 10.0},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 4, "min_silos": 4, "quorum": 0.5, "deadline_s": 120, "liveness_s": 6},
            "privacy": {
                "secure_aggregation": {"enabled": True, "threshold": 0.5, "stage_deadline_s": 8},
                # z = 1 at q = 1 spends 4.73 in round 1 and <= 7.08 after round 2; a third round would pass 8.2
                "dp": {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 0.05, "epsilon_budget": 7.5},
            },
        },
    )
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    silos = {
        s.name: processes.start_silo(s, port)
        for s in staged.silos
    }
    # Deterministic mid-protocol loss: freeze the first silo to join, so round 1's training phase cannot end;
    # kill another silo as soon as it has committed its keys; then let the frozen one go on.
    joined = re.compile(r"silo (\S+) joined")
    staller = wait_for(lambda: (m := joined.search(processes.log("hub"))) and m.group(1), 240, "a join")
    os.kill(silos[staller].pid, signal.SIGSTOP)
    committed = re.compile(r"round 1: secure aggregation advertise_keys from (\S+)")
    victim = wait_for(lambda: (m := committed.search(processes.log("hub"))) and m.group(1), 240, "keys in round 1")
    os.kill(silos[victim].pid, signal.SIGKILL)
    silos[victim].wait()
    os.kill(silos[staller].pid, signal.SIGCONT)
    # once round 1 is applied without it, its operator restarts it (rounds.min_silos is 4)
    wait_for(lambda: len(history(staged)) >= 1 or hub.poll() is not None, 240, "round 1")
    again = next(s for s in staged.silos if s.name == victim)
    silos[victim] = processes.start_silo(again, port, name=victim + "-restarted")

    assert hub.wait(timeout=300) == 0, processes.log("hub")
    log = processes.log("hub")
    history_ = history(staged)
    assert [h["round"] for h in history_] == [1, 2]  # stopped by the budget, not by rounds.total = 4
    first, second = history_
    assert first["silos_sampled"] == 4 and first["secagg_u1"] == 4
    assert first["secagg_u2"] == 3 and first["secagg_contributors"] == 3  # the victim's masks never entered
    assert first["dp_epsilon"] < second["dp_epsilon"] <= 7.5
    assert round(first["dp_epsilon"], 2) == 4.73 and second["secagg_contributors"] == 4
    assert "privacy spent epsilon = 4.7285" in log and "stopping after round 2" in log
    assert "run ended after round 2 of 4 (privacy budget:" in log and "start it again" not in log
    card = json.loads((staged.hub_state_dir / "model_card.json").read_text())
    assert card["privacy"]["secure_aggregation"] is True and card["privacy"]["dp_rounds"] == 2
    assert card["privacy"]["dp_epsilon"] == second["dp_epsilon"] and "privacy budget" in card["stopped_early"]
    latest = (staged.hub_state_dir / "checkpoints" / "LATEST").read_text().strip()
    state = json.loads((staged.hub_state_dir / "checkpoints" / latest / "state.json").read_text())
    assert sum(s for _, _, s in state["privacy"]["dp"]["accountant"]["history"]) == 2
    for proc in silos.values():
        assert proc.wait(timeout=60) == 0, processes.log(proc.name)
        assert "secure aggregation unmask sent" in processes.log(proc.name), processes.log(proc.name)
