"""The hub's parts, each without the Hub facade: the silo registry, the run records, the round loop and the privacy
layer's round completion (which gets what it uses of the hub passed in)."""

import datetime as dt
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from security.dp import DPConfig
from silo_core.algorithms.base import HubAlgorithm, HubState, RoundPlan
from silo_core.models import ModelSpec
from silo_core.rounds import RoundRecord, Scores
from silo_core.tensors import TensorSpec
from silo_server.config import parse_config
from silo_server.rounds.aggregate import RunningSum
from silo_server.rounds.privacy import HubPrivacy, PrivacySection, RoundFailed, RoundHooks
from silo_server.rounds.round_loop import RoundLoop
from silo_server.settings import HubSettings, RoundSettings, WireLimits
from silo_server.state.registry import ChangeCondition, Refusal, SiloRegistry
from silo_server.state.scoring import RunRecords


class HubOnly(HubAlgorithm):
    """Rounds that need no silos: each adds one to the hub's vector."""

    name = "hub-only"
    needs_silos = False

    def __init__(self):
        super().__init__(None, ModelSpec(), None, torch.device("cpu"), 0, 2)

    def init_state(self):
        return HubState(0, {"model/x": torch.zeros(2)})

    def begin_round(self, state):
        return RoundPlan(state.round + 1, {}, {}, {})

    def finish_round(self, state, summed, metrics):
        return HubState(state.round + 1, {"model/x": state.tensors["model/x"] + 1}), {"moved": 1.0}

    def served_model(self, state):
        return torch.nn.Identity()


def test_the_registry_fixes_declared_images_counts_refusals_and_forgets_silent_silos():
    registry = SiloRegistry(ChangeCondition(), liveness_s=60.0)
    registry.declared_before = {"b": 5}  # from a checkpoint
    registry.join("a", 10, 0, "cpu")
    registry.join("a", 50, 0, "cpu")  # a re-join may lower the count, never raise it
    registry.join("b", 9, 0, "cpu")
    registry.join("c", 3, 0, "cpu", preparing=True)
    assert registry.declared_images() == {"a": 10, "b": 5}
    assert registry.live_silos() == ["a", "b"] and registry.preparing_silos() == ["c"]

    with pytest.raises(Refusal) as refused:
        raise registry.validate("a", lambda: registry.touch("nobody"))
    assert refused.value.reason == "not_joined" and registry.refusals == {"not_joined": 1}

    registry.silos["a"].last_seen = time.time() - 120  # silent for longer than liveness_s
    registry.revoke("b", in_round=False)
    assert registry.live_silos() == [] and registry.silos_not_told_done() == ["c"]


def test_run_records_keep_the_run_id_and_read_back_what_they_saved(tmp_path):
    records = RunRecords(tmp_path, evaluate=lambda state: {"accuracy": 0.5, "loss": 1.0})
    assert RunRecords(tmp_path).run_id == records.run_id  # the same state folder is the same run
    state = HubState(1, {"model/x": torch.ones(2)})
    records.history.append(RoundRecord(round=1, scores=records.score(state)))
    records.credit({"a", "b"})
    records.credit({"a"})
    records.save(state, {"a": 7})

    again = RunRecords(tmp_path)
    loaded_state, declared = again.load(total_rounds=3, check=lambda state: torch.nn.Identity())
    assert loaded_state.round == 1 and declared == {"a": 7}
    assert again.contributed == {"a": 2, "b": 1}  # a restarted hub's card and gauge still count them
    assert [r.round for r in again.history] == [1] and again.history[0].scores == records.history[0].scores
    assert again.initial == Scores()


def test_the_round_loop_runs_hub_only_rounds_and_counts_quorums_from_its_settings(tmp_path):
    registry, records = SiloRegistry(ChangeCondition()), RunRecords(tmp_path)
    seen = []
    loop = RoundLoop(HubOnly(), RoundSettings(total_rounds=2, quorum=0.55), registry, records,
                     stop_event=threading.Event(), on_round=seen.append)
    state = loop.run()
    assert state.round == 2 and loop.phase == "done" and [r.round for r in seen] == [1, 2]
    assert torch.equal(state.tensors["model/x"], torch.full((2,), 2.0))
    assert loop.quorum_count(100) == 55 and loop.quorum_count(1) == 1
    assert RoundLoop(HubOnly(), RoundSettings(total_rounds=1, quorum_silos=4), registry, records,
                     stop_event=threading.Event()).quorum_count(3) == 3


def test_privacy_completes_a_round_from_the_task_and_hooks_alone():
    privacy = HubPrivacy(PrivacySection(dp=DPConfig(enabled=True, clip_norm=10.0)), seed=0)
    expected = {"delta/x": TensorSpec((3,), "float32"), "weight": TensorSpec((1,), "float32")}
    sums = RunningSum()
    for value in (1.0, 2.0):
        sums.add({"delta/x": torch.full((3,), value), "weight": torch.ones(1)}, {"n": 1.0})
    task = SimpleNamespace(round=1, sampled={"a", "b"}, reported={"a", "b"}, sums=sums, started=time.time(),
                           privacy=privacy.begin("t1", expected, {"a", "b"}, 2, 2))
    hooks = RoundHooks(cond=threading.Condition(), stop_event=threading.Event(), refuse=None)

    private = privacy.complete(task, 2, hooks)
    assert private.dp is not None and private.dp.epsilon > 0 and set(private.sums) == {"delta/x", "weight"}
    task.reported = {"a"}
    with pytest.raises(RoundFailed, match="1 of 2 sampled silos reported, below quorum 2"):
        privacy.complete(task, 2, hooks)


def test_hub_settings_take_every_round_wire_and_liveness_key_from_hub_yaml():
    config = parse_config({
        "data": {"labeled": {"kind": "demo"}},
        "run": {"seed": 7},
        "rounds": {"total": 9, "silos_per_round_count": 4, "min_silos": 3, "quorum": 0.75, "deadline_s": 90,
                   "max_attempts": 2, "wait_after_quorum_s": 12, "liveness_s": 30},
        "wire": {"max_upload_bytes": 4 << 20, "max_inflight_upload_bytes": 2 << 20, "half_precision": True},
        "security": {"max_update_norm": 5.0, "max_weight_factor": 2.5},
    })
    settings = HubSettings.from_config(config)
    assert settings == HubSettings(
        RoundSettings(total_rounds=9, silos_per_round=1.0, silos_per_round_count=4, min_silos=3, quorum=0.75,
                      quorum_silos=None, deadline_s=90.0, max_attempts=2, seed=7,
                      wait_after_quorum_s=12.0, max_weight_factor=2.5),
        WireLimits(max_upload_bytes=4 << 20, max_inflight_upload_bytes=2 << 20, max_update_norm=5.0,
                   half_precision=True),
        liveness_s=30.0,
    )


def test_a_join_logs_the_joining_silos_own_certificate_days_and_warns_when_it_is_near_expiry(caplog):
    registry = SiloRegistry(ChangeCondition())
    now = dt.datetime.now(dt.UTC)
    registry.cert_not_after.update({"fresh": now + dt.timedelta(days=80), "old": now + dt.timedelta(days=5)})
    assert registry.days_left("nobody") is None and 79.9 < registry.days_left("fresh") <= 80
    with caplog.at_level(logging.INFO, logger="silo_server"):
        registry.join("fresh", 10, 0, "cpu")
        registry.join("old", 10, 0, "cpu")
        registry.join("unknown", 10, 0, "cpu")  # no certificate seen (dev mode): no days, no warning
    lines = [r.getMessage() for r in caplog.records]
    assert any("silo fresh joined" in line and "certificate expires in 80 days" in line for line in lines)
    assert any("silo unknown joined (10 unlabeled, 0 labeled images, device cpu)" == line for line in lines)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "silo old expires in 5.0 days" in warnings[0] and "silo-certs renew old" in warnings[0]
