"""A silo whose own update fails its check before sending (here a float16 overflow under wire.half_precision, with
updates weighted by image count) over real gRPC: nothing leaves, the log says it was this silo's update and not the
hub's bundle, the silo does not train the same task again, and the round goes on without it. The hub says at start
that the combination can overflow."""

from __future__ import annotations

import json
import logging

import torch

from security.audit import AUDIT_FILE
from silo_client import metrics as silo_metrics
from silo_core.algorithms.semifl import SemiFLSilo
from silo_server.app import HubApp
from tests.silo_client.test_receive import run_dev_silos, semifl_hub_config

SILOS = ("dev-1", "dev-2")


def hub_config(tmp_path):
    return semifl_hub_config(tmp_path, SILOS, options={"aggregation": "samples"},
                             rounds={"quorum": 0.5, "wait_after_quorum_s": 4}, wire={"half_precision": True})


def overflow_in_round_1(monkeypatch, silo: str) -> tuple[list[tuple[str, int]], list[float]]:
    """`silo`'s round-1 update holds 1e5 wherever the wire declares float16 (past its 65504). Returns the (silo,
    round) of every local update and silokit_silo_updates_unsent_total after each count (no series is shared)."""
    trained: list[tuple[str, int]] = []
    unsent: list[float] = []
    local_update, counted = SemiFLSilo.local_update, silo_metrics.SiloMetrics.unsent

    def overflowing(self, plan, data):
        result = local_update(self, plan, data)
        trained.append((data.silo_id, plan.round))
        halved = [n for n, spec in plan.expected.items() if spec.dtype == "float16"]
        assert halved  # the wire sends some of the delta as float16, or there is nothing to overflow
        if data.silo_id == silo and plan.round == 1:
            result.tensors = {k: torch.full_like(v, 1e5) if k in halved else v for k, v in result.tensors.items()}
        return result

    def count(self):
        counted(self)
        unsent.append(self.values[silo_metrics.UPDATES_UNSENT.name])

    monkeypatch.setattr(SemiFLSilo, "local_update", overflowing)
    monkeypatch.setattr(silo_metrics.SiloMetrics, "unsent", count)
    return trained, unsent


def test_an_update_that_overflows_float16_is_not_sent_nor_retrained_and_the_round_goes_on(
        tmp_path, monkeypatch, caplog) -> None:
    trained, unsent = overflow_in_round_1(monkeypatch, "dev-1")
    with caplog.at_level(logging.INFO):
        history = run_dev_silos(HubApp(hub_config(tmp_path), insecure_dev_only=True), tmp_path, SILOS)

    # Round 1 went on with dev-2 alone after the quorum wait; dev-1 trained round 1 once (the task was waited out,
    # not retrained) and took part in round 2 again.
    assert [(r.silos_sampled, r.silos_reported) for r in history] == [(2, 1), (2, 2)]
    assert sorted(trained) == [("dev-1", 1), ("dev-1", 2), ("dev-2", 1), ("dev-2", 2)]
    assert unsent == [1]
    records = [json.loads(line) for line in (tmp_path / "state-dev-1" / AUDIT_FILE).read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "upload"] == [2]  # nothing of round 1 left the branch

    said = [r.getMessage() for r in caplog.records]
    own = [m for m in said if "this silo's update failed its own check" in m]
    assert len(own) == 1 and "round 1" in own[0] and "wire.half_precision" in own[0]
    assert not any("bad bundle from the hub" in m for m in said)
    warned = [m for m in said if m.startswith("wire.half_precision with updates weighted by image count")]
    assert len(warned) == 1 and "up to 4 this round" in warned[0]  # once, naming the heaviest silo's 4 images


def test_under_secure_aggregation_the_same_update_leaves_as_float32_and_the_hub_does_not_warn(
        tmp_path, monkeypatch, caplog) -> None:
    # Masked inputs are built from the float32 update (the hub takes no float16 there): nothing overflows.
    silos = ("dev-1", "dev-2", "dev-3")
    config = semifl_hub_config(tmp_path, silos, options={"aggregation": "samples"}, rounds={"total": 1},
                               wire={"half_precision": True},
                               privacy={"secure_aggregation": {"enabled": True, "min_cohort": 3, "dropouts": 0}})
    trained, unsent = overflow_in_round_1(monkeypatch, "dev-1")
    with caplog.at_level(logging.INFO):
        history = run_dev_silos(HubApp(config, insecure_dev_only=True), tmp_path, silos)
    assert [(r.silos_reported, r.secagg.contributors) for r in history] == [(3, 3)]
    assert sorted(trained) == [(s, 1) for s in silos] and unsent == []
    said = [r.getMessage() for r in caplog.records]
    assert not any("failed its own check" in m or m.startswith("wire.half_precision with") for m in said)
