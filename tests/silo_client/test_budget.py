"""A silo's budget for one task (silo_client/budget.py), by its own ledger and policy: the DP-SGD limit is the
tightest of the hub's budget, the policy's per-run ceiling and what the lifetime budget leaves; a round that would
pass the client-level ceiling or the lifetime budget is refused before training; a charge is written to the ledger
and shown on /metrics."""

from __future__ import annotations

import math

from silo.v1 import silo_pb2
from silo_client.budget import TaskBudget
from silo_client.ledger import BranchLedger
from silo_client.metrics import SiloMetricFamilies, SiloMetrics
from silo_client.policy import BranchPolicy


def terms(noise: str = "distributed", z: float = 1.0) -> silo_pb2.PrivacyTerms:
    return silo_pb2.PrivacyTerms(client_dp=silo_pb2.ClientDPTerms(enabled=True, noise=noise, noise_multiplier=z))


def begun(ledger: BranchLedger, run_id: str, z: float | None = 1.0, sample_dp: bool = False) -> BranchLedger:
    """The run begun as the silo begins it when it pins the terms at join."""
    ledger.begin_run(run_id, hub_serial="1f", hub_fingerprint="ab" * 32, terms_sha256="cd" * 32, client_dp_noise=z,
                     sample_dp=sample_dp)
    return ledger


def task(round_: int, client_dp: bool = True, sample_dp: bool = False, sample_budget: float = 0.0) -> silo_pb2.Task:
    t = silo_pb2.Task(round=round_, task_id=f"t{round_}")
    t.privacy.client_dp.enabled = client_dp
    t.privacy.sample_dp.enabled = sample_dp
    t.privacy.sample_dp.epsilon_budget = sample_budget
    return t


def test_rounds_are_charged_until_the_next_would_pass_the_policys_ceiling_then_refused_before_training(tmp_path):
    ledger = begun(BranchLedger(tmp_path), "run-a")
    one_round = ledger.client_epsilon_after("run-a", 1.0)
    two_rounds = begun(BranchLedger(tmp_path / "probe"), "x")
    two_rounds.record_round("x", 1, client_dp_noise=1.0, sample_epsilon=None)
    ceiling = (one_round + two_rounds.client_epsilon_after("x", 1.0)) / 2  # room for one round, not two
    policy = BranchPolicy.model_validate({"client_dp": {"max_epsilon_per_run": ceiling}})
    families = SiloMetricFamilies()
    metrics = SiloMetrics(families, "s")

    first = TaskBudget(policy, ledger, terms(), "run-a", task(1))
    assert first.refusal_before_training() is None and math.isclose(first.client_epsilon_after(), one_round)
    figures = first.charge({}, metrics)
    assert math.isclose(ledger.run_epsilon("run-a").client, one_round) and figures  # written before anything leaves
    assert math.isclose(families.values["s"]["silokit_silo_epsilon"]["client_dp"], one_round)

    refusal = TaskBudget(policy, ledger, terms(), "run-a", task(2)).refusal_before_training()
    assert refusal is not None and (refusal.kind, refusal.clause, refusal.round) == (
        "budget", "client_dp.max_epsilon_per_run", 2)
    assert f"past the policy's ceiling of {ceiling:g}" in refusal.message


def test_central_noise_guards_nothing_against_the_hub_so_it_is_neither_counted_nor_refused(tmp_path):
    policy = BranchPolicy.model_validate({"client_dp": {"max_epsilon_per_run": 0.001}})
    budget = TaskBudget(policy, begun(BranchLedger(tmp_path), "run-a", z=None), terms(noise="central"), "run-a",
                        task(1))
    assert budget.client_epsilon_after() is None and budget.refusal_before_training() is None


def test_the_lifetime_budget_refuses_a_round_and_bounds_dp_sgd_with_what_earlier_runs_left(tmp_path):
    ledger = begun(begun(BranchLedger(tmp_path), "earlier", z=None, sample_dp=True), "now", z=0.5)
    ledger.record_round("earlier", 1, client_dp_noise=None, sample_epsilon=2.5)  # an earlier run spent 2.5
    policy = BranchPolicy.model_validate({"lifetime_epsilon": 3.0, "sample_dp": {"max_epsilon_per_run": 2.0}})
    # Client-level DP whose one round would pass what is left: refused, naming the lifetime budget.
    refusal = TaskBudget(policy, ledger, terms(z=0.5), "now", task(1)).refusal_before_training()
    assert refusal is not None and refusal.clause == "lifetime_epsilon" and "past the policy's budget of 3" in refusal.message
    # With DP-SGD the limit is the tightest: the hub's 4, the policy's 2 per run, the 0.5 the lifetime budget leaves.
    dp_sgd = TaskBudget(policy, ledger, silo_pb2.PrivacyTerms(), "now", task(1, client_dp=False, sample_dp=True,
                                                                             sample_budget=4.0))
    assert dp_sgd.refusal_before_training() is None and math.isclose(dp_sgd.sample_dp_limit(), 0.5)
    assert TaskBudget(None, ledger, silo_pb2.PrivacyTerms(), "now", task(1, client_dp=False)).sample_dp_limit() is None


def test_the_silo_leaves_at_a_dp_sgd_limit_only_when_its_own_policy_set_the_tightest_one(tmp_path):
    ledger = begun(begun(BranchLedger(tmp_path), "earlier", z=None, sample_dp=True), "now", z=None, sample_dp=True)
    ledger.record_round("earlier", 1, client_dp_noise=None, sample_epsilon=2.5)  # an earlier run spent 2.5

    def binding(policy: dict | None, hub_budget: float) -> str | None:
        return TaskBudget(BranchPolicy.model_validate(policy) if policy is not None else None, ledger,
                          silo_pb2.PrivacyTerms(), "now", task(1, client_dp=False, sample_dp=True,
                                                                 sample_budget=hub_budget)).policy_clause_binding_dp_sgd()

    per_run = {"sample_dp": {"max_epsilon_per_run": 2.0}}
    assert binding(per_run, 4.0) == "sample_dp.max_epsilon_per_run"  # the policy's 2 is tighter than the hub's 4
    assert binding(per_run, 1.0) is None  # the hub's own budget stops DP-SGD first: the silo stays, skipping
    assert binding(per_run, 2.0) is None  # a tie: the run's terms end it anyway
    assert binding({"lifetime_epsilon": 3.0}, 4.0) == "lifetime_epsilon"  # 0.5 left after the earlier run
    assert binding({"algorithms": ["semifl"]}, 4.0) is None  # a policy with no epsilon clause never leaves for it
    assert binding(None, 4.0) is None


def test_a_round_skipped_before_dp_sgd_keeps_the_runs_sample_level_epsilon_instead_of_making_it_infinite(tmp_path):
    # SemiFL skips a round where fewer than two images pass tau; under secure aggregation the silo still sends its
    # zeros and is charged. That charge carried no DP-SGD figure and recorded a round outside DP-SGD: the run's
    # sample-level epsilon (and so its per-image one, without client-level DP) turned infinite.
    ledger = begun(BranchLedger(tmp_path), "run-a", z=None, sample_dp=True)
    metrics = SiloMetrics(SiloMetricFamilies(), "s")
    no_client = silo_pb2.PrivacyTerms()

    def charge(round_, figures, skipped=False):
        return TaskBudget(None, ledger, no_client, "run-a", task(round_, client_dp=False, sample_dp=True,
                                                                   sample_budget=8.0)).charge(figures, metrics,
                                                                                             skipped=skipped)

    charge(1, {}, skipped=True)  # before any DP-SGD step: nothing spent yet
    assert ledger.run_epsilon("run-a").sample == 0.0
    charge(2, {"sample_dp_epsilon": 1.25})
    charge(3, {"pl_total": 40.0, "pl_selected": 1.0}, skipped=True)
    spent = ledger.run_epsilon("run-a")
    assert spent.sample == 1.25 and spent.image == 1.25
    charge(4, {"train_loss": 0.3})  # a trained round without the figure is still not covered by DP-SGD
    assert ledger.run_epsilon("run-a").sample == math.inf


def test_a_round_that_would_skip_dp_sgd_cannot_carry_the_lifetime_epsilon_past_the_policy(tmp_path):
    # Distributed client-level DP (z = 3) covers the lifetime budget of 6 for a while, so DP-SGD's total is not held
    # to it and grows to 2.5 a round. The round whose client step no longer fits was refused only without DP-SGD:
    # with it, a round skipped for too few confident images was charged that step and took the lifetime to 6.1.
    ledger = begun(BranchLedger(tmp_path), "now", z=3.0, sample_dp=True)
    policy = BranchPolicy.model_validate({"lifetime_epsilon": 6.0})
    metrics = SiloMetrics(SiloMetricFamilies(), "s")
    refused = None
    for r in range(1, 100):
        budget = TaskBudget(policy, ledger, terms(z=3.0), "now", task(r, sample_dp=True))
        refused = budget.refusal_before_training()
        if refused is not None:
            break
        if budget.client_epsilon_after() > 6.0:  # the client step no longer covers the budget: nothing passes tau
            budget.charge({"pl_total": 50.0, "pl_selected": 1.0}, metrics, skipped=True)
        else:
            budget.charge({"sample_dp_epsilon": 2.5 * r}, metrics)
        assert ledger.lifetime_epsilon() <= 6.0, f"round {r}"
    assert refused is not None and refused.clause == "lifetime_epsilon" and refused.round > 1
    assert ledger.lifetime_epsilon() <= 6.0
