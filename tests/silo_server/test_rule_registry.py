"""The aggregation rule registry (silo_server/rules/): today's rules and what each declares, and a new rule added
from outside the package (here, in this file) that hub.yaml accepts and the hub core runs a round with."""

import pytest
import torch

from silo_server.config import ConfigError, parse_config
from silo_server.rounds.robust import AggregationSection, UpdateStore, aggregate
from silo_server.rules import RULES, AggregationRule, Group, GroupResult, get_rule, register
from tests.silo_server.hubs import build_hub
from tests.silo_server.test_hub import MeanOfSilos, start_round, upload, wait_task


def config(**sections):
    return {"data": {"labeled": {"kind": "demo", "split": "train"}}, **sections}


# ------------------------------------------------------------------ today's rules
def test_the_registry_lists_todays_six_rules_with_their_constraints():
    settings = AggregationSection(rule="krum", krum_byzantine=2)
    declared = {name: (rule.needs_updates, rule.composes_with_secure_aggregation, rule.composes_with_dp,
                       rule.needs_trusted_update, rule().min_updates(settings)) for name, rule in RULES.items()}
    #                needs updates, secure aggregation, dp, trusted update, fewest updates (f = 2)
    assert declared == {"mean": (False, True, True, False, 1),
                        "trimmed_mean": (True, False, False, False, 1),
                        "median": (True, False, False, False, 1),
                        "krum": (True, False, False, False, 7),
                        "multi_krum": (True, False, False, False, 7),
                        "fltrust": (True, False, False, True, 1)}
    assert list(RULES) == ["mean", "trimmed_mean", "median", "krum", "multi_krum", "fltrust"]  # hub.yaml's order
    assert all(get_rule(name).name == name for name in RULES)


def test_an_option_set_under_a_rule_that_never_reads_it_is_refused():
    with pytest.raises(ValueError, match="aggregation.trim_fraction applies to aggregation.rule: 'trimmed_mean' only"):
        AggregationSection(rule="median", trim_fraction=0.3)
    with pytest.raises(ValueError, match="aggregation.krum_byzantine applies to aggregation.rule: 'krum' or"):
        AggregationSection(rule="mean", krum_byzantine=3)
    assert AggregationSection(rule="multi_krum", krum_byzantine=2, multi_krum_keep=3).krum_byzantine == 2
    assert AggregationSection(rule="median").trim_fraction == 0.1  # the default, not set: nothing to refuse


def test_a_round_samples_and_waits_for_the_rules_fewest_updates_when_there_are_enough_silos(tmp_path):
    # Only rounds.min_silos was checked against Krum's 2f + 3: silos_per_round 0.5 of 5 live silos drew rounds of
    # 2 that Krum refused, attempt after attempt, and a quorum of 3 closed rounds it would refuse too.
    hub = build_hub(MeanOfSilos(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "mean"},
                    min_silos=5, silos_per_round=0.5, quorum=0.5, deadline_s=60.0,
                    aggregation=AggregationSection(rule="krum", krum_byzantine=1))
    assert hub.rounds.rule_minimum(5) == 5 and hub.rounds.rule_minimum(3) == 3
    for s in "abcde":
        hub.join(s, 10, 0, "cpu")
    thread, _ = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in "abcde"}  # all five sampled, not 2
    assert hub.rounds.round_quorum(hub.rounds.task) == 5
    for s in "abcde":
        upload(hub, s, tasks[s], {"delta/x": torch.ones(3), "weight": torch.tensor([1.0])})
    thread.join(30)
    assert hub.records.history[-1].silos_reported == 5 and hub.rounds.failed_attempts == 0


def test_hub_yaml_names_the_registered_rules_when_it_refuses_one():
    for bad in ("medain", 3):
        with pytest.raises(ConfigError) as info:
            parse_config(config(aggregation={"rule": bad}))
        assert str(info.value) == ("hub.yaml: bad value for 'aggregation.rule': Input should be 'mean', "
                                   "'trimmed_mean', 'median', 'krum', 'multi_krum' or 'fltrust'")
    with pytest.raises(ValueError, match="unknown aggregation.rule 'medain'"):
        get_rule("medain")


def test_the_mean_rule_gives_the_sums_the_hub_streams(tmp_path):
    store = UpdateStore(tmp_path / "u")
    for silo, (value, weight) in {"a": (1.0, 2.0), "b": (4.0, 1.0)}.items():
        store.keep(silo, store.write({"delta/x": torch.full((2,), value * weight), "weight": torch.tensor([weight])}))
    sums, decision = aggregate(store, {"": ["delta/x", "weight"]}, AggregationSection())
    assert sums["weight"].item() == 3.0 and torch.allclose(sums["delta/x"], torch.full((2,), 6.0, dtype=torch.float64))
    assert decision.rule == "mean" and decision.excluded == decision.down_weighted == 0


def test_register_refuses_a_taken_name_and_a_rule_that_claims_too_much():
    with pytest.raises(ValueError, match="'median' is registered already"):
        register("median")(type("Again", (AggregationRule,), {"aggregate_group": lambda self, g, s: None}))
    with pytest.raises(TypeError, match="cannot compose with secure aggregation or DP"):
        register("private_median")(type("Private", (AggregationRule,), {
            "composes_with_dp": True, "aggregate_group": lambda self, g, s: None}))
    assert "private_median" not in RULES


# ------------------------------------------------------------------ a new rule, from outside the package
@pytest.fixture
def geometric_median():
    @register("geometric_median")
    class GeometricMedian(AggregationRule):
        """The weighted geometric median u = argmin_v sum_i w_i |v - u_i| over the group's whole model change
        (Pillutla et al. 2022, RFA), by Weiszfeld's iteration v <- sum_i a_i u_i / sum_i a_i, a_i = w_i / |v - u_i|,
        started at the weighted mean. The last iteration's a_i are the silos' coefficients, so a far-off update
        keeps a small part (down-weighted, not excluded)."""

        iterations = 100

        def aggregate_group(self, group: Group, settings: AggregationSection) -> GroupResult:
            n = len(group.silos)
            flat = torch.cat([group.stack(name).reshape(n, -1) for name in group.delta_names], dim=1)
            w = torch.tensor([group.weights[s] for s in group.silos], dtype=torch.float64)
            a = w
            for _ in range(self.iterations):
                v = (a[:, None] * flat).sum(0) / a.sum()
                a = w / (flat - v).norm(dim=1).clamp_min(1e-12)
            coefficients = {s: float(a[i] / a.sum()) for i, s in enumerate(group.silos)}
            return GroupResult(group.weighted_sums(coefficients), group.mean_parts(coefficients))

    yield GeometricMedian
    del RULES["geometric_median"]


def test_a_rule_registered_outside_the_package_runs_a_round_through_the_hub(tmp_path, geometric_median):
    assert get_rule("geometric_median").needs_updates  # the base's defaults: its updates are kept, no privacy
    hub = build_hub(MeanOfSilos(), state_dir=tmp_path, total_rounds=1, run_description={"algorithm": "mean"},
              min_silos=5, quorum=1.0, deadline_s=10.0, aggregation=AggregationSection(rule="geometric_median"))
    silos = ["s1", "s2", "s3", "s4", "evil"]
    for s in silos:
        hub.join(s, 10, 0, "cpu")
    thread, out = start_round(hub)
    tasks = {s: wait_task(hub, s) for s in silos}
    values = {"s1": 1.0, "s2": 2.0, "s3": 3.0, "s4": 5.0, "evil": 1e6}
    for s in silos:
        upload(hub, s, tasks[s], {"delta/x": torch.full((3,), values[s]), "weight": torch.tensor([1.0])})
        assert hub.rounds.task is None or hub.rounds.task.sums.tensors == {}  # kept in files, not summed
    thread.join(10)
    # On a line the geometric median is the median: 3, wherever the hostile silo puts its update.
    assert torch.allclose(out["state"].tensors["model/x"], torch.full((3,), 3.0), atol=1e-3)
    record = hub.records.history[-1]
    assert record.aggregation is not None and record.aggregation.rule == "geometric_median"
    assert "evil" in record.aggregation.down_weighted_silos and record.aggregation.updates == 5
    assert not any((tmp_path / "round-updates").glob("*/*.safetensors"))


def test_hub_yaml_takes_a_registered_rule_and_checks_its_constraints(geometric_median):
    assert parse_config(config(aggregation={"rule": "geometric_median"})).aggregation.rule == "geometric_median"
    with pytest.raises(ConfigError, match="aggregation.rule: geometric_median needs each silo's update"):
        parse_config(config(aggregation={"rule": "geometric_median"},
                            privacy={"secure_aggregation": {"enabled": True}}))
    with pytest.raises(ConfigError, match="trains on the hub alone"):
        parse_config(config(aggregation={"rule": "geometric_median"}, algorithm={"name": "server-only"}))
