"""Sample-level DP over the real wire: a hub and 2 silo processes over mutual TLS, SemiFL on a group-norm model,
every silo training with DP-SGD and keeping its own ledger. The budget leaves room for one round: in round 2 both
silos refuse to train (and say so), the hub applies no silo update, and each silo's ledger on disk holds exactly
one round of steps."""

import json
import re

from security.dp import PrivacyAccountant
from silo_core.dp_sgd import dp_schedule
from silo_sim.stage import stage_federation
from tests.conftest import free_port

TINY = {"hub_epochs": 1, "local_epochs": 1, "silo_batch_size": 8, "hub_batch_size": 8, "tau": 0.0}


def test_silos_train_with_dp_sgd_report_epsilon_and_stop_at_their_budget(tmp_path, processes):
    q, steps = dp_schedule(40, 8, 1)  # 80 images over 2 silos, all confident at tau 0
    # The hub states its delta, 1e-7, below the silos' default 1e-5: each silo reports and limits at the smaller.
    one, two = PrivacyAccountant("rdp", 1e-7), PrivacyAccountant("rdp", 1e-7)
    one.step(1.2, q, steps)
    two.step(1.2, q, 2 * steps)
    port = free_port()
    staged = stage_federation(
        tmp_path / "fed", num_silos=2, labels_per_class=2, unlabeled_limit=80, test_per_class=5, seed=4,
        hub_config={
            "run": {"threads": 1},
            "server": {"port": port, "long_poll_s": 1.0, "linger_s": 3.0},
            "model": {"options": {"width": 4, "norm": "group"}},
            "algorithm": {"name": "semifl", "options": TINY},
            "rounds": {"total": 2, "min_silos": 2, "deadline_s": 120},
            "privacy": {"sample_dp": {"enabled": True, "noise_multiplier": 1.2, "clip_norm": 1.0, "delta": 1e-7,
                                      "epsilon_budget": (one.epsilon() + two.epsilon()) / 2}},
        },
    )
    hub = processes.start("hub", "-m", "silo_server.cli", "--config", str(staged.hub_config))
    silos = [processes.start_silo(s, port)
             for s in staged.silos]
    assert hub.wait(timeout=300) == 0, processes.log("hub")
    rounds = json.loads((staged.hub_state_dir / "history.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["aggregated_weight"] == 2.0 and rounds[1]["aggregated_weight"] == 0.0
    assert "pseudo_label_ratio" not in rounds[0]  # no clear counts of a silo's images leave under sample-level DP
    for proc, silo in zip(silos, staged.silos, strict=True):
        assert proc.wait(timeout=60) == 0, processes.log(proc.name)
        log = processes.log(proc.name)
        reported = [float(e) for e in re.findall(r"sample-level DP epsilon (\S+) at delta", log)]
        assert len(reported) == 2 and abs(reported[0] - one.epsilon()) < 1e-3 and reported[1] == reported[0], log
        assert "budget reached: no more training" in log and "at delta 1e-07" in log
        ledgers = list(silo.state_dir.rglob("sample_dp_ledger-*.json"))
        assert len(ledgers) == 1
        assert sum(s for _, _, s in json.loads(ledgers[0].read_text())["history"]) == steps
