"""The hub's privacy layer: secure aggregation stages and client-level DP around a round, transport-free.

The hub's round loop (round_loop.py) and intake (intake.py) call these hooks; everything else stays here:

    begin(task_id, expected, sampled, enrolled, need) -> RoundPrivacy   before the round is published
                                                       (DP budget check and instructions; a SecAgg+ session)
    view(round_privacy, silo)  -> (stage, payload)     what a polling silo must do for secure aggregation now
    complete(task, need, hooks) -> PrivateSums         after training: drive the SecAgg+ stages (or take the plain
                                                       sums), add central noise, charge the accountant; the round
                                                       record's typed privacy parts come back with the sums. `hooks`
                                                       (RoundHooks) is all it uses of the hub: its lock, its stop
                                                       event, its refusal counter and the update norm bound

With secure aggregation a silo's training result never reaches the hub in the clear: its "upload" is the
advertise-keys message, then it answers the share-keys, masked-input and unmask stages that the hub hands out
through NextTask (kind SECAGG) and that come back through Upload (UploadHeader.secagg_stage).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field

from security import validation
from security.dp import (
    UNCLIPPED,
    BudgetExhausted,
    DPConfig,
    DPController,
    SiloInstructions,
    quantization_clip,
    update_norm,
)
from security.secagg import HubSession, ProtocolError, RoundAbandoned, SecAggParams
from security.secagg import messages as msg
from security.secagg.identity import PeerVerifier
from security.secagg.params import QuantizationRule
from security.secagg.quantize import rule_for
from security.validation import printable
from silo.v1 import silo_pb2
from silo_core.config_base import StrictConfig
from silo_core.dp_sgd import SampleDPConfig
from silo_core.rounds import DPRound, SecAggRound
from silo_core.tensors import TensorSpec

log = logging.getLogger("silo_server")

__all__ = ["BudgetExhausted", "HubPrivacy", "PrivacySection", "PrivateSums", "RoundAbandoned", "RoundFailed",
           "RoundHooks", "RoundPrivacy", "SumRefused"]


class RoundFailed(Exception):
    """A round attempt that cannot be applied (below quorum, secure aggregation abandoned, an aggregate that breaks
    the bounds): the hub logs the message as the cause and retries the round."""

class SumRefused(RoundFailed):
    """A securely aggregated sum that fails its check: one of `contributors` sent what no honest silo could
    (silo_server/rounds/breaker.py looks for it)."""

    def __init__(self, message: str, contributors: list[str]):
        super().__init__(message)
        self.contributors = list(contributors)


STAGE_UPLOADS = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask", "abort")


class PrivacySection(StrictConfig):
    """hub.yaml `privacy`: secure aggregation and differential privacy (both off by default)."""

    secure_aggregation: SecAggParams = Field(default_factory=SecAggParams)
    dp: DPConfig = Field(default_factory=DPConfig)
    sample_dp: SampleDPConfig = Field(default_factory=SampleDPConfig)
    clear_metrics: bool = Field(
        True, description="ask silos for their clear per-silo metrics (pseudo-label counts, losses, training time) "
        "in rounds without secure aggregation or DP; stated in the run's terms, and a branch policy may refuse them")

    @property
    def enabled(self) -> bool:
        """Whether the hub's aggregation is private (sample_dp lives entirely in the silos' training)."""
        return self.secure_aggregation.enabled or self.dp.enabled


@dataclass
class RoundPrivacy:
    """The privacy state of one round attempt (lives on the hub's ActiveTask)."""

    instructions: SiloInstructions | None
    session: HubSession | None
    accepted: dict[str, TensorSpec]  # what silos send: the plan's tensors plus the DP indicator
    expected_silos: int
    enrolled: int
    # The fewest silos whose inputs the round's sum may hold: its quorum, and never below the run's pinned
    # secure_aggregation.min_cohort; distributed noise is split over this many, and the task states it.
    min_contributors: int = 1
    outbox: dict[str, bytes] = field(default_factory=dict)  # the current stage's message per silo
    outbox_stage: str = ""
    outbox_deadline: float = 0.0  # when the current stage stops taking answers (Unix time)
    answered: set[str] = field(default_factory=set)  # silos that answered the current stage

    @property
    def in_clear(self) -> bool:
        """Whether silos send this round's results in the clear (neither masked nor clipped and noised by them)."""
        return self.session is None and self.instructions is None

    def task_privacy(self, task_id: str, sample_dp: silo_pb2.SampleDPTerms | None = None) -> silo_pb2.TaskPrivacy:
        """What a TRAIN task tells the silo about this round's privacy, typed (checked there against the pinned
        terms: security/terms.py task_breaches)."""
        out = silo_pb2.TaskPrivacy(min_contributors=self.min_contributors if self.session is not None else 0)
        if self.session is not None:
            out.secagg_session = task_id
        if self.instructions is not None:
            i = self.instructions
            out.client_dp.CopyFrom(silo_pb2.TaskClientDP(
                enabled=True, clip_norm=i.clip_norm, noise_std=i.noise_std, indicator_noise_std=i.indicator_noise_std,
                adaptive=i.adaptive, clip_tensors=list(i.clip_tensors)))
        if sample_dp is not None and sample_dp.enabled:
            out.sample_dp.CopyFrom(sample_dp)
        return out


@dataclass
class PrivateSums:
    """What a private round hands the algorithm (sums and summed clear metrics) and its round record (dp, secagg)."""

    sums: dict[str, torch.Tensor]
    metrics: dict[str, float]
    dp: DPRound | None = None
    secagg: SecAggRound | None = None
    contributors: list[str] = field(default_factory=list)  # whose inputs the secure sum holds (U3)


@dataclass
class RoundHooks:
    """What completing a private round uses of the hub."""

    cond: threading.Condition  # the hub's lock: stage messages arrive under it; notify_all wakes the polling silos
    stop_event: threading.Event  # set when the hub stops: the stage driver gives up (InterruptedError)
    refuse: Callable[[str | None, str, str, str], Any]  # count and log a refusal (of a securely aggregated sum)
    max_update_norm: float | None = None  # security.max_update_norm: a sum without DP noise is checked against it
    # Called with the round's privacy state once each stage's messages are out (RoundPrivacy.outbox): a transport
    # whose silos live in this process answers them here (silo_sim/inprocess.py); over gRPC silos poll for them.
    answer: Callable[[RoundPrivacy], None] | None = None
    # Once a stage's quorum answered, how long it waits for the rest (rounds.wait_after_quorum_s, as the round's
    # training does); None: until every silo answered or the stage deadline.
    wait_after_quorum_s: float | None = None
    # Evicts the round's silos whose certificates the CRL now lists (as the round's training wait does): a silo
    # revoked after its keys would otherwise hold each stage to the quorum wait, or to its deadline.
    check_revocations: Callable[[], None] | None = None


def check_clip_tensors(prefixes: list[str], expected: dict[str, TensorSpec]) -> None:
    """Client-level DP clips and noises the update's tensors named by privacy.dp.clip_tensors (name prefixes). When
    they name none of this algorithm's, nothing would be clipped or noised while every round is charged epsilon:
    refused, with the prefixes the update has."""
    floats = [n for n, spec in expected.items() if spec.dtype.startswith(("float", "bfloat"))]
    if any(n.startswith(p) for n in floats for p in prefixes):
        return
    found = sorted({n[:n.index("delta/") + len("delta/")] for n in floats if "delta/" in n}) or sorted(floats)[:4]
    raise ValueError(f"privacy.dp.clip_tensors {prefixes} names none of this algorithm's update tensors "
                     f"({', '.join(sorted(floats)[:4])}{', ...' if len(floats) > 4 else ''}): nothing would be "
                     f"clipped or noised while every round is charged epsilon; set privacy.dp.clip_tensors to "
                     f"{found}")


class HubPrivacy:
    def __init__(self, section: PrivacySection, seed: int | None = None, verifier: PeerVerifier | None = None,
                 run_id: str = ""):
        self.section = section
        self.secagg = section.secure_aggregation if section.secure_aggregation.enabled else None
        self.dp = DPController(section.dp, self.secagg is not None, seed=seed) if section.dp.enabled else None
        # Secure aggregation checks each silo's signed keys against the federation CA and CRL (None: unsigned, as
        # with --insecure-dev-only, where silos have no certificates).
        self.verifier = verifier
        self.run_id = run_id

    @property
    def min_cohort(self) -> int:
        return self.secagg.min_cohort if self.secagg is not None else 1

    @property
    def enabled(self) -> bool:
        return self.secagg is not None or self.dp is not None

    # ------------------------------------------------------------------ before the round
    def begin(self, task_id: str, expected: dict[str, TensorSpec], sampled: set[str], enrolled: int,
              need: int, weight_cap: float = 1.0) -> RoundPrivacy:
        """DP instructions after the budget check (raises BudgetExhausted), and the round's SecAgg+ session.
        `weight_cap`: the largest weight a sampled silo may send (1 under uniform averaging)."""
        instructions = None
        accepted = dict(expected)
        if self.secagg is not None:
            need = max(need, self.min_cohort)  # the cohort the run's terms promise
        if self.dp is not None:
            check_clip_tensors(self.dp.config.clip_tensors, expected)
            instructions = self.dp.plan_round(len(sampled), enrolled, need)
            if instructions.adaptive:
                accepted[UNCLIPPED] = TensorSpec((1,), "float32")
        session = None
        if self.secagg is not None:
            params = self._round_params(instructions, accepted, weight_cap)
            shapes = {n: tuple(s.shape) for n, s in accepted.items()}
            try:
                session = HubSession(task_id, sorted(sampled), params, shapes, min_survivors=need,
                                     verifier=self.verifier, run_id=self.run_id, signed=self.verifier is not None)
            except ValueError as err:
                raise RuntimeError(f"secure aggregation cannot run with {len(sampled)} silos in a round: {err}; "
                                   "raise rounds.silos_per_round (or rounds.silos_per_round_count) / rounds.min_silos "
                                   "or the bits budget") from None
        return RoundPrivacy(instructions, session, accepted, len(sampled), enrolled, min_contributors=need)

    def _round_params(self, instructions: SiloInstructions | None, accepted: dict[str, TensorSpec],
                      weight_cap: float = 1.0) -> SecAggParams:
        """With distributed DP the fixed-point range follows the round's clip norm and noise: every clipped value
        and all but ~2e-9 of the noise fit, at the bit width configured for those tensors. Under weighted averaging
        a silo sends its weight (up to `weight_cap`) and its update times that weight: their ranges grow with the
        cap, so the weights are not clipped to the configured range and the update keeps its relative precision."""
        params = self.secagg
        rules = params.rules()
        extra = []
        for prefix in instructions.clip_tensors if instructions is not None else ():
            names = [n for n in accepted if n.startswith(prefix)]
            if names:
                bits = rule_for(rules, names[0]).bits
                clip = quantization_clip(instructions.clip_norm, instructions.noise_std)
                extra.append(QuantizationRule(pattern=prefix + "*", clip=clip, bits=bits))
        if instructions is not None and instructions.adaptive:
            bits = rule_for(rules, UNCLIPPED).bits if _covered(rules, UNCLIPPED) else 20
            extra.append(QuantizationRule(pattern=UNCLIPPED, clip=quantization_clip(0.5,
                                          instructions.indicator_noise_std), bits=bits))
        if weight_cap > 1:  # after the DP rules: a clipped update is bounded by its clip norm, whatever its weight
            weights = sorted(n for n in accepted if n.rsplit("/", 1)[-1] == "weight")
            extra += [QuantizationRule(pattern=n, clip=max(rule_for(rules, n).clip, weight_cap),
                                       bits=rule_for(rules, n).bits) for n in weights]
            extra += [QuantizationRule(pattern=r.pattern, clip=r.clip * weight_cap, bits=r.bits)
                      for r in params.quantization]
        if not extra:
            return params
        return params.model_copy(update={"quantization": extra + list(params.quantization)})

    def check_budget(self) -> None:
        """Before waiting for silos: BudgetExhausted if one more round at the last usual draw's (z, q) would exceed
        the budget, so a restarted hub whose budget is spent stops at once. The last usual draw: the last round
        charged at q < 1, when there is one; a round hunting a secure-sum breaker charges q = 1, and priced at that
        the check stopped runs whose next draw still fit (begin() checks the round's exact q)."""
        if self.dp is None or self.dp.config.epsilon_budget is None or not self.dp.accountant.history:
            return
        history = self.dp.accountant.history
        drawn = [q for _, q, _ in history if q < 1]
        q = drawn[-1] if drawn else history[-1][1]
        if not self.dp.accountant.allows(self.dp.config.epsilon_budget, self.dp.config.noise_multiplier, q):
            raise BudgetExhausted(f"epsilon {self.dp.epsilon():.3f} spent in {self.dp.rounds} rounds; one more "
                                  f"would exceed the budget {self.dp.config.epsilon_budget}")

    # ------------------------------------------------------------------ during the round
    def fewest_sampled(self) -> int:
        """Secure aggregation: the fewest silos a round may sample and still survive `dropouts` and hold the pinned
        cohort (1 without it)."""
        return self.secagg.fewest_sampled() if self.secagg is not None else 1

    @staticmethod
    def drop(rp: RoundPrivacy, silo_id: str) -> None:
        """A silo left the round (revoked, or sent a message the session cannot use): stop waiting for it."""
        if rp.session is not None:
            rp.session.drop(silo_id)

    @staticmethod
    def dropouts(rp: RoundPrivacy) -> set[str]:
        return rp.session.dropouts() if rp.session is not None else set()

    @staticmethod
    def view(rp: RoundPrivacy, silo_id: str) -> tuple[str, bytes] | None:
        if rp.session is None or silo_id in rp.answered or silo_id in rp.session.gone:
            return None
        payload = rp.outbox.get(silo_id)
        return (rp.outbox_stage, payload) if payload is not None else None

    @staticmethod
    def check_clear_upload(rp: RoundPrivacy, tensors: dict[str, torch.Tensor]) -> None:
        """A result sent in the clear: refused when the round is securely aggregated (the silo should have kept
        it), and with central DP its clipped part must be within the round's clip norm (the sensitivity the
        accountant is charged for is enforced, not assumed). validation.Invalid names which (reasons bad_secagg and
        clip_norm, counted and alerted on as malformed updates)."""
        if rp.session is not None:
            raise validation.Invalid("INVALID_ARGUMENT", "bad_secagg",
                                     "this round is securely aggregated: results are never accepted in the clear")
        if rp.instructions is not None:
            norm = update_norm(tensors, rp.instructions.clip_tensors)
            if norm > rp.instructions.clip_norm * (1 + 1e-4) + 1e-12:
                raise validation.Invalid("INVALID_ARGUMENT", "clip_norm", f"update norm {norm:.6g} exceeds the "
                                         f"round's clip norm {rp.instructions.clip_norm:.6g}")

    @staticmethod
    def stage_bytes(rp: RoundPrivacy, stage: str) -> int:
        """The largest message a silo may send at `stage` of this round's session: a masked input is as large as
        the round's tensors in the ring; every other stage is a JSON message."""
        if stage == "masked_input" and rp.session is not None:
            return rp.session.masked_input_bytes()
        return msg.MAX_JSON_BYTES

    @staticmethod
    def receive(rp: RoundPrivacy, silo_id: str, stage: str, payload: bytes) -> None:
        """One stage message from a silo (call under the hub's lock). ProtocolError if it does not fit."""
        s = rp.session
        if s is None:
            raise ProtocolError("this round does not use secure aggregation")
        if stage == "abort":
            reason = printable(payload, 200)  # the silo's words: escaped and cut before they reach the log
            log.warning("secure aggregation: silo %s gave up on session %s: %s", silo_id, s.session, reason)
            s.drop(silo_id)
            return
        if stage == "advertise_keys":
            s.receive_keys(silo_id, payload)
        elif stage != rp.outbox_stage or silo_id not in rp.outbox:
            raise msg.StageNotOpen(f"stage {printable(stage, 32)} is not open for silo {silo_id} (current: "
                                   f"{rp.outbox_stage or s.stage})")
        elif stage == "share_keys":
            s.receive_shares(silo_id, payload)
        elif stage == "masked_input":
            s.receive_masked_input(silo_id, payload)
        elif stage == "consistency":
            s.receive_consistency(silo_id, payload)
        elif stage == "unmask":
            s.receive_unmask(silo_id, payload)
        else:
            raise ProtocolError(f"unknown secure-aggregation stage {printable(stage, 32)!r}")
        if stage != "advertise_keys":
            rp.answered.add(silo_id)

    # ------------------------------------------------------------------ after training
    def complete(self, task: Any, need: int, hooks: RoundHooks) -> PrivateSums:
        """The round's usable sums, summed metrics and privacy records; RoundFailed (naming the cause) if the round
        must be retried."""
        rp: RoundPrivacy = task.privacy
        secagg = dp = None
        need = max(need, rp.min_contributors)
        if rp.session is not None:
            # A silo that advertised its keys and then left (revoked, aborted) counts as it does for the round
            # loop's quorum wait: not at all.
            finished = len(task.reported - task.gone)
            if finished < need:
                raise RoundFailed(f"{finished} of {len(task.sampled)} sampled silos finished training, "
                                  f"below quorum {need}")
            try:
                result, stage_seconds = self._drive(task, hooks, need)
            except RoundAbandoned as err:
                raise RoundFailed(str(err)) from None
            summed = dict(result.sums)
            names, contributors = list(result.contributors), len(result.contributors)
            self._check_sum(task, summed, names, hooks)
            metrics: dict[str, float] = {}
            secagg = SecAggRound(**result.stats, stage_seconds=stage_seconds)
            if result.suspects:
                log.warning("secure aggregation: silos %s revealed shares that are not on the polynomial",
                            ", ".join(result.suspects))
        else:
            if len(task.reported) < need:
                raise RoundFailed(f"{len(task.reported)} of {len(task.sampled)} sampled silos reported, below "
                                  f"quorum {need}")
            summed, metrics, contributors = task.sums.result(), dict(task.sums.metrics), task.sums.contributors
            names = []
        if self.dp is not None:
            if contributors < 1:
                summed.pop(UNCLIPPED, None)
                log.warning("round %d: no silo update to privatize; nothing released, nothing charged", task.round)
            else:
                summed, dp = self.dp.finish_round(summed, contributors, rp.expected_silos, rp.enrolled)
                log.info("round %d: privacy spent epsilon = %.4f at delta = %g (noise multiplier %.3f, sampling "
                         "rate %.3f, %d rounds charged)", task.round, dp.epsilon, dp.delta, dp.noise_multiplier,
                         dp.sample_rate, self.dp.rounds)
        return PrivateSums(summed, metrics, dp, secagg, contributors=names)

    def _check_sum(self, task: Any, summed: dict[str, torch.Tensor], contributors: list[str],
                   hooks: RoundHooks) -> None:
        """Under secure aggregation the hub sees no single update, so it checks what the sum allows: the summed
        weights within what the contributors may send (a whole number of silos under uniform averaging) and the
        summed update within the norm bound (without DP noise, which would drown the check). A sum that fails is
        refused: the round is retried, and the refusal logged and counted."""
        rules = task.privacy.session.rules
        n = len(contributors)

        def tolerance(name: str) -> float:  # stochastic rounding: under one quantization step per silo and element
            rule = rule_for(rules, name)
            return n * 2 * rule.clip / (2**rule.bits - 1) + 1e-6

        caps = getattr(task, "weight_caps", {})
        unit = bool(task.plan.unit_weight)
        max_weight_sum = float(n) if unit else sum(caps.get(s, 1.0) for s in contributors)
        bound = hooks.max_update_norm if self.dp is None else None
        try:
            validation.check_aggregate({k: v for k, v in summed.items() if k != UNCLIPPED}, n, unit_weight=unit,
                                       max_weight_sum=max_weight_sum, max_update_norm=bound, tolerance=tolerance)
        except validation.Invalid as err:
            # Counted without a silo label: no one silo is known to have sent it (the breaker search looks).
            hooks.refuse(None, err.code, err.reason, f"the securely aggregated sum of {n} silos: {err.message}")
            if self.dp is not None:  # unmasked is released: the hub's count must not fall below the silos' ledgers
                self.dp.charge(task.privacy.expected_silos, task.privacy.enrolled)
                log.warning("round %d: the refused sum was unmasked, so it is charged: epsilon %.4f after %d "
                            "rounds charged", task.round, self.dp.epsilon(), self.dp.rounds)
            raise SumRefused(f"the securely aggregated sum of {n} silos was refused: {err.message}",
                             contributors) from None

    def _drive(self, task: Any, hooks: RoundHooks, need: int = 0) -> tuple[Any, dict[str, float]]:
        """Close advertise_keys, then run share_keys, masked_input, consistency and unmask, each until every silo
        answered, the stage deadline, or hooks.wait_after_quorum_s after `need` silos answered (the rest then count
        as dropouts: a silo that stays silent cannot hold each stage of every round it is in to its deadline);
        finally unmask the sum. Returns the session's result and each stage's duration (advertise_keys: from
        hand-out, so training included); RoundAbandoned when the threshold cannot be met."""
        rp: RoundPrivacy = task.privacy
        s = rp.session
        deadline_s = self.secagg.stage_deadline_s
        stages = (("share_keys", s.close_advertise), ("masked_input", s.close_share_keys),
                  ("consistency", s.close_masked_input), ("unmask", s.close_consistency))
        seconds = {"advertise_keys": time.time() - task.started}
        with hooks.cond:
            for next_stage, close in stages:
                stage_started = time.time()
                rp.outbox, rp.outbox_stage, rp.answered = {}, next_stage, set()
                rp.outbox = close()
                rp.outbox_deadline = time.time() + deadline_s
                hooks.cond.notify_all()
                if hooks.answer is not None:
                    hooks.answer(rp)
                    rp.outbox_deadline = time.time() + deadline_s  # in-process silos answered: the stage starts now
                deadline, ready_since, quorum_at = rp.outbox_deadline, None, None
                while s.waiting_for() and time.time() < deadline:
                    if hooks.stop_event.is_set():
                        raise InterruptedError("hub stopping")
                    # (unmask has its own rule below: it may close once every secret is recoverable, not before)
                    quorum_at = (quorum_at or time.time()) if s.answered() >= need and s.closable() else None
                    if hooks.wait_after_quorum_s is not None and quorum_at is not None and next_stage != "unmask" \
                            and time.time() - quorum_at >= hooks.wait_after_quorum_s:
                        log.info("round %d: secure aggregation %s: quorum %d answered %.1f s ago; closing without %s",
                                 task.round, next_stage, need, time.time() - quorum_at,
                                 ", ".join(sorted(s.waiting_for())[:10]))
                        break
                    if next_stage == "unmask" and s.can_finish():
                        # every secret is recoverable: wait briefly for spare shares, not for a dead silo
                        ready_since = ready_since or time.time()
                        if time.time() - ready_since > min(5.0, deadline_s):
                            break
                    hooks.cond.wait(timeout=0.25)
                    if hooks.check_revocations is not None:  # a silo revoked now leaves the session at once
                        hooks.check_revocations()
                seconds[next_stage] = time.time() - stage_started
            rp.outbox, rp.outbox_stage = {}, ""
            finishing = time.time()
            result = s.finish()
        # Exported as one stage, "unmasking": collecting the unmask shares, then removing the masks.
        seconds["unmasking"] = seconds.pop("unmask") + time.time() - finishing
        return result, seconds

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"dp": self.dp.state_dict()} if self.dp is not None else {}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.dp is not None and state and state.get("dp"):
            self.dp.load_state_dict(state["dp"])
            log.info("privacy accountant resumed: epsilon %.4f after %d rounds", self.dp.epsilon(), self.dp.rounds)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"secure_aggregation": self.secagg is not None}
        if self.dp is not None:
            out.update({"dp_epsilon": self.dp.epsilon(), "dp_delta": self.dp.config.delta,
                        "dp_rounds": self.dp.rounds, "dp_noise": self.dp.mode,
                        "dp_noise_multiplier": self.dp.config.noise_multiplier,
                        "dp_epsilon_budget": self.dp.config.epsilon_budget})
        return out


def plan_lines(section: PrivacySection, max_update_norm: float | None, sampled: int | None = None,
               min_silos: int = 1) -> list[str]:
    """What `silo-server --check` says about privacy and the bounds it can enforce: the secure-aggregation plan
    (how many silos a round samples, k, t, and the dropouts it survives) and, in one line, any per-silo bound the
    hub cannot enforce with these settings."""
    lines = []
    sa, dp = section.secure_aggregation, section.dp
    if not sa.enabled:
        lines.append("secure aggregation: off (the hub sees each silo's update and checks each one)")
    else:
        fewest = sa.fewest_sampled()
        shape = sa.plan(max(fewest, sampled or 0))
        lines.append(f"secure aggregation: rounds sample at least {fewest} silos to survive {sa.dropouts} dropout(s) "
                     f"(privacy.secure_aggregation.dropouts) and hold min_cohort {sa.min_cohort}; with "
                     f"{shape.sampled} sampled: {shape.neighbours} neighbours, threshold {shape.threshold}, survives "
                     f"{shape.survives}")
        if max_update_norm is not None and not dp.enabled:
            lines.append(f"bound not enforced per silo: security.max_update_norm ({max_update_norm:g}) cannot be "
                         "checked on one silo's masked update; the hub checks only the round's sum (<= the bound x "
                         "the summed weight); enable privacy.dp to clip every update at the silo")
        elif max_update_norm is not None:
            lines.append(f"bound not enforced: security.max_update_norm ({max_update_norm:g}) is not checked under "
                         "secure aggregation with DP noise (the noise hides it); the silos clip to "
                         f"privacy.dp.clip_norm ({dp.clip_norm:g}), which the hub cannot verify either")
        else:
            lines.append("bound not enforced per silo: without security.max_update_norm a silo's masked update is "
                         "bounded only by the quantization range; the summed weight is still checked")
        smallest = max(fewest, sa.min_cohort)
        if min_silos <= smallest:
            lines.append(f"no spare silos: rounds.min_silos ({min_silos}) is not above the {smallest} silos every round "
                         f"needs, so a silo that breaks the secure sum (a weight no honest silo could send) can be "
                         f"found and quarantined only while more than {smallest} are connected; otherwise every "
                         f"round it is in fails")
    if dp.enabled:
        lines.append(f"differential privacy: noise multiplier {dp.noise_multiplier:g}, clip {dp.clip_norm:g}, "
                     f"delta {dp.delta:g}, epsilon budget {dp.epsilon_budget if dp.epsilon_budget else 'none'}")
    return lines


def _covered(rules, name: str) -> bool:
    try:
        rule_for(rules, name)
        return True
    except ValueError:
        return False

