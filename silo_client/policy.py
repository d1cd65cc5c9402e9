"""The branch's privacy policy: the floor under which this silo takes part in no run, whatever the hub says.

`silo-client --policy branch-policy.yaml` (docs/branch-operator.md documents every key). The silo compares the
run's pinned privacy terms (silo.v1.PrivacyTerms, security/terms.py) with the policy when it joins, before it reads
a single image, and refuses a run that falls short with one line naming the clause and both values. During the run
every task is checked again (security.terms.task_breaches, and `check_upload` here), and the silo enforces the
policy itself: its noise is never below what the policy requires, its own ledger stops it at its epsilon ceilings.

Limits of a clause apply whenever the run uses that mechanism; `required` makes the run use it. No policy file at
all means the silo follows the hub's terms (still checking every task against them, and keeping its ledger and
audit); it says so once at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from security.terms import FIRST_RELEASE, PROTOCOL_VERSION, noise_shares
from silo.v1 import silo_pb2
from silo_core.config_base import StrictConfig, format_validation_error

REFERENCE = "the policy reference in docs/branch-operator.md"


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file and the key."""


class SecureAggregationClause(StrictConfig):
    required: bool = Field(False, description="take part only in runs whose sums are securely aggregated, with "
                           "keys signed by the silos' certificates and a consistency round")
    min_cohort: int = Field(2, ge=2, le=100_000, description="every sum holds the inputs of at least this many silos")
    min_threshold: int = Field(2, ge=2, le=10_000, description="at least this many of this silo's neighbours must "
                               "reveal shares before its masks can be removed (the hub must win over this many)")


class ClientDPClause(StrictConfig):
    required: bool = Field(False, description="take part only in runs with client-level DP whose noise the silos "
                           "add themselves (distributed), so the hub never sees an un-noised sum")
    min_noise_multiplier: float = Field(0.0, ge=0, description="z of the run at least this")
    max_clip_norm: float | None = Field(None, gt=0, description="the run's clip norm (its largest, under adaptive "
                                        "clipping) at most this")
    max_epsilon_per_run: float | None = Field(None, gt=0, description="this silo's own client-level epsilon in one "
                                              "run (at the policy's delta) at most this: it leaves the run before "
                                              "a round would pass it")


class SampleDPClause(StrictConfig):
    required: bool = Field(False, description="take part only in runs that train every silo with DP-SGD")
    min_noise_multiplier: float = Field(0.0, ge=0, description="the DP-SGD noise multiplier at least this")
    max_epsilon_per_run: float | None = Field(None, gt=0, description="this silo's own DP-SGD epsilon in one run "
                                              "at most this: it trains no more once the next round would pass it")


class BranchPolicy(StrictConfig):
    """branch-policy.yaml: strict like hub.yaml (unknown keys, quoted numbers, .inf and .nan are refused)."""

    delta: float = Field(1e-5, gt=0, lt=1, description="the delta at which this silo states and limits its epsilon")
    secure_aggregation: SecureAggregationClause = Field(default_factory=SecureAggregationClause)
    client_dp: ClientDPClause = Field(default_factory=ClientDPClause)
    sample_dp: SampleDPClause = Field(default_factory=SampleDPClause)
    lifetime_epsilon: float | None = Field(None, gt=0, description="the branch's budget across all runs and all hubs "
                                           "(the sum of each run's per-image epsilon)")
    algorithms: list[str] | None = Field(None, description="algorithms this branch takes part in (none given: any)")
    models: list[str] | None = Field(None, description="library networks allowed: small_cnn, torchvision/resnet18, "
                                     "timm/<name>, ... (none given: any library network)")
    model_factories: list[str] = Field(default_factory=list, description="user factories (package.module:callable) "
                                       "this silo may import to build a run's model; --model-factory adds to them")
    max_upload_bytes: int | None = Field(None, ge=1, description="the most bytes one message to the hub may carry")
    clear_metrics: bool = Field(True, description="false: no clear per-silo metrics leave (pseudo-label counts, "
                                "losses, training time, device, unreadable-file counts); only what aggregation needs")


def load_policy(path: Path) -> BranchPolicy:
    path = Path(path)
    if not path.is_file():
        raise PolicyError(f"policy file {path} not found; pass --policy with the path to your branch-policy.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PolicyError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise PolicyError(f"{path}: expected a mapping of clauses (secure_aggregation, client_dp, ...), got "
                          f"{type(raw).__name__}")
    try:
        return BranchPolicy.model_validate(raw)
    except ValidationError as err:
        raise PolicyError(format_validation_error(err, str(path), REFERENCE)) from None


@dataclass(frozen=True)
class Refusal:
    """Why this silo will not take part (or go on): the clause, both values, the one line it logs and tells the
    hub (silo.v1.PolicyRefusal)."""

    kind: str  # "refused", "breach", "budget"
    clause: str
    required: str
    offered: str
    message: str
    round: int = 0

    def to_proto(self) -> silo_pb2.PolicyRefusal:
        kinds = {"refused": silo_pb2.PolicyRefusal.REFUSED, "breach": silo_pb2.PolicyRefusal.BREACH,
                 "budget": silo_pb2.PolicyRefusal.BUDGET}
        return silo_pb2.PolicyRefusal(kind=kinds[self.kind], clause=self.clause, required=self.required,
                                      offered=self.offered, message=self.message, round=self.round)


def _refuse(clause: str, required: Any, offered: Any, message: str) -> Refusal:
    return Refusal("refused", clause, str(required), str(offered), message)


def allowed_factories(policy: BranchPolicy | None, flags: tuple[str, ...]) -> tuple[str, ...]:
    """The model factories this silo may import: the policy's and --model-factory's."""
    return tuple(dict.fromkeys([*(policy.model_factories if policy else []), *flags]))


def check_run(policy: BranchPolicy, run: silo_pb2.RunDescription, *, factories: tuple[str, ...],
              lifetime_spent: float = 0.0, client_epsilon_one_round: float | None = None,
              model_bytes: int | None = None) -> Refusal | None:
    """The first clause of the policy the run falls short of, or None. Reads only the run description (and the
    silo's own ledger figures passed in): called at Join before any image is read.

    `client_epsilon_one_round`: this silo's client-level epsilon after one round at the run's noise multiplier by
    its own accounting (the ledger); `model_bytes`: the least one update of the run's model takes (float16)."""
    t = run.terms
    sa, dp, sd = t.secure_aggregation, t.client_dp, t.sample_dp
    p = policy
    wants_terms = (p.secure_aggregation.required or p.client_dp.required or p.sample_dp.required
                   or p.lifetime_epsilon is not None)
    if wants_terms and (run.protocol_version < PROTOCOL_VERSION or not run.HasField("terms")):
        return _refuse("protocol", f"a hub stating its privacy terms (protocol {PROTOCOL_VERSION})",
                       f"protocol {run.protocol_version or 1}",
                       f"policy requires typed privacy terms; this hub speaks wire protocol {run.protocol_version or 1} "
                       f"and states none: the hub must run silokit {FIRST_RELEASE[PROTOCOL_VERSION]} or newer")
    if p.algorithms is not None and run.algorithm not in p.algorithms:
        return _refuse("algorithms", ", ".join(p.algorithms), run.algorithm,
                       f"policy allows algorithms {', '.join(p.algorithms)}; this run uses {run.algorithm}")
    if run.model_factory:
        if run.model_factory not in factories:
            allowed = ", ".join(factories) or "none"
            return _refuse("model_factories", allowed, run.model_factory,
                           f"policy allows model factories {allowed}; this run builds its model with "
                           f"{run.model_factory} (add it to model_factories, or --model-factory, if you trust it)")
    elif p.models is not None and run.model not in p.models:
        return _refuse("models", ", ".join(p.models), run.model,
                       f"policy allows models {', '.join(p.models)}; this run uses {run.model}")
    if p.max_upload_bytes is not None and model_bytes is not None and model_bytes > p.max_upload_bytes:
        return _refuse("max_upload_bytes", p.max_upload_bytes, model_bytes,
                       f"policy allows at most {p.max_upload_bytes} bytes per upload; one update of this run's "
                       f"model ({run.model}) takes at least {model_bytes} bytes")
    c = p.secure_aggregation
    if c.required and not sa.enabled:
        return _refuse("secure_aggregation.required", f"secure aggregation over at least {c.min_cohort} silos",
                       "secure aggregation off", f"policy requires secure aggregation over at least {c.min_cohort} "
                       "silos; this run has secure aggregation off")
    if c.required and not sa.signed:
        return _refuse("secure_aggregation.signed", "signed keys and a consistency round", "unsigned",
                       "policy requires secure aggregation that holds against a hub that deviates (signed keys, a "
                       "consistency round); this run's is unsigned")
    if sa.enabled and sa.min_cohort < c.min_cohort:
        return _refuse("secure_aggregation.min_cohort", c.min_cohort, sa.min_cohort,
                       f"policy requires secure aggregation over at least {c.min_cohort} silos; this run sums as "
                       f"few as {sa.min_cohort}")
    if sa.enabled and sa.min_threshold < c.min_threshold:
        return _refuse("secure_aggregation.min_threshold", c.min_threshold, sa.min_threshold,
                       f"policy requires a secure-aggregation threshold of at least {c.min_threshold} shares; this "
                       f"run's rounds may use {sa.min_threshold}")
    d = p.client_dp
    if d.required and not dp.enabled:
        return _refuse("client_dp.required", "client-level DP", "no client-level DP",
                       "policy requires client-level DP; this run has none")
    if d.required and dp.noise != "distributed":
        return _refuse("client_dp.noise", "noise added at the silos (distributed)", f"{dp.noise} noise",
                       f"policy requires client-level DP noise added by the silos themselves; this run adds it "
                       f"{'at the hub, which could leave it out' if dp.noise == 'central' else dp.noise}")
    if dp.enabled and dp.noise_multiplier < d.min_noise_multiplier:
        return _refuse("client_dp.min_noise_multiplier", d.min_noise_multiplier, dp.noise_multiplier,
                       f"policy requires a client-level noise multiplier of at least {d.min_noise_multiplier:g}; "
                       f"this run uses {dp.noise_multiplier:g}")
    if dp.enabled and d.max_clip_norm is not None and dp.max_clip_norm > d.max_clip_norm:
        grows = " (adaptive clipping may raise it that far)" if dp.adaptive else ""
        return _refuse("client_dp.max_clip_norm", d.max_clip_norm, dp.max_clip_norm,
                       f"policy allows a clip norm of at most {d.max_clip_norm:g}; this run's is "
                       f"{dp.max_clip_norm:g}{grows}")
    if (dp.enabled and dp.noise == "distributed" and d.max_epsilon_per_run is not None
            and client_epsilon_one_round is not None and client_epsilon_one_round > d.max_epsilon_per_run):
        return _refuse("client_dp.max_epsilon_per_run", d.max_epsilon_per_run, round(client_epsilon_one_round, 4),
                       f"policy allows client-level epsilon {d.max_epsilon_per_run:g} per run at delta "
                       f"{p.delta:g}; one round at this run's noise multiplier {dp.noise_multiplier:g} already "
                       f"spends {client_epsilon_one_round:.3g}")
    s = p.sample_dp
    if s.required and not sd.enabled:
        return _refuse("sample_dp.required", "DP-SGD at every silo", "no DP-SGD",
                       "policy requires sample-level DP-SGD; this run trains without it")
    if sd.enabled and sd.noise_multiplier < s.min_noise_multiplier:
        return _refuse("sample_dp.min_noise_multiplier", s.min_noise_multiplier, sd.noise_multiplier,
                       f"policy requires a DP-SGD noise multiplier of at least {s.min_noise_multiplier:g}; this run "
                       f"uses {sd.noise_multiplier:g}")
    if p.lifetime_epsilon is not None:
        guarded = (dp.enabled and dp.noise == "distributed") or sd.enabled
        if not guarded:
            return _refuse("lifetime_epsilon", f"a lifetime epsilon of {p.lifetime_epsilon:g}",
                           "no differential privacy against the hub",
                           f"policy sets a lifetime epsilon budget of {p.lifetime_epsilon:g}; this run has no "
                           "differential privacy that holds against the hub, so its epsilon would be unbounded")
        if lifetime_spent >= p.lifetime_epsilon:
            return _refuse("lifetime_epsilon", p.lifetime_epsilon, round(lifetime_spent, 4),
                           f"policy sets a lifetime epsilon budget of {p.lifetime_epsilon:g}; this branch has spent "
                           f"{lifetime_spent:.4g} in earlier runs")
    return None


def required_noise_std(policy: BranchPolicy | None, pinned: silo_pb2.PrivacyTerms, task: silo_pb2.TaskPrivacy
                       ) -> float:
    """The least per-coordinate noise this silo adds to its clipped update in a round with distributed client-level
    DP: the pinned multiplier (and the policy's, when higher) times the round's clip, split over the round's
    minimum number of contributors. Whatever a task asks, the silo adds no less."""
    if not (pinned.client_dp.enabled and pinned.client_dp.noise == "distributed"):
        return 0.0
    z = max(pinned.client_dp.noise_multiplier, policy.client_dp.min_noise_multiplier if policy else 0.0)
    return z * task.client_dp.clip_norm / math.sqrt(noise_shares(task))


def check_upload(policy: BranchPolicy | None, size: int, round_number: int) -> Refusal | None:
    if policy is not None and policy.max_upload_bytes is not None and size > policy.max_upload_bytes:
        return Refusal("refused", "max_upload_bytes", str(policy.max_upload_bytes), str(size),
                       f"policy allows at most {policy.max_upload_bytes} bytes per upload; round {round_number} would "
                       f"send {size}", round_number)
    return None
