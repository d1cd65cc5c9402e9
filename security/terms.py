"""The run's privacy terms: one typed contract (silo.v1.PrivacyTerms) that the hub states and every silo checks.

The hub builds the terms once from hub.yaml (`run_terms`) and puts them in the run description; they are pinned
for the run. Every TRAIN task carries the round's privacy as typed fields too (silo.v1.TaskPrivacy), and a silo
refuses a task that asks for less than the pinned terms promise (`task_breaches`): noise lowered, a clip raised,
secure aggregation off, a cohort below the minimum. Whether the terms satisfy a branch is the branch's own policy
(silo_client/policy.py), which reads the same messages.

Protocol versions: 1 is every silokit before typed terms (privacy as a JSON string in the task; no Leave; unsigned
secure aggregation); 2 states the terms, types the task's privacy, signs secure aggregation and has Leave. A hub
refuses at join a silo that cannot follow its run's terms; a silo refuses a hub too old to state the terms its
policy requires.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from google.protobuf.json_format import MessageToDict

from security.dp import DPConfig
from security.secagg.params import SecAggParams
from silo.v1 import silo_pb2
from silo_core.dp_sgd import SampleDPConfig

PROTOCOL_VERSION = 2
# The first silokit release that speaks PROTOCOL_VERSION: what a refusal tells an operator to install.
FIRST_RELEASE = {2: "0.2.0"}
# secagg_2: shares that carry the session's parameters (its quantization rules, ring, k and t:
# security/secagg/messages.session_parameters), signed or not; signed_secagg_2: signed keys and survivor sets that
# bind them too. A silo of the first form cannot take part in a session with these, so the hub refuses it at join.
TYPED_TERMS, SIGNED_SECAGG, POLICY, SECAGG = "typed_terms", "signed_secagg_2", "policy", "secagg_2"
FEATURES = (TYPED_TERMS, SIGNED_SECAGG, POLICY, SECAGG)

# The clauses a refusal may name: the hub counts refusals by these labels only (anything else a silo sends is
# counted as "other"), so a silo cannot grow the hub's metrics with labels of its own.
CLAUSES = (
    "protocol", "secure_aggregation.required", "secure_aggregation.min_cohort", "secure_aggregation.min_threshold",
    "secure_aggregation.signed", "client_dp.required", "client_dp.noise", "client_dp.min_noise_multiplier",
    "client_dp.max_clip_norm", "client_dp.max_epsilon_per_run", "client_dp.delta", "sample_dp.required",
    "sample_dp.min_noise_multiplier", "sample_dp.max_epsilon_per_run", "sample_dp.delta", "lifetime_epsilon",
    "algorithms", "models", "model_factories", "max_upload_bytes", "clear_metrics", "terms",
)

# Relative slack when comparing a task's float values with the pinned ones (they travel as doubles and are
# recomputed on the hub from the same config, so only rounding differs).
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Breach:
    """A task that asks for less than the pinned terms promise: the clause and both values, as one line."""

    clause: str
    pinned: str
    asked: str
    message: str


def run_terms(*, secure_aggregation: SecAggParams, dp: DPConfig, sample_dp: SampleDPConfig, total_rounds: int,
              min_cohort: int, clear_metrics: list[str], sample_rate: float = 0.0,
              signed: bool = True) -> silo_pb2.PrivacyTerms:
    """The hub's terms for a run, from its hub.yaml privacy sections.

    `min_cohort` is the fewest silos whose inputs any round's secure sum holds (the hub never applies a smaller
    one); `clear_metrics` the per-silo metric names the hub asks for in the clear (empty: none); `signed` false
    only for a hub in --insecure-dev-only mode, whose silos have no certificates to sign their keys with."""
    terms = silo_pb2.PrivacyTerms(clear_metrics=list(clear_metrics))
    sa = secure_aggregation
    if sa.enabled:
        smallest = max(sa.fewest_silos(), min_cohort)
        terms.secure_aggregation.CopyFrom(silo_pb2.SecureAggregationTerms(
            enabled=True, min_cohort=min_cohort, threshold=sa.threshold, neighbours=sa.neighbours or 0,
            dropouts=sa.dropouts, signed=signed, min_threshold=sa.plan(smallest).threshold))
    if dp.enabled:
        noise = dp.noise if dp.noise != "auto" else ("distributed" if sa.enabled else "central")
        a = dp.adaptive_clipping
        max_clip = (a.max_clip_norm if a.max_clip_norm is not None else math.inf) if a.enabled else dp.clip_norm
        terms.client_dp.CopyFrom(silo_pb2.ClientDPTerms(
            enabled=True, noise=noise, noise_multiplier=dp.noise_multiplier, clip_norm=dp.clip_norm,
            max_clip_norm=max_clip, delta=dp.delta, adaptive=a.enabled, clip_tensors=list(dp.clip_tensors),
            epsilon_budget=dp.epsilon_budget or 0.0, rounds=total_rounds, sample_rate=sample_rate))
    if sample_dp.enabled:
        terms.sample_dp.CopyFrom(sample_dp_terms(sample_dp))
    return terms


def sample_dp_terms(config: SampleDPConfig) -> silo_pb2.SampleDPTerms:
    return silo_pb2.SampleDPTerms(enabled=True, noise_multiplier=config.noise_multiplier, clip_norm=config.clip_norm,
                                  delta=config.delta, epsilon_budget=config.epsilon_budget or 0.0)


def uses_privacy(terms: silo_pb2.PrivacyTerms) -> bool:
    return terms.secure_aggregation.enabled or terms.client_dp.enabled or terms.sample_dp.enabled


def protocol_needed(terms: silo_pb2.PrivacyTerms) -> tuple[int, tuple[str, ...]]:
    """The protocol version and the features a silo needs to follow these terms: a run with any privacy term needs
    typed terms (protocol 1 read them from a JSON string that is gone), secure aggregation its signed form."""
    if not uses_privacy(terms):
        return 1, ()
    sa = terms.secure_aggregation
    # signed_secagg_2 implies secagg_2 (its shares carry the session's parameters too)
    secagg = (SIGNED_SECAGG,) if sa.signed else (SECAGG,) if sa.enabled else ()
    return PROTOCOL_VERSION, (TYPED_TERMS, *secagg)


def as_dict(message: Any) -> dict[str, Any]:
    """A terms message as a plain dict with every field (defaults included) under its proto name: what the audit
    records and what the hash is taken over."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def terms_sha256(terms: silo_pb2.PrivacyTerms) -> str:
    """A fingerprint of the terms that does not depend on protobuf's byte encoding (canonical JSON of the dict)."""
    return hashlib.sha256(json.dumps(as_dict(terms), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def describe(terms: silo_pb2.PrivacyTerms) -> list[str]:
    """The terms in words, one line per part: for the hub's --check and the silo's log."""
    sa, dp, sd = terms.secure_aggregation, terms.client_dp, terms.sample_dp
    lines = []
    if sa.enabled:
        k = f"{sa.neighbours} neighbours" if sa.neighbours else "3 ceil(log2 n) neighbours"
        lines.append(f"secure aggregation: on, {'signed keys and a consistency round' if sa.signed else 'unsigned'}, "
                     f"every sum over at least {sa.min_cohort} silos, threshold {sa.threshold:.3g} of {k} "
                     f"(at least {sa.min_threshold} shares), surviving {sa.dropouts} dropout(s)")
    else:
        lines.append("secure aggregation: off (the hub sees each silo's update)")
    if dp.enabled:
        clip = f"clip {dp.clip_norm:g}" + (f" (adaptive, at most {dp.max_clip_norm:g})" if dp.adaptive else "")
        budget = f", hub's budget epsilon {dp.epsilon_budget:g}" if dp.epsilon_budget else ""
        lines.append(f"client-level DP: {dp.noise} noise, multiplier {dp.noise_multiplier:g}, {clip}, delta "
                     f"{dp.delta:g}, {dp.rounds} rounds{budget}")
    else:
        lines.append("client-level DP: off")
    if sd.enabled:
        budget = f", budget epsilon {sd.epsilon_budget:g} per silo" if sd.epsilon_budget else ""
        lines.append(f"sample-level DP-SGD: multiplier {sd.noise_multiplier:g}, clip {sd.clip_norm:g}, delta "
                     f"{sd.delta:g}{budget}")
    else:
        lines.append("sample-level DP-SGD: off")
    lines.append("clear per-silo metrics asked: " + (", ".join(terms.clear_metrics) or "none"))
    return lines


def clear_metrics_allowed(terms: silo_pb2.PrivacyTerms, task: silo_pb2.TaskPrivacy | None) -> list[str]:
    """The clear metrics a silo may send this round under the terms: none when the round is securely aggregated or
    noised (they are derived from the silo's data and no mechanism covers them), else those the hub asked for."""
    if task is not None and (task.secagg_session or task.client_dp.enabled or task.sample_dp.enabled):
        return []
    return list(terms.clear_metrics)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))


def noise_shares(task: silo_pb2.TaskPrivacy) -> int:
    """Over how many silos' noise a round's distributed client-level noise is split: the round's cohort when its
    update goes into a secure sum, else 1 (the hub sees this silo's update alone, so all of the noise must be
    its own, whatever min_contributors the task states)."""
    return max(task.min_contributors, 1) if task.secagg_session else 1


def task_breaches(pinned: silo_pb2.PrivacyTerms, task: silo_pb2.TaskPrivacy) -> list[Breach]:
    """Where a TRAIN task's privacy asks for less than (or other than) the pinned terms. Empty when it agrees."""
    out: list[Breach] = []

    def breach(clause: str, pinned_value: Any, asked: Any, what: str) -> None:
        out.append(Breach(clause, str(pinned_value), str(asked),
                          f"{what}: the run's pinned terms say {pinned_value}, this task asks {asked}"))

    sa = pinned.secure_aggregation
    if sa.enabled and not task.secagg_session:
        breach("secure_aggregation.required", "secure aggregation on", "secure aggregation off",
               "a task turned secure aggregation off")
    if task.secagg_session and not sa.enabled:
        breach("terms", "secure aggregation off", "secure aggregation on", "a task asked for secure aggregation")
    if sa.enabled and task.secagg_session and task.min_contributors < sa.min_cohort:
        breach("secure_aggregation.min_cohort", f"a cohort of at least {sa.min_cohort} silos",
               f"a cohort of {task.min_contributors}", "a task lowered the round's cohort")
    dp, t = pinned.client_dp, task.client_dp
    if dp.enabled != t.enabled:
        breach("client_dp.required", f"client-level DP {'on' if dp.enabled else 'off'}",
               f"client-level DP {'on' if t.enabled else 'off'}", "a task changed client-level DP")
    elif dp.enabled:
        if t.clip_norm > dp.max_clip_norm * (1 + TOLERANCE) or not t.clip_norm > 0:
            breach("client_dp.max_clip_norm", f"clip norm at most {dp.max_clip_norm:g}", f"clip norm {t.clip_norm:g}",
                   "a task raised the clip norm")
        if not dp.adaptive and not _close(t.clip_norm, dp.clip_norm):
            breach("client_dp.max_clip_norm", f"clip norm {dp.clip_norm:g}", f"clip norm {t.clip_norm:g}",
                   "a task changed the clip norm")
        if t.adaptive != dp.adaptive or list(t.clip_tensors) != list(dp.clip_tensors):
            breach("terms", f"adaptive {dp.adaptive}, clipping {list(dp.clip_tensors)}",
                   f"adaptive {t.adaptive}, clipping {list(t.clip_tensors)}", "a task changed what is clipped")
        if dp.noise == "distributed":
            contributors = noise_shares(task)
            floor = dp.noise_multiplier * t.clip_norm / math.sqrt(contributors)
            if not t.noise_std >= floor * (1 - TOLERANCE):  # (written so that NaN, which compares false, breaches)
                breach("client_dp.noise", f"noise std at least {floor:.6g} (multiplier {dp.noise_multiplier:g} x "
                       f"clip {t.clip_norm:g} / sqrt({contributors}) silos)", f"noise std {t.noise_std:.6g}",
                       "a task lowered the noise")
            if dp.adaptive and not t.indicator_noise_std > 0:
                # The clipping indicator (whether this silo's update was clipped) goes into the same sum: without
                # its noise the round's count of unclipped silos leaves un-noised.
                breach("client_dp.noise", "noise on the clipping indicator", "none",
                       "a task removed the noise on the adaptive clipping indicator")
            elif dp.adaptive and t.noise_std > 0 and t.clip_norm > 0:
                # The update and its indicator (sensitivity 1/2) are two Gaussian mechanisms whose multipliers
                # compose to (z_update^-2 + z_count^-2)^-1/2: that, not the update's alone, must reach the pinned z,
                # which is what this silo's ledger charges (security/dp.py, adaptive clipping).
                z_update = t.noise_std * math.sqrt(contributors) / t.clip_norm
                z_count = 2 * t.indicator_noise_std * math.sqrt(contributors)
                z_total = (z_update ** -2 + z_count ** -2) ** -0.5
                if z_total < dp.noise_multiplier * (1 - TOLERANCE):
                    breach("client_dp.noise", f"noise multiplier {dp.noise_multiplier:g} over the update and its "
                           f"clipping indicator together", f"{z_total:.4g} (update {z_update:.4g}, indicator "
                           f"{z_count:.4g})", "a task's noise composes to less than the pinned multiplier")
        elif t.noise_std != 0.0:
            breach("client_dp.noise", "central noise (none at the silo)", f"noise std {t.noise_std:g}",
                   "a task changed who adds the noise")
    sd, ts = pinned.sample_dp, task.sample_dp
    if sd.enabled != ts.enabled:
        breach("sample_dp.required", f"sample-level DP {'on' if sd.enabled else 'off'}",
               f"sample-level DP {'on' if ts.enabled else 'off'}", "a task changed sample-level DP")
    elif sd.enabled:
        if not ts.noise_multiplier >= sd.noise_multiplier * (1 - TOLERANCE):  # NaN breaches too
            breach("sample_dp.min_noise_multiplier", f"noise multiplier {sd.noise_multiplier:g}",
                   f"noise multiplier {ts.noise_multiplier:g}", "a task lowered the DP-SGD noise")
        if not 0 < ts.clip_norm <= sd.clip_norm * (1 + TOLERANCE):  # no policy clause bounds it: the terms do
            breach("terms", f"DP-SGD clip norm {sd.clip_norm:g}", f"DP-SGD clip norm {ts.clip_norm:g}",
                   "a task raised the DP-SGD clip norm")
        if not _close(ts.delta, sd.delta) or (sd.epsilon_budget and not _close(ts.epsilon_budget, sd.epsilon_budget)):
            breach("sample_dp.delta", f"delta {sd.delta:g}, budget {sd.epsilon_budget:g}",
                   f"delta {ts.delta:g}, budget {ts.epsilon_budget:g}", "a task changed the DP-SGD accounting")
    return out
