"""The branch's policy: strict to load, and every clause refuses a run that falls short of it with one line that
names the clause and both values. Tasks that ask for less than the pinned terms are breaches."""

from __future__ import annotations

import math

import pytest

from security.dp import DPConfig, update_noise_multiplier
from security.secagg.params import SecAggParams
from security.terms import PROTOCOL_VERSION, run_terms, task_breaches
from silo.v1 import silo_pb2
from silo_client.policy import (
    BranchPolicy,
    PolicyError,
    check_run,
    check_upload,
    load_policy,
    required_noise_std,
)
from silo_core.dp_sgd import SampleDPConfig


def write(tmp_path, text):
    path = tmp_path / "branch-policy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,words", [
    ("secure_aggregation:\n  min_cohrt: 5\n", "unknown key 'secure_aggregation.min_cohrt'"),
    ("secure_aggregation:\n  min_cohort: '5'\n", "bad value for 'secure_aggregation.min_cohort'"),
    ("secure_aggregation:\n  required: yes please\n", "bad value for 'secure_aggregation.required'"),
    ("client_dp:\n  max_epsilon_per_run: .inf\n", "bad value for 'client_dp.max_epsilon_per_run'"),
    ("lifetime_epsilon: .nan\n", "bad value for 'lifetime_epsilon'"),
    ("delta: 1.5\n", "bad value for 'delta'"),
    ("- secure_aggregation\n", "expected a mapping of clauses"),
    ("secure_aggregation: [\n", "not valid YAML"),
])
def test_a_bad_policy_file_is_refused_naming_the_file_and_the_key(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value).startswith(str(path)) and words in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_a_missing_policy_file_says_what_to_pass(tmp_path):
    with pytest.raises(PolicyError, match="not found; pass --policy"):
        load_policy(tmp_path / "nope.yaml")


def test_a_policy_written_the_natural_way_loads(tmp_path):
    policy = load_policy(write(tmp_path, """
delta: 1.0e-6
secure_aggregation: {required: true, min_cohort: 5, min_threshold: 3}
client_dp: {required: true, min_noise_multiplier: 1, max_clip_norm: 2, max_epsilon_per_run: 8}
sample_dp: {required: false, max_epsilon_per_run: 4}
lifetime_epsilon: 20
algorithms: [semifl, fedseal]
models: [small_cnn]
model_factories: ["tests.model_factories:tiny"]
max_upload_bytes: 50000000
clear_metrics: false
"""))
    assert policy.secure_aggregation.min_cohort == 5 and policy.client_dp.min_noise_multiplier == 1.0
    assert policy.lifetime_epsilon == 20.0 and policy.models == ["small_cnn"] and not policy.clear_metrics
    assert load_policy(write(tmp_path, "")) == BranchPolicy()  # an empty file: no floor


def run_with(*, secagg=None, dp=None, sample_dp=None, algorithm="semifl", model="small_cnn", factory="",
             protocol=PROTOCOL_VERSION, min_cohort=3, architecture=()):
    terms = run_terms(secure_aggregation=SecAggParams(**{"enabled": True, "dropouts": 0, **(secagg or {})})
                      if secagg is not None else SecAggParams(),
                      dp=DPConfig(enabled=True, **dp) if dp is not None else DPConfig(),
                      sample_dp=SampleDPConfig(enabled=True, **sample_dp) if sample_dp is not None
                      else SampleDPConfig(), total_rounds=10, min_cohort=min_cohort, clear_metrics=["pl_total"])
    return silo_pb2.RunDescription(run_id="r1", algorithm=algorithm, model=model, model_factory=factory,
                                   protocol_version=protocol, terms=terms, architecture=list(architecture))


STRICT = {"secure_aggregation": {"required": True, "min_cohort": 5, "min_threshold": 3},
          "client_dp": {"required": True, "min_noise_multiplier": 1.0, "max_clip_norm": 1.0,
                        "max_epsilon_per_run": 8.0}}
GOOD_SECAGG, GOOD_DP = {"min_cohort": 5}, {"noise_multiplier": 1.2, "clip_norm": 0.5}


@pytest.mark.parametrize("policy,run,clause,line", [
    (STRICT, dict(dp=GOOD_DP), "secure_aggregation.required",
     "policy requires secure aggregation over at least 5 silos; this run has secure aggregation off"),
    (STRICT, dict(secagg=GOOD_SECAGG, dp=GOOD_DP, min_cohort=3), "secure_aggregation.min_cohort",
     "policy requires secure aggregation over at least 5 silos; this run sums as few as 3"),
    ({"secure_aggregation": {"min_threshold": 6}}, dict(secagg={}, min_cohort=5), "secure_aggregation.min_threshold",
     "policy requires a secure-aggregation threshold of at least 6 shares; this run's rounds may use 3"),
    (STRICT, dict(secagg=GOOD_SECAGG, min_cohort=5), "client_dp.required",
     "policy requires client-level DP; this run has none"),
    (STRICT, dict(secagg=GOOD_SECAGG, dp={**GOOD_DP, "noise": "central"}, min_cohort=5), "client_dp.noise",
     "policy requires client-level DP noise added by the silos themselves; this run adds it at the hub, which could "
     "leave it out"),
    (STRICT, dict(secagg=GOOD_SECAGG, dp={"noise_multiplier": 0.7}, min_cohort=5), "client_dp.min_noise_multiplier",
     "policy requires a client-level noise multiplier of at least 1; this run uses 0.7"),
    (STRICT, dict(secagg=GOOD_SECAGG, dp={**GOOD_DP, "clip_norm": 2.0}, min_cohort=5), "client_dp.max_clip_norm",
     "policy allows a clip norm of at most 1; this run's is 2"),
    (STRICT, dict(secagg=GOOD_SECAGG, min_cohort=5, dp={**GOOD_DP, "adaptive_clipping": {"enabled": True}}),
     "client_dp.max_clip_norm", "policy allows a clip norm of at most 1; this run's is inf (adaptive clipping may "
     "raise it that far)"),
    ({"sample_dp": {"required": True}}, dict(), "sample_dp.required",
     "policy requires sample-level DP-SGD; this run trains without it"),
    ({"sample_dp": {"min_noise_multiplier": 1.0}}, dict(sample_dp={"noise_multiplier": 0.5}),
     "sample_dp.min_noise_multiplier",
     "policy requires a DP-SGD noise multiplier of at least 1; this run uses 0.5"),
    ({"lifetime_epsilon": 20}, dict(dp={"noise": "central"}), "lifetime_epsilon",
     "policy sets a lifetime epsilon budget of 20; this run has no differential privacy that holds against the "
     "hub, so its epsilon would be unbounded"),
    ({"algorithms": ["fedseal"]}, dict(), "algorithms", "policy allows algorithms fedseal; this run uses semifl"),
    ({"models": ["torchvision/resnet18"]}, dict(), "models",
     "policy allows models torchvision/resnet18; this run uses small_cnn"),
    ({}, dict(factory="evil.module:build"), "model_factories",
     "policy allows model factories none; this run builds its model with evil.module:build (add it to "
     "model_factories, or --model-factory, if you trust it)"),
    ({"secure_aggregation": {"required": True}}, dict(secagg={}, protocol=0), "protocol",
     "policy requires typed privacy terms; this hub speaks wire protocol 1 and states none: the hub must run "
     "silokit 0.2.0 or newer"),
])
def test_each_clause_refuses_a_run_that_falls_short_with_its_named_line(policy, run, clause, line):
    refusal = check_run(BranchPolicy.model_validate(policy), run_with(**run), factories=())
    assert refusal is not None and (refusal.clause, refusal.message) == (clause, line)
    assert refusal.kind == "refused" and refusal.to_proto().kind == silo_pb2.PolicyRefusal.REFUSED


def test_the_epsilon_and_upload_clauses_use_the_silos_own_figures():
    policy = BranchPolicy.model_validate({**STRICT, "lifetime_epsilon": 20.0, "max_upload_bytes": 1000})
    run = run_with(secagg=GOOD_SECAGG, dp=GOOD_DP, min_cohort=5)
    assert check_run(policy, run, factories=(), client_epsilon_one_round=7.9, lifetime_spent=19.9,
                     model_bytes=1000) is None  # within every limit
    over = check_run(policy, run, factories=(), client_epsilon_one_round=8.5)
    assert (over.clause, over.required, over.offered) == ("client_dp.max_epsilon_per_run", "8.0", "8.5")
    spent = check_run(policy, run, factories=(), lifetime_spent=20.0)
    assert spent.message == ("policy sets a lifetime epsilon budget of 20; this branch has spent 20 in earlier runs")
    big = check_run(policy, run, factories=(), model_bytes=1001)
    assert big.clause == "max_upload_bytes" and "takes at least 1001 bytes" in big.message
    assert check_upload(policy, 1001, 3).message == ("policy allows at most 1000 bytes per upload; round 3 would "
                                                     "send 1001")
    assert check_upload(policy, 1000, 3) is None and check_upload(None, 10**12, 3) is None


def test_a_run_meeting_the_strict_policy_is_accepted():
    policy = BranchPolicy.model_validate({**STRICT, "algorithms": ["semifl"], "models": ["small_cnn"],
                                          "model_factories": ["pkg.mod:build"]})
    assert check_run(policy, run_with(secagg=GOOD_SECAGG, dp=GOOD_DP, min_cohort=5), factories=()) is None
    assert check_run(BranchPolicy(), run_with(factory="pkg.mod:build"), factories=("pkg.mod:build",)) is None


def pinned_terms():
    return run_with(secagg=GOOD_SECAGG, dp=GOOD_DP, sample_dp={"noise_multiplier": 1.1}, min_cohort=5).terms


def honest_task(terms, contributors=5):
    dp = terms.client_dp
    return silo_pb2.TaskPrivacy(
        secagg_session="s", min_contributors=contributors, sample_dp=terms.sample_dp,
        client_dp=silo_pb2.TaskClientDP(enabled=True, clip_norm=dp.clip_norm, clip_tensors=list(dp.clip_tensors),
                                        noise_std=dp.noise_multiplier * dp.clip_norm / math.sqrt(contributors)))


def test_a_task_that_agrees_with_the_pinned_terms_is_no_breach():
    terms = pinned_terms()
    assert task_breaches(terms, honest_task(terms)) == []
    assert task_breaches(terms, honest_task(terms, contributors=8)) == []  # a bigger cohort, less noise each


@pytest.mark.parametrize("change,clause,words", [
    (lambda t: t.client_dp.__setattr__("noise_std", t.client_dp.noise_std / 2), "client_dp.noise",
     "a task lowered the noise"),
    (lambda t: t.ClearField("secagg_session"), "secure_aggregation.required",
     "a task turned secure aggregation off: the run's pinned terms say secure aggregation on, this task asks secure "
     "aggregation off"),
    (lambda t: t.__setattr__("min_contributors", 2), "secure_aggregation.min_cohort",
     "a task lowered the round's cohort"),
    (lambda t: t.client_dp.__setattr__("clip_norm", 5.0), "client_dp.max_clip_norm", "a task raised the clip norm"),
    (lambda t: t.ClearField("client_dp"), "client_dp.required", "a task changed client-level DP"),
    (lambda t: t.sample_dp.__setattr__("noise_multiplier", 0.3), "sample_dp.min_noise_multiplier",
     "a task lowered the DP-SGD noise"),
    (lambda t: t.sample_dp.__setattr__("clip_norm", 50.0), "terms", "a task raised the DP-SGD clip norm"),
    # NaN compares false with everything: a "noise std < floor" check let it through, and the silo's
    # max(policy floor, NaN) was NaN, which privatize_update read as no noise at all while the ledger charged z.
    (lambda t: t.client_dp.__setattr__("noise_std", math.nan), "client_dp.noise", "a task lowered the noise"),
    (lambda t: t.sample_dp.__setattr__("noise_multiplier", math.nan), "sample_dp.min_noise_multiplier",
     "a task lowered the DP-SGD noise"),
    (lambda t: t.sample_dp.__setattr__("clip_norm", math.nan), "terms", "a task raised the DP-SGD clip norm"),
])
def test_a_task_asking_less_than_the_pinned_terms_is_a_breach_naming_both_values(change, clause, words):
    terms = pinned_terms()
    task = honest_task(terms)
    change(task)
    breaches = task_breaches(terms, task)
    assert breaches and breaches[0].clause == clause and words in breaches[0].message
    assert breaches[0].pinned in breaches[0].message and breaches[0].asked in breaches[0].message


def test_the_noise_a_silo_adds_is_never_below_its_policy():
    terms = pinned_terms()  # z = 1.2
    task = honest_task(terms, contributors=4)
    assert required_noise_std(None, terms, task) == pytest.approx(1.2 * 0.5 / 2)
    stricter = BranchPolicy.model_validate({"client_dp": {"min_noise_multiplier": 2.0}})
    assert required_noise_std(stricter, terms, task) == pytest.approx(2.0 * 0.5 / 2)
    central = run_with(dp={"noise": "central"}).terms
    assert required_noise_std(stricter, central, task) == 0.0  # no silo noise under central DP


def test_without_a_secure_sum_the_task_cannot_split_the_noise_over_other_silos():
    """Terms stating distributed noise with secure aggregation off (a hub that lies, or misconfigured): the hub sees
    this silo's update alone, so all of the noise is the silo's own, whatever min_contributors the task states."""
    terms = run_with(dp={**GOOD_DP, "noise": "distributed"}).terms
    assert terms.client_dp.noise == "distributed" and not terms.secure_aggregation.enabled
    task = silo_pb2.TaskPrivacy(min_contributors=10_000, client_dp=silo_pb2.TaskClientDP(
        enabled=True, clip_norm=0.5, clip_tensors=list(terms.client_dp.clip_tensors), noise_std=1.2 * 0.5 / 100))
    (breach,) = task_breaches(terms, task)
    assert breach.clause == "client_dp.noise" and "sqrt(1) silos" in breach.message
    assert required_noise_std(None, terms, task) == pytest.approx(1.2 * 0.5)


def test_adaptive_clipping_keeps_the_noise_on_its_clipping_indicator():
    terms = run_with(secagg=GOOD_SECAGG, dp={**GOOD_DP, "adaptive_clipping": {"enabled": True, "max_clip_norm": 1.0}},
                     min_cohort=5).terms
    assert terms.client_dp.adaptive
    task = honest_task(terms)
    task.client_dp.adaptive = True
    # As the hub plans it: indicator noise sigma_b in all, the update's raised to z_Delta so that both compose to z.
    z, sigma_b, m = terms.client_dp.noise_multiplier, 1.0, 5
    task.client_dp.indicator_noise_std = sigma_b / math.sqrt(m)
    task.client_dp.noise_std = update_noise_multiplier(z, sigma_b) * terms.client_dp.clip_norm / math.sqrt(m)
    assert task_breaches(terms, task) == []
    task.client_dp.noise_std = z * terms.client_dp.clip_norm / math.sqrt(m)  # the update's floor alone: too little
    (breach,) = task_breaches(terms, task)
    assert breach.clause == "client_dp.noise" and "update and its clipping indicator together" in breach.message
    task.client_dp.noise_std = update_noise_multiplier(z, sigma_b) * terms.client_dp.clip_norm / math.sqrt(m)
    task.client_dp.indicator_noise_std = 1e-9  # a token indicator noise: the pair composes to almost no privacy
    (breach,) = task_breaches(terms, task)
    assert breach.clause == "client_dp.noise" and breach.asked.startswith("4.472e-09 (update")
    task.client_dp.indicator_noise_std = 0.0  # the count of unclipped silos would leave un-noised
    (breach,) = task_breaches(terms, task)
    assert breach.clause == "client_dp.noise" and "clipping indicator" in breach.message


def test_the_hubs_own_adaptive_plan_composes_to_exactly_the_pinned_multiplier():
    # The check above must pass what an honest hub sends: its DP controller's plan for a round of 5 contributors.
    from silo_server.rounds.privacy import DPController

    dp = {**GOOD_DP, "noise": "distributed", "adaptive_clipping": {"enabled": True, "max_clip_norm": 1.0}}
    terms = run_with(secagg=GOOD_SECAGG, dp=dp, min_cohort=5).terms
    plan = DPController(DPConfig(enabled=True, **dp), True, seed=0).plan_round(10, 20, 5)
    task = honest_task(terms)
    task.client_dp.adaptive, task.client_dp.clip_norm = True, plan.clip_norm
    task.client_dp.noise_std, task.client_dp.indicator_noise_std = plan.noise_std, plan.indicator_noise_std
    assert task_breaches(terms, task) == []
