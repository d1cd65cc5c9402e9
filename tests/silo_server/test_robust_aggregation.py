"""Robust aggregation (hub.yaml aggregation.rule, silo_server/rounds/robust.py): each rule's arithmetic on small known
vectors, the hub's path through individual update files, the round record and Prometheus, and the config's
refusals."""


import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from silo_core.rounds import AggregationRound, RoundRecord, records_from_json
from silo_server.config import ConfigError, parse_config
from silo_server.metrics import HubMetrics
from silo_server.rounds.robust import (
    AggregationRefused,
    AggregationSection,
    UpdateStore,
    aggregate,
    coordinate_band,
    coordinate_wise,
    fltrust_coefficients,
    krum_select,
)
from tests.silo_server.hubs import build_hub
from tests.silo_server.test_hub import MeanOfSilos, TwoGroups, grouped, result, start_round, upload, wait_task
from tests.silo_server.test_privacy import round_until_stopped


def store_of(tmp_path, updates):
    store = UpdateStore(tmp_path / "round-updates" / "t")
    for silo, tensors in updates.items():
        store.keep(silo, store.write(tensors))
    return store


def vec(*values, weight=1.0):
    return {"delta/x": torch.tensor(values) * weight, "weight": torch.tensor([weight])}


# ------------------------------------------------------------------ the arithmetic
def test_median_and_trimmed_mean_are_exact_per_coordinate():
    stack = torch.tensor([[1.0, 10.0], [2.0, -5.0], [3.0, 0.0], [100.0, 1.0], [4.0, 2.0]], dtype=torch.float64)
    value, kept = coordinate_wise(stack, *coordinate_band(5, "median", 0.0))
    assert value.tolist() == [3.0, 1.0]
    assert kept.tolist() == [0, 0, 1, 1, 0]  # coordinate 0 keeps silo 2, coordinate 1 keeps silo 3
    value, _ = coordinate_wise(stack[:4], *coordinate_band(4, "median", 0.0))
    assert value.tolist() == [2.5, 0.5]  # an even count: the mean of the two middle values
    value, _ = coordinate_wise(stack, *coordinate_band(5, "trimmed_mean", 0.2))  # k = 1 cut at each end
    assert torch.allclose(value, torch.tensor([3.0, 1.0], dtype=torch.float64))
    assert coordinate_band(3, "trimmed_mean", 0.45) == (1, 2)  # never cuts everything
    # Any trim_fraction above 0 cuts at least one value at each end: the default 0.1 cut none below ten silos
    assert coordinate_band(5, "trimmed_mean", 0.1) == (1, 4) and coordinate_band(9, "trimmed_mean", 0.1) == (1, 8)
    assert coordinate_band(20, "trimmed_mean", 0.1) == (2, 18) and coordinate_band(5, "trimmed_mean", 0.0) == (0, 5)
    assert coordinate_band(2, "trimmed_mean", 0.1) == (0, 2)  # two values: nothing can be cut


def test_krum_picks_the_honest_cluster_when_one_silo_sends_a_huge_update():
    points = torch.tensor([[0.0], [0.1], [0.2], [0.15], [50.0]], dtype=torch.float64)
    distances = torch.cdist(points, points).square()
    assert 4 not in krum_select(distances, byzantine=1, keep=4)
    assert krum_select(distances, byzantine=1, keep=1)[0] in (1, 3)  # the centre of the cluster
    with pytest.raises(AggregationRefused, match="2f \\+ 3 = 7"):
        krum_select(distances, byzantine=2, keep=1)


def test_fltrust_gives_zero_weight_to_an_update_opposed_to_the_root_and_rescales_norms():
    # root g0 = (1, 0), |g0| = 1; u0 = (10, 0) agrees (cos 1), u1 = (-3, 0) opposes, u2 = (1, 1) at 45 degrees
    dots = torch.tensor([10.0, -3.0, 1.0], dtype=torch.float64)
    norms = torch.tensor([10.0, 3.0, 2 ** 0.5], dtype=torch.float64)
    coefficients, trust = fltrust_coefficients(dots, norms, 1.0)
    assert trust[1] == 0 and coefficients[1] == 0
    assert torch.allclose(trust, torch.tensor([1.0, 0.0, 2 ** -0.5], dtype=torch.float64))
    # each kept update counts at the root's norm: a_i |u_i| = TS_i / sum TS
    assert torch.allclose(coefficients * norms, trust / trust.sum())
    none, _ = fltrust_coefficients(torch.tensor([-1.0, -2.0], dtype=torch.float64),
                                   torch.tensor([1.0, 2.0], dtype=torch.float64), 1.0)
    assert none.tolist() == [0.0, 0.0]


def test_rules_read_update_files_and_give_the_algorithm_sums_it_divides_by_the_weight(tmp_path):
    # weights 2, 1, 1, 1, 1: model changes 1, 2, 3, 4 and a poisoned 1000
    updates = {"a": vec(1.0, weight=2.0), "b": vec(2.0), "c": vec(3.0), "d": vec(4.0), "evil": vec(1000.0)}
    store = store_of(tmp_path, updates)
    groups = {"": ["delta/x", "weight"]}
    sums, decision = aggregate(store, groups, AggregationSection(rule="median"))
    assert sums["weight"].item() == 6.0 and sums["delta/x"].item() / 6.0 == 3.0
    assert decision == AggregationRound("median", updates=5, down_weighted=0, excluded=4,
                                        excluded_silos=("a", "b", "d", "evil"))
    sums, decision = aggregate(store, groups, AggregationSection(rule="multi_krum", krum_byzantine=1))
    assert decision.excluded_silos == ("evil",)  # m = n - f = 4: the four honest ones, with their weights
    assert sums["delta/x"].item() / sums["weight"].item() == pytest.approx((2 * 1 + 2 + 3 + 4) / 5 * 6 / 6)
    sums, _ = aggregate(store, groups, AggregationSection(rule="trimmed_mean", trim_fraction=0.2))
    assert sums["delta/x"].item() / 6.0 == pytest.approx(3.0)
    root = {"delta/x": torch.tensor([-1.0])}  # the root disagrees with everyone: nothing moves
    sums, decision = aggregate(store, groups, AggregationSection(rule="fltrust"), root=lambda: root)
    assert sums["delta/x"].item() == 0.0 and decision.excluded == 5


def test_grouped_results_are_aggregated_group_by_group(tmp_path):
    store = store_of(tmp_path, {"s1": grouped(a=(2, 1.0)), "s2": grouped(a=(1, 3.0), b=(1, 4.0)),
                                "s3": grouped(a=(1, 2.0), b=(3, 6.0))})
    sums, _ = aggregate(store, {"a": ["a/delta/x", "a/weight"], "b": ["b/delta/x", "b/weight"]},
                        AggregationSection(rule="median"))
    assert sums["a/weight"].item() == 4.0 and torch.allclose(sums["a/delta/x"] / 4.0, torch.full((2,), 2.0,
                                                                                               dtype=torch.float64))
    assert sums["b/weight"].item() == 4.0 and torch.allclose(sums["b/delta/x"] / 4.0, torch.full((2,), 5.0,
                                                                                               dtype=torch.float64))


# ------------------------------------------------------------------ the hub
def test_the_hub_applies_the_honest_median_keeps_updates_out_of_ram_and_deletes_them(tmp_path):
    seen = []
    hub = build_hub(MeanOfSilos(), state_dir=tmp_path, total_rounds=3, run_description={"algorithm": "mean"},
              min_silos=5, quorum=1.0, deadline_s=10.0, aggregation=AggregationSection(rule="median"),
              on_round=seen.append)
    metrics = HubMetrics(hub, registry=CollectorRegistry())
    silos = ["s1", "s2", "s3", "s4", "evil"]
    for s in silos:
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in silos}
    values = {"s1": 1.0, "s2": 2.0, "s3": 3.0, "s4": 5.0, "evil": 1e6}
    folder = tmp_path / "round-updates" / tasks["s1"].task_id
    for count, s in enumerate(silos[:4], 1):
        upload(hub, s, tasks[s], {"delta/x": torch.full((3,), values[s]), "weight": torch.tensor([1.0])})
        task = hub.rounds.task
        assert task.sums.tensors == {} and task.sums.contributors == count  # nothing summed in RAM ...
        assert len(list(folder.glob("*.safetensors"))) == count  # ... each update is in its own file
    upload(hub, "evil", tasks["evil"], {"delta/x": torch.full((3,), values["evil"]), "weight": torch.tensor([1.0])})
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 3.0))  # the honest silos' median
    assert not any((tmp_path / "round-updates").glob("*/*.safetensors"))  # deleted with the round
    record = hub.records.history[-1]
    assert record.aggregation is not None and record.aggregation.rule == "median"
    assert "evil" in record.aggregation.excluded_silos
    # A silo the rule left out of the applied sum is not credited with the round (card, gauge, record).
    excluded = set(record.aggregation.excluded_silos)
    assert record.silos_contributed == len(silos) - len(excluded) and record.silos_reported == len(silos)
    assert set(hub.records.contributed) == set(silos) - excluded
    assert records_from_json([record.to_json()]) == [record]
    assert seen == [record]
    scrape = metrics.registry.get_sample_value
    assert scrape("silokit_hub_round_aggregation_silos", {"decision": "excluded"}) == record.aggregation.excluded
    assert scrape("silokit_hub_aggregation_silos_total", {"decision": "excluded"}) == record.aggregation.excluded


def test_the_hub_aggregates_each_group_of_a_grouped_algorithm(tmp_path):
    hub = build_hub(TwoGroups(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "two"}, min_silos=3,
              quorum=1.0, deadline_s=10.0, aggregation=AggregationSection(rule="median"))
    for s in ("s1", "s2", "s3"):
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in ("s1", "s2", "s3")}
    upload(hub, "s1", tasks["s1"], grouped(a=(2, 1.0)))
    upload(hub, "s2", tasks["s2"], grouped(a=(1, 3.0), b=(1, 4.0)))
    upload(hub, "s3", tasks["s3"], grouped(a=(1, 2.0), b=(3, 6.0)))
    thread.join(10)
    assert torch.allclose(out["state"].tensors["model/a"], torch.full((2,), 2.0))
    assert torch.allclose(out["state"].tensors["model/b"], torch.full((2,), 5.0))


def test_krum_with_too_few_updates_fails_the_round_and_deletes_its_files(tmp_path):
    hub = build_hub(MeanOfSilos(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "mean"},
              min_silos=2, quorum=1.0, deadline_s=10.0, aggregation=AggregationSection(rule="krum"))
    for s in ("a", "b"):
        hub.join(s, 10, 0, "cpu")
    thread, stopped = round_until_stopped(hub)
    tasks = {s: wait_task(hub, s) for s in ("a", "b")}
    for s in ("a", "b"):
        upload(hub, s, tasks[s], {"delta/x": torch.ones(3), "weight": torch.tensor([1.0])})
    deadline = 50
    while hub.rounds.failed_attempts == 0 and deadline:
        thread.join(0.1)
        deadline -= 1
    assert hub.rounds.failed_attempts == 1 and hub.registry.counters["rounds_failed"] == 1
    assert not any((tmp_path / "round-updates").glob("*/*.safetensors"))
    hub.stop()
    thread.join(10)
    assert stopped == [True]


def seven_silos_under_krum(tmp_path, deadline_s: float):
    """A hub whose rounds sample 7 joined silos under Krum with f = 1 (5 updates needed), quorum 0.6, a 0.2 s wait
    after the quorum."""
    hub = build_hub(MeanOfSilos(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "mean"},
                    min_silos=7, quorum=0.6, deadline_s=deadline_s, wait_after_quorum_s=0.2,
                    aggregation=AggregationSection(rule="krum", krum_byzantine=1))
    silos = [f"s{i}" for i in range(7)]
    for s in silos:
        hub.join(s, 10, 0, "cpu")
    return hub, silos


def test_a_krum_round_waits_for_the_updates_krum_needs_not_for_reports_that_are_skips(tmp_path):
    # Krum (f = 1) needs 5 updates. Two quick skips and three updates made the 5 reports the round waited for: it
    # closed after the quorum wait without the two silos still training, and Krum refused its 3 updates.
    hub, silos = seven_silos_under_krum(tmp_path, deadline_s=20.0)
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in silos}
    for s in silos[:2]:
        upload(hub, s, tasks[s], {}, skipped=True)
    for s in silos[2:5]:
        upload(hub, s, tasks[s], result(1.0))
    time.sleep(1.0)  # five times the quorum wait
    assert hub.rounds.task is not None and hub.rounds.task.open and hub.rounds.failed_attempts == 0
    for s in silos[5:]:
        upload(hub, s, tasks[s], result(1.0))
    thread.join(10)
    assert out["state"].round == 1 and hub.rounds.failed_attempts == 0
    assert hub.records.history[-1].aggregation.updates == 5


def test_a_krum_round_that_can_no_longer_get_its_updates_closes_after_the_quorum_wait_not_its_deadline(tmp_path):
    # Three skips, three updates and one silo that never reports: at most four updates of the five Krum needs can
    # come, so waiting for them would only hold the attempt to its deadline before Krum refuses it.
    hub, silos = seven_silos_under_krum(tmp_path, deadline_s=60.0)
    thread, stopped = round_until_stopped(hub)
    tasks = {s: wait_task(hub, s) for s in silos}
    started = time.time()
    for s in silos[:3]:
        upload(hub, s, tasks[s], {}, skipped=True)
    for s in silos[3:6]:
        upload(hub, s, tasks[s], result(1.0))
    while hub.rounds.failed_attempts == 0 and time.time() - started < 30:
        time.sleep(0.05)
    assert hub.rounds.failed_attempts == 1 and time.time() - started < 30  # not the 60 s deadline
    hub.stop()
    thread.join(10)


def test_a_record_without_a_rule_reads_back_without_one():
    record = RoundRecord(round=1)
    assert "aggregation_rule" not in record.to_json() and RoundRecord.from_json(record.to_json()) == record


# ------------------------------------------------------------------ configuration
def config(**sections):
    return {"data": {"labeled": {"kind": "demo", "split": "train"}}, **sections}


def test_secure_aggregation_allows_only_the_mean_and_names_the_option():
    raw = config(aggregation={"rule": "median"}, privacy={"secure_aggregation": {"enabled": True}})
    with pytest.raises(ConfigError, match="aggregation.rule"):
        parse_config(raw)
    parse_config(config(aggregation={"rule": "mean"}, privacy={"secure_aggregation": {"enabled": True}}))


def test_config_refuses_what_a_rule_cannot_do():
    with pytest.raises(ConfigError, match="2f \\+ 3 = 5"):
        parse_config(config(aggregation={"rule": "krum"}, rounds={"min_silos": 3}))
    parse_config(config(aggregation={"rule": "krum"}, rounds={"min_silos": 5}))
    with pytest.raises(ConfigError, match="fltrust.*semifl"):
        parse_config(config(aggregation={"rule": "fltrust"}, algorithm={"name": "hassle"}))
    parse_config(config(aggregation={"rule": "fltrust"}))  # SemiFL computes the hub's update
    with pytest.raises(ConfigError, match="multi_krum_keep"):
        parse_config(config(aggregation={"rule": "median", "multi_krum_keep": 2}))
    with pytest.raises(ConfigError, match="aggregation.nope"):
        parse_config(config(aggregation={"nope": 1}))


def test_semifl_gives_fltrust_a_root_update_named_as_its_plan_and_leaves_the_state_alone(tmp_path):
    from tests.silo_core.test_semifl import tiny_hub

    hub = tiny_hub()
    state = hub.init_state()
    before = {k: v.clone() for k, v in state.tensors.items()}
    plan = hub.begin_round(state)
    root = hub.trusted_update(state)
    deltas = sorted(n for n in plan.expected if n.startswith("delta/"))
    assert sorted(root) == deltas and any(root[n].abs().sum() > 0 for n in deltas)
    assert all(torch.equal(before[k], state.tensors[k]) for k in before)
    # a silo sending the root's direction keeps full trust, one sending its opposite none
    store = store_of(tmp_path, {"ally": {**{n: 3 * root[n] for n in deltas}, "weight": torch.tensor([1.0])},
                                "foe": {**{n: -root[n] for n in deltas}, "weight": torch.tensor([1.0])}})
    sums, decision = aggregate(store, {"": list(plan.expected)}, AggregationSection(rule="fltrust"),
                               root=lambda: root)
    assert decision.excluded_silos == ("foe",)
    for n in deltas:  # the ally's update rescaled to the root's norm: the root itself
        assert torch.allclose(sums[n].float() / 2.0, root[n], atol=1e-6)
