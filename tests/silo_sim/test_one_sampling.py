"""The deployed hub and the in-process runner draw a round's silos through one Sampling: the same seed and silo
names sample the same silos, round after round, in both."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from silo_core.algorithms.base import SiloAlgorithm, SiloData, SiloResult
from silo_core.models import ModelSpec
from silo_core.rounds import Sampling
from silo_sim.inprocess import run_inprocess
from tests.silo_server.test_hub import MeanOfSilos, make_hub, result, upload, wait_task

NAMES = [f"branch-{i:02d}" for i in range(10)]


class RecordingSilo(SiloAlgorithm):
    """MeanOfSilos' silo half: sends its vector, and notes which silo trained in which round."""

    def __init__(self):
        super().__init__(None, ModelSpec(), torch.device("cpu"))
        self.trained: dict[int, list[str]] = {}

    def local_update(self, plan, data):
        self.trained.setdefault(plan.round, []).append(data.silo_id)
        return SiloResult(result(1.0))


def hub_rounds(tmp_path, seed: int, rounds: int, **sampling) -> list[list[str]]:
    """The silos the deployed hub core sampled in each of `rounds` rounds, every sampled silo reporting."""
    hub = make_hub(tmp_path, seed=seed, total_rounds=rounds, min_silos=len(NAMES), **sampling)
    for name in reversed(NAMES):  # joined in another order than the in-process list: the draw must not care
        hub.join(name, 10, 0, "cpu")
    drawn: list[list[str]] = []
    state = hub.rounds.resume_or_init()
    for _ in range(rounds):
        out: dict = {}
        thread = threading.Thread(target=lambda s=state, o=out: o.setdefault("state", hub.rounds.run_round(s)),
                                  daemon=True)
        thread.start()
        tasks = {}
        while hub.rounds.task is None or hub.rounds.task.round != state.round + 1:
            threading.Event().wait(0.02)
        sampled = sorted(hub.rounds.task.sampled)
        for name in sampled:
            tasks[name] = wait_task(hub, name)
            upload(hub, name, tasks[name], result(1.0))
        thread.join(10)
        state = out["state"]
        drawn.append(sampled)
    return drawn


def test_the_same_seed_samples_the_same_silos_in_the_hub_and_in_process(tmp_path) -> None:
    for seed, sampling in ((0, {"silos_per_round": 0.3}), (7, {"silos_per_round_count": 4})):
        deployed = hub_rounds(tmp_path / f"hub-{seed}", seed, 3, **sampling)
        silo = RecordingSilo()
        silos = [SiloData(images=torch.zeros(1, 1, 28, 28, dtype=torch.uint8), silo_id=n) for n in NAMES]
        run_inprocess(MeanOfSilos(), silo, silos, rounds=3, seed=seed,
                      silos_per_round=sampling.get("silos_per_round", 1.0),
                      silos_per_round_count=sampling.get("silos_per_round_count"))
        in_process = [sorted(silo.trained[r]) for r in (1, 2, 3)]
        assert in_process == deployed
        assert all(len(d) == (3 if seed == 0 else 4) for d in deployed)
        assert len({tuple(d) for d in deployed}) > 1  # rounds draw anew


def test_a_draw_depends_on_the_names_the_round_and_the_attempt_not_the_order() -> None:
    sampling = Sampling(fraction=0.3, seed=5)
    first = sampling.sample(NAMES, 1)
    assert first == sampling.sample(list(reversed(NAMES)), 1) and len(first) == 3
    assert sampling.sample(NAMES, 1, attempt=2) != first or sampling.sample(NAMES, 2) != first
    assert len(sampling.sample(NAMES, 1, at_least=6)) == 6  # secure aggregation's fewest
    assert Sampling(count=20).sample(NAMES, 1) == NAMES


class ValueSilo(SiloAlgorithm):
    """Sends the vector its silo's name gives it, weighted by its images (as a real silo's result is)."""

    def __init__(self, values: dict[str, float]):
        super().__init__(None, ModelSpec(), torch.device("cpu"))
        self.values = values

    def local_update(self, plan, data):
        weight = float(data.images.shape[0])
        return SiloResult({"delta/x": torch.full((3,), self.values[data.silo_id] * weight),
                           "weight": torch.tensor([weight])})


def silos_with(images: dict[str, int]) -> list[SiloData]:
    return [SiloData(images=torch.zeros(n, 1, 28, 28, dtype=torch.uint8), silo_id=name) for name, n in images.items()]


def test_in_process_rounds_are_the_hub_round_loop_robust_rule_weight_cap_and_records(tmp_path) -> None:
    from silo_core.rounds import records_from_json
    from silo_server.rounds.robust import AggregationSection

    values = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0, "e": 1000.0}  # e: one silo far off the others
    silos = silos_with({name: 10 for name in values})
    state, history = run_inprocess(MeanOfSilos(), ValueSilo(values), silos, rounds=1, seed=0,
                                   aggregation=AggregationSection(rule="median"), state_dir=tmp_path / "median")
    assert state.tensors["model/x"].tolist() == [3.0, 3.0, 3.0]  # the coordinate-wise median, not the mean 202
    decision = history[0].aggregation
    assert decision is not None and decision.rule == "median" and decision.updates == 5
    assert "e" in decision.excluded_silos
    assert history[0].silos_sampled == history[0].silos_reported == 5
    # Only the silos whose updates the median's sum holds are credited (here the one holding every median value)
    assert history[0].silos_contributed == 5 - len(decision.excluded_silos)
    saved = json.loads((tmp_path / "median" / "history.json").read_text())  # the hub's own records
    assert records_from_json(saved["rounds"]) == history
    assert not (tmp_path / "median" / "round-updates").exists() or not any((tmp_path / "median" / "round-updates").iterdir())

    # The hub's weight cap applies in process too: a silo declaring 100x the median images carries 4x its weight.
    state, _ = run_inprocess(MeanOfSilos(), ValueSilo({"a": 0.0, "b": 0.0, "c": 10.0}),
                             silos_with({"a": 10, "b": 10, "c": 1000}), rounds=1, seed=0)
    assert state.tensors["model/x"].tolist() == [pytest.approx(10.0 * 40 / 60)] * 3


def test_an_in_process_round_a_rule_refuses_stops_the_run_instead_of_retrying_forever() -> None:
    from silo_server.rounds.robust import AggregationSection

    # Krum with f = 2 needs 2f + 3 = 7 updates; five silos can never give them.
    with pytest.raises(RuntimeError, match="round 1 failed 5 times in a row .*krum"):
        run_inprocess(MeanOfSilos(), ValueSilo({n: 1.0 for n in "abcde"}), silos_with({n: 10 for n in "abcde"}),
                      rounds=1, aggregation=AggregationSection(rule="krum", krum_byzantine=2))
