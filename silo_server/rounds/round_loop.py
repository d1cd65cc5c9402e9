"""The hub's round loop: wait for silos, sample them, publish the round's task, wait for reports until the quorum
and the deadline, aggregate (through the privacy layer when it is on), record, checkpoint, and retry a failed
attempt. The silo calls that feed a round live in silo_server/wire/intake.py, the silos themselves in registry.py."""

from __future__ import annotations

import itertools
import json
import logging
import math
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from security import validation
from silo_core.algorithms.base import HubAlgorithm, HubState
from silo_core.rounds import AggregationRound, RoundRecord, Sampling
from silo_core.tensors import FLOAT16_MAX, encode, sha256_hex
from silo_server.rounds.breaker import BreakerHunt, BreakerSearch
from silo_server.rounds.memory import RssMeter
from silo_server.rounds.privacy import (
    BudgetExhausted,
    HubPrivacy,
    PrivateSums,
    RoundFailed,
    RoundHooks,
    SumRefused,
)
from silo_server.rounds.robust import AggregationRefused, AggregationSection, UpdateStore, aggregate
from silo_server.rounds.sinks import CallbackSink, FailedAttempt, HistoryFile, RoundSink
from silo_server.rounds.task import ActiveTask, Broadcast
from silo_server.settings import RoundSettings, wire_specs
from silo_server.state.registry import SiloRegistry
from silo_server.state.scoring import RunRecords, short

log = logging.getLogger("silo_server")

PHASES = ("starting", "waiting_for_silos", "training", "aggregating", "done", "failed")


class Transport(Protocol):
    """How a round's task reaches its sampled silos and their results come back: `collect` returns once every
    sampled silo has reported or is known gone, or the task's deadline has passed, having handed each result to
    RoundLoop.accept_result. The deployed hub waits for gRPC calls (SiloCalls); silo_sim/inprocess.py runs the
    silos' halves in this process. Everything else in a round is the same loop."""

    # Whether another attempt can find other silos (reconnected, recovered): the hub retries a failed round for as
    # long as it runs; where nothing but the draw changes, the loop gives up after rounds.max_attempts.
    silos_can_change: bool

    def collect(self, loop: RoundLoop, task: ActiveTask) -> None: ...


QUORUM_WAIT_FLOOR_S = 10.0  # the least a round waits for the rest after its quorum (rounds.wait_after_quorum_s)


class SiloCalls:
    """The deployed hub's transport: silos fetch the open task, download and upload through gRPC calls
    (silo_server/wire/intake.py), which hand their results in; the loop only waits for them."""

    silos_can_change = True

    def collect(self, loop: RoundLoop, task: ActiveTask) -> None:
        """Until every sampled silo reported or is known gone (revoked, aborted), or the deadline; and once the
        round's quorum has reported, no longer than loop.wait_after_quorum(task) more: a silo that stays silent
        (or whose result was refused) cannot hold every round it is sampled in to the deadline. A quorum lost
        again (under secure aggregation a silo that reported its keys may still abort) restarts the count, so a
        silo that reports early and then aborts cannot close the round below its quorum while others train."""
        need = loop.round_quorum(task)
        quorum_at = None
        with loop.cond:
            while not task.sampled <= task.reported | task.gone and time.time() < task.deadline:
                if loop.stop_event.is_set():
                    raise InterruptedError("hub stopping")
                now = time.time()
                if not loop.quorum_reached(task, need):
                    quorum_at = None
                elif quorum_at is None:
                    quorum_at = now
                if quorum_at is not None and now - quorum_at >= loop.wait_after_quorum(task):
                    task.quorum_wait = now - quorum_at
                    missing = sorted(task.sampled - task.reported - task.gone)
                    log.info("round %d: quorum %d reported %.1f s ago; closing without %s", task.round, need,
                             task.quorum_wait, ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))
                    break
                loop.cond.wait(timeout=0.5)
                loop.check_revocations()


class RoundLoop:
    def __init__(self, algorithm: HubAlgorithm, settings: RoundSettings, registry: SiloRegistry,
                 records: RunRecords, *, stop_event: threading.Event, privacy: HubPrivacy | None = None,
                 half_precision: bool = False, max_update_norm: float | None = None,
                 round_hyperparameters: dict[str, Any] | None = None,
                 on_round: Callable[[RoundRecord], None] | None = None,
                 aggregation: AggregationSection | None = None, transport: Transport | None = None):
        self.algorithm = algorithm
        self.transport = transport or SiloCalls()
        self.settings = settings
        self.sampling = Sampling(settings.silos_per_round, settings.silos_per_round_count, settings.seed)
        self.registry = registry
        self.cond = registry.cond  # one lock for the whole hub
        self.records = records
        self.stop_event = stop_event
        self.privacy = privacy
        self.half_precision = half_precision
        self.said_half_precision = False  # the float16 overflow warning, once (_warn_half_precision)
        self.max_update_norm = max_update_norm  # what the privacy layer checks a securely aggregated sum against
        # Added to every plan's hyperparameters (privacy.sample_dp: the silos' DP-SGD settings).
        self.round_hyperparameters = dict(round_hyperparameters or {})
        # Where each completed round's record goes (silo_server/rounds/sinks.py): history.json first, then what the app
        # adds (Prometheus, TensorBoard), then the caller's own callback.
        self.sinks: list[RoundSink] = [HistoryFile(records)]
        self.callback = CallbackSink(on_round) if on_round is not None else None
        self.aggregation = aggregation or AggregationSection()  # hub.yaml aggregation (silo_server/rounds/robust.py)
        self.rule = self.aggregation.aggregator()  # silo_server/rules/
        # The config ran this check already; a hub built in code (tests, silo-sim) gets the same refusal here.
        self.rule.check(self.aggregation, algorithm,
                        secure_aggregation=privacy is not None and privacy.secagg is not None,
                        dp=privacy is not None and privacy.dp is not None)
        if self.rule.needs_updates:
            log.info("aggregation.rule %s: each round's updates wait in their own files under %s until the round "
                     "ends", self.aggregation.rule, records.state_dir / "round-updates")
        self.rss_meter = RssMeter()
        # The search for a silo that breaks the secure sum (silo_server/rounds/breaker.py), and whether the hub has said
        # it cannot search (no spare silos).
        self.breaker = BreakerSearch(registry.quarantine_silo, settings.seed)
        records.hunt = self.breaker.hunt  # checkpointed with the round: a restarted hub goes on with the search
        self.task: ActiveTask | None = None
        self.phase = "starting"
        self.round = 0
        self.state: HubState | None = None
        self.stopped_reason = ""
        self.failed_attempts = 0  # attempts of the current round that failed in a row

    # ------------------------------------------------------------------ how many
    def draw(self, live: list[str], round_number: int, attempt: int, at_least: int) -> list[str]:
        """The silos a round attempt samples: from run.seed, so that silo-sim and a deployed hub draw alike, except
        under client-level DP, whose accountant charges q < 1 only for a draw no one outside the hub can repeat
        (run.seed is in every plan): then from the DP controller's secret seed."""
        sampling = self.sampling
        if self.privacy is not None and self.privacy.dp is not None:
            sampling = replace(sampling, seed=self.privacy.dp.sampling_seed)
        return sampling.sample(live, round_number, attempt, at_least=at_least)

    def sample_count(self, available: int) -> int:
        return self.sampling.how_many(available)

    def quorum_count(self, sampled: int) -> int:
        # A count above the silos sampled this round (fewer were live) waits for all of them, never for more.
        if self.settings.quorum_silos is not None:
            return min(sampled, self.settings.quorum_silos)
        # Rounded before the ceiling: 0.55 * 100 is 55.00000000000001, which must need 55 reports, not 56.
        return max(1, math.ceil(round(self.settings.quorum * sampled, 9)))

    def round_quorum(self, task: ActiveTask) -> int:
        """The reports a round needs: its quorum, the aggregation rule's fewest updates (Krum: 2f + 3; a round
        closed with fewer would be refused), and under secure aggregation at least the run's pinned cohort."""
        need = max(self.quorum_count(len(task.sampled)), self.rule_minimum(len(task.sampled)))
        return max(need, task.privacy.min_contributors) if task.privacy is not None else need

    def quorum_reached(self, task: ActiveTask, need: int) -> bool:
        """`need` reports in (round_quorum), and as many updates as the aggregation rule needs: a skip is a report
        but no update, so two quick skips and three updates closed a Krum round (f = 1) that Krum then refused,
        without the two silos still training. A round that can no longer get them (too few silos still out) closes
        as before, after the quorum wait, rather than at its deadline."""
        reported = task.reported - task.gone
        if len(reported) < need:
            return False
        fewest_updates = self.rule_minimum(len(task.sampled))
        updates = len(reported - task.skipped)
        still_out = len(task.sampled - task.reported - task.gone)
        return fewest_updates <= 1 or updates >= fewest_updates or updates + still_out < fewest_updates

    def wait_after_quorum(self, task: ActiveTask) -> float:
        """How long a round waits for the rest once its quorum reported: rounds.wait_after_quorum_s, or by default
        twice the median time the round's silos took to report, and at least QUORUM_WAIT_FLOOR_S."""
        if self.settings.wait_after_quorum_s is not None:
            return self.settings.wait_after_quorum_s
        median = statistics.median(task.report_seconds) if task.report_seconds else 0.0
        return max(QUORUM_WAIT_FLOOR_S, 2.0 * median)

    def fewest_sampled(self) -> int:
        return self.privacy.fewest_sampled() if self.privacy is not None else 1

    def rule_minimum(self, available: int) -> int:
        """The aggregation rule's fewest updates (Krum: 2f + 3), as far as `available` silos allow: a round samples
        and waits for that many, where only rounds.min_silos was checked against it and silos_per_round drew
        rounds the rule then refused, attempt after attempt. With fewer silos than that the round is drawn as
        usual and the rule refuses it (the failure names why)."""
        return min(self.rule.min_updates(self.aggregation), available)

    # ------------------------------------------------------------------ silos leaving a round
    def leave_round(self, silo_id: str) -> bool:
        """Count a sampled silo out of the current round (call under the lock). False when it was not in it."""
        t = self.task
        if t is None or silo_id not in t.sampled or silo_id in t.gone:
            return False
        if silo_id in t.reported and (t.privacy is None or t.privacy.session is None):
            return False  # its result is in the sums already (under secure aggregation a report is only its keys)
        t.gone.add(silo_id)
        if t.privacy is not None:
            HubPrivacy.drop(t.privacy, silo_id)
        return True

    def evict(self, silo_id: str, serial: int | None = None) -> None:
        """A silo whose certificate was revoked: never sampled again (its record stays for the model card), and it
        leaves the current round at once, so the round goes on with the rest instead of waiting out its deadline.
        Only a change wakes the waiting long-polls: a revoked silo calling back to back (each call refused at the
        gate, before any rate limit) must not make every waiting silo's poll run again per call. With `serial`
        (the revoked certificate's), only when it is the one the silo's live session holds."""
        with self.cond:
            live = self.registry.silos.get(silo_id)
            if serial is not None and live is not None and live.serial is not None and live.serial != serial:
                return
            revoked = self.registry.revoke(silo_id, in_round=self.task is not None and silo_id in self.task.sampled)
            if self.leave_round(silo_id) or revoked:
                self.cond.notify_all()

    def check_revocations(self) -> None:
        """Evict every silo of the current round whose certificate the CRL now lists (a silo busy training makes
        no call the gate could refuse, so the round loop asks)."""
        if self.registry.is_revoked is None or self.task is None:
            return
        for silo_id in sorted(self.task.sampled - self.task.gone):
            if self.registry.revoked(silo_id):
                self.evict(silo_id)

    @property
    def hunt(self) -> BreakerHunt:
        """The search for a silo that breaks the secure sum under way (empty: none)."""
        return self.breaker.hunt

    # ------------------------------------------------------------------ results coming in
    def accept_stage(self, silo_id: str, task: ActiveTask, stage: str, payload: bytes, total_bytes: int) -> None:
        """A sampled silo's secure-aggregation stage message joins the round's session (call under the lock, after
        checking the task is still current). ProtocolError when the session cannot use it."""
        HubPrivacy.receive(task.privacy, silo_id, stage, payload)
        if stage == "abort":
            self.leave_round(silo_id)
        if stage == "advertise_keys":  # the silo's training result is ready (and stays with the silo)
            task.reported.add(silo_id)
            task.report_seconds.append(time.time() - task.started)
        if stage == "masked_input":  # the update itself, masked: counted as the clear path counts an update
            self.registry.count("accepted_updates")
        task.bytes_up += total_bytes
        self.registry.count("received_bytes", total_bytes)
        self.cond.notify_all()

    def accept_result(self, silo_id: str, task: ActiveTask, tensors: dict[str, Any], metrics: dict[str, float],
                      skipped: bool, total_bytes: int = 0, stored: Any = None) -> None:
        """A sampled silo's whole, validated result joins the round: summed (mean), or kept as its stored file
        (`stored`, under a robust rule). Call under the lock, after checking the task is still open."""
        if stored is not None:
            task.updates.keep(silo_id, stored)
            task.sums.add_metrics(metrics, contributed=True)
        else:
            task.sums.add(tensors, metrics)
        task.reported.add(silo_id)
        task.report_seconds.append(time.time() - task.started)
        if skipped:
            task.skipped.add(silo_id)
        task.bytes_up += total_bytes
        self.registry.count("received_bytes", total_bytes)
        self.registry.count("accepted_skips" if skipped else "accepted_updates")
        self.cond.notify_all(wake_polls=False)  # the round loop counts reports; no waiting silo's task changes

    # ------------------------------------------------------------------ the loop
    def set_phase(self, phase: str) -> None:
        with self.cond:
            self.phase = phase
            self.cond.notify_all()

    def wait_for_silos(self) -> list[str]:
        self.set_phase("waiting_for_silos")
        last_log = 0.0
        needed = max(self.settings.min_silos, self.fewest_sampled())
        with self.cond:
            while not self.stop_event.is_set():
                # Every join wakes this loop, and counting the live silos walks them all (a thousand walks of a
                # thousand silos as a large federation joins): skipped while fewer than `needed` silos ever joined,
                # since the live ones are among them, unless the count is due in the log.
                log_due = time.time() - last_log > 10
                live = self.registry.live_silos() if len(self.registry.silos) >= needed or log_due else []
                if len(live) >= needed:
                    return live
                if log_due:
                    preparing = len(self.registry.preparing_silos())
                    dropped = self.registry.dropped_silos()
                    kept_out = sorted(self.registry.quarantine.names()) if self.registry.quarantine else []
                    departed = len(self.registry.departed())
                    log.info("waiting for silos: %d ready%s%s%s%s, %d needed to start a round%s", len(live),
                             f" ({preparing} more loading their images)" if preparing else "",
                             f" ({dropped} more left the last round and have not asked for work since)" if dropped
                             else "",
                             f" ({len(kept_out)} quarantined, not counted: {', '.join(kept_out[:5])}; "
                             f"silo-server --lift-quarantine NAME)" if kept_out else "",
                             f" ({departed} left the run by their own policy, not counted)" if departed else "",
                             needed,
                             " (secure aggregation's dropout tolerance)" if needed > self.settings.min_silos else "")
                    last_log = time.time()
                self.cond.wait(timeout=1.0)
        return []

    def load_state(self) -> HubState | None:
        """Load and verify the latest checkpoint (RunRecords.load); None when there is none. HubApp calls this
        before it opens the port, so that a bad state folder stops the hub before any silo is served from it."""
        loaded = self.records.load(self.settings.total_rounds, check=self.algorithm.served_model)
        if loaded is None:
            return None
        state, self.registry.declared_before = loaded
        self.state, self.round = state, state.round
        return state

    def resume_or_init(self) -> HubState:
        UpdateStore.clear_leftovers(self.records.state_dir)  # a stopped hub's round is run again
        state = self.state if self.state is not None else self.load_state()  # loaded already when HubApp started
        if state is None:
            log.info("no checkpoint in %s: initial hub training", self.records.state_dir)
            state = self.algorithm.init_state()
            self.records.score_initial(state)
            self.records.save(state, self.registry.declared_images())
        self.round = state.round
        return state

    def run(self) -> HubState:
        """Resume or start, run every remaining round, and return the final state."""
        state = self.resume_or_init()
        self.state = state
        try:
            while state.round < self.settings.total_rounds and not self.stop_event.is_set():
                if self.privacy is not None:
                    self.privacy.check_budget()
                state = self.run_round(state)
                self.state = state
        except InterruptedError:
            log.info("stopped during round %d; the next start resumes after round %d", state.round + 1, state.round)
            return state
        except BudgetExhausted as err:
            self.stopped_reason = f"privacy budget: {err}"
            log.warning("stopping after round %d: %s", state.round, err)
        self.set_phase("done")
        return state

    @staticmethod
    def _warn_half_precision(heaviest: int) -> None:
        """Said once a hub process: a silo multiplies its delta by its image count before the float16 cast, so
        wire.half_precision can overflow where a plain mean would not."""
        log.warning("wire.half_precision with updates weighted by image count: a silo sends its image count (up to "
                    "%d this round) times its delta as float16, which ends at +-65504, so a delta value above %.3g "
                    "overflows and that silo cannot send its update (it logs so and counts it in "
                    "silokit_silo_updates_unsent_total); set wire.half_precision: false if rounds lose silos to it",
                    heaviest, FLOAT16_MAX / max(1, heaviest))

    def stop(self) -> None:
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()

    def run_round(self, state: HubState) -> HubState:
        r = state.round + 1
        plan = self.algorithm.begin_round(state)
        if not self.algorithm.needs_silos:
            started = time.time()
            state, metrics = self.algorithm.finish_round(state, {}, {})
            return self._complete_round(state, metrics, started, None)
        bundle = encode(plan.tensors, half=self.half_precision)
        broadcast = Broadcast() if self.algorithm.broadcasts_model() else None
        for attempt in itertools.count(1):
            live = self.wait_for_silos()
            if self.stop_event.is_set():
                raise InterruptedError("hub stopping")
            # Secure aggregation needs enough silos in a round to survive its documented dropouts.
            sampled = set(self.draw(live, r, attempt, at_least=max(self.fewest_sampled(),
                                                                   self.rule_minimum(len(live)))))
            # A sum failed its check: this cohort holds only part of the suspects (None: the usual sample).
            cohort = (self.breaker.cohort(live, self.fewest_sampled(), r, attempt, self.registry.gone_for_good())
                      if self.hunt.active else None)
            sampled = cohort if cohort is not None else sampled
            task = ActiveTask(
                round=r, attempt=attempt,
                task_id=f"{self.records.run_id[:8]}-r{r}-a{attempt}-{uuid.uuid4().hex[:6]}",
                plan=plan, bundle=bundle, bundle_sha256=sha256_hex(bundle),
                hyperparameters_json=json.dumps(plan.hyperparameters),
                round_hyperparameters=self.round_hyperparameters,
                sampled=sampled, deadline=time.time() + self.settings.deadline_s,
                expected=wire_specs(plan.expected, self.half_precision), broadcast=broadcast,
            )
            if self.rule.needs_updates:
                task.updates = UpdateStore(self.records.state_dir / "round-updates" / task.task_id)
            declared = self.registry.weights(sampled)
            task.weight_caps = validation.weight_cap(declared, self.settings.max_weight_factor)
            need = self.quorum_count(len(sampled))
            if self.privacy is not None:  # raises BudgetExhausted before anything is handed out
                # The sampling rate the accountant charges: the chance of a live silo (the only ones that can be
                # drawn) to be in the round; a breaker hunt's cohorts are not drawn at random, so it charges q = 1.
                population = len(sampled) if cohort is not None else len(live)
                weight_cap = 1.0 if plan.unit_weight else max(task.weight_caps.values(), default=1.0)
                task.privacy = self.privacy.begin(task.task_id, plan.expected, sampled, population, need, weight_cap)
                task.accepted = task.privacy.accepted
            # Only uploads in the clear travel as float16: secure aggregation and client-level DP take float32.
            clear = task.privacy is None or task.privacy.in_clear
            if self.half_precision and clear and not plan.unit_weight and not self.said_half_precision:
                self.said_half_precision = True
                self._warn_half_precision(max(declared.values(), default=1))
            log.info("round %d attempt %d: sampled %d of %d silos, quorum %d%s", r, attempt, len(sampled), len(live), need,
                     "; the others receive the model without training" if broadcast is not None else "")
            task.rss_at_open = self.rss_meter.restart()
            with self.cond:
                self.task, self.round, self.phase = task, r, "training"
                self.cond.notify_all()
            self.transport.collect(self, task)
            with self.cond:
                task.open = False
                self.phase = "aggregating"
            task.rss_peak_collecting = self.rss_meter.peak()
            private = None
            decision = None
            failure: str | None = None
            try:
                if self.privacy is not None:
                    hooks = RoundHooks(cond=self.cond, stop_event=self.stop_event, refuse=self.registry.refuse,
                                       max_update_norm=self.max_update_norm,
                                       answer=getattr(self.transport, "answer_stage", None),
                                       wait_after_quorum_s=self.wait_after_quorum(task),
                                       check_revocations=self.check_revocations)
                    private = self.privacy.complete(task, need, hooks)  # unmasked, noised and charged
                    aggregation_started = time.time()
                    state, metrics = self.algorithm.finish_round(state, private.sums, private.metrics)
                else:
                    if len(task.reported) < need:
                        raise RoundFailed(f"{len(task.reported)} of {len(sampled)} sampled silos reported, below "
                                          f"quorum {need}")
                    aggregation_started = time.time()
                    sums = task.sums.result()
                    if task.updates is not None:
                        sums, decision = self._robust_sums(state, task)
                    state, metrics = self.algorithm.finish_round(state, sums, task.sums.metrics)
                aggregation_seconds = time.time() - aggregation_started
            except RoundFailed as failed:
                failure = str(failed)
                if isinstance(failed, SumRefused):
                    self.breaker.sum_refused(task.round, task.attempt, failed.contributors)
                    self.records.save_refused(task.round)
            finally:
                if task.updates is not None:  # the round's update files go once it is applied or failed
                    task.updates.delete()
            if failure is not None:
                self._round_failed(task, failure)
                continue
            self._mark_dropped(task)
            if private is not None and private.contributors:
                self.breaker.sum_passed(task.round, private.contributors)
            return self._complete_round(state, metrics, task.started, task, aggregation_seconds, private, decision)
        raise AssertionError("unreachable")

    def _robust_sums(self, state: HubState, task: ActiveTask) -> tuple[dict[str, Any], AggregationRound]:
        """The sums the algorithm expects, from the round's stored updates under aggregation.rule."""
        assert task.updates is not None
        groups = task.plan.groups or {"": list(task.plan.expected)}
        try:
            sums, decision = aggregate(task.updates, groups, self.aggregation,
                                       root=lambda: self.algorithm.trusted_update(state) or {})
        except AggregationRefused as refused:
            raise RoundFailed(str(refused)) from None
        if decision.excluded or decision.down_weighted:
            log.warning("round %d: aggregation.rule %s excluded %d silos (%s) and down-weighted %d (%s) of %d "
                        "updates", task.round, decision.rule, decision.excluded, ", ".join(decision.excluded_silos),
                        decision.down_weighted, ", ".join(decision.down_weighted_silos), decision.updates)
        return sums, decision

    def _mark_dropped(self, task: ActiveTask) -> set[str]:
        """Sampled silos that did not report are not sampled again until they poll again; returns them."""
        with self.cond:
            left = task.sampled - (task.reported - task.gone)
            if task.privacy is not None:
                left |= HubPrivacy.dropouts(task.privacy)  # reported their keys, then fell silent
            self.registry.mark_dropped(left)
        return left

    def _round_failed(self, task: ActiveTask, reason: str) -> None:
        """Silos failing a round never stop the hub: it logs why, counts it and retries after a growing pause."""
        left = self._mark_dropped(task)
        failed = FailedAttempt(task.round, task.attempt, reason, tuple(sorted(left)))
        for sink in self.sinks:  # Prometheus counts the silos it waited for in vain (the below-quorum alert's cause)
            attempt_failed = getattr(sink, "attempt_failed", None)  # a sink written before the method: skipped
            if attempt_failed is not None:
                attempt_failed(failed)
        # Counted before the attempt is: whoever sees failed_attempts move sees the counters moved too.
        self.registry.count("rounds_failed")
        if "below quorum" in reason:
            self.registry.count("below_quorum")
        with self.cond:
            self.task = None
            self.failed_attempts += 1
            failures = self.failed_attempts
        if not self.transport.silos_can_change:  # in process: the same silos would fail the same way
            if failures >= self.settings.max_attempts:
                raise RuntimeError(f"round {task.round} failed {failures} times in a row (last: {reason})")
            log.warning("round %d attempt %d failed: %s; drawing again", task.round, task.attempt, reason)
            return
        pause = min(60.0, 2.0 ** (failures - 1))
        log.warning("round %d attempt %d failed: %s; retrying in %.0f s", task.round, task.attempt, reason, pause)
        if failures % self.settings.max_attempts == 0:
            log.error("round %d has failed %d times in a row (last: %s); the hub keeps retrying: check that enough "
                      "silos are connected and healthy (rounds.min_silos, rounds.quorum, the silos' logs)",
                      task.round, failures, reason)
        self.stop_event.wait(pause)

    def _complete_round(self, state: HubState, metrics: dict[str, float], started: float, task: ActiveTask | None,
                        aggregation_seconds: float | None = None, private: PrivateSums | None = None,
                        decision: AggregationRound | None = None) -> HubState:
        scoring_started = time.time()
        scores = self.records.score(state)
        evaluation_seconds = time.time() - scoring_started if self.records.scores_anything else None
        record = RoundRecord(
            round=state.round, scores=scores, round_seconds=time.time() - started,
            aggregation_seconds=aggregation_seconds, evaluation_seconds=evaluation_seconds,
            hub_peak_rss_bytes=self.rss_meter.process_peak(),
            dp=private.dp if private is not None else None, secagg=private.secagg if private is not None else None,
            aggregation=decision, algorithm=dict(metrics))
        if task is not None:
            with self.cond:
                if task.broadcast is not None:
                    task.broadcast.closed = True
                contributed = contributors(task, private, decision)
                self.records.credit(contributed)  # once per applied round, not per attempt or message
                record = with_silos(record, task, contributed)
        self.records.history.append(record)
        self.failed_attempts = 0
        saving_started = time.time()
        self.records.save(state, self.registry.declared_images())
        record = replace(record, checkpoint_seconds=time.time() - saving_started)
        self.records.history[-1] = record
        with self.cond:
            self.task = None
            self.round = state.round
        log.info("round %d done: %s", state.round, json.dumps({k: short(v) for k, v in record.to_json().items()}))
        self.registry.log_security()
        for sink in [*self.sinks, *([self.callback] if self.callback is not None else [])]:
            sink.round_done(record)
        return state

    @property
    def on_round(self) -> Callable[[RoundRecord], None] | None:
        """The caller's own function of each round's record (the last sink)."""
        return self.callback.callback if self.callback is not None else None

    @on_round.setter
    def on_round(self, callback: Callable[[RoundRecord], None] | None) -> None:
        self.callback = CallbackSink(callback) if callback is not None else None

    def close_sinks(self) -> None:
        for sink in self.sinks:
            sink.close()


def contributors(task: ActiveTask, private: PrivateSums | None,
                 decision: AggregationRound | None = None) -> set[str]:
    """The silos whose updates the applied round holds: under secure aggregation the survivors whose masked inputs
    the sum holds (a silo that advertised keys and then vanished is not one); else those that reported an update,
    not a skip, and stayed, less any a robust aggregation rule left out of the sum (Krum's unselected, say)."""
    if private is not None and private.secagg is not None:
        return set(private.contributors)
    excluded = set(decision.excluded_silos) if decision is not None else set()
    return task.reported - task.gone - task.skipped - excluded


def with_silos(record: RoundRecord, task: ActiveTask, contributed: set[str]) -> RoundRecord:
    """What the round's silos did: who reported, bytes, their mean training loss and time, the hub's memory."""
    finished = task.reported - task.gone  # a silo that reported, then aborted, dropped out
    if task.privacy is not None and task.privacy.session is not None:
        # A report is only its keys: one whose masked input the sum does not hold (silent at a later stage, closed
        # out after the quorum wait) dropped out, as a failed attempt counts it (HubPrivacy.dropouts).
        finished &= contributed
    reporters = len(finished)  # sampled = reported + dropped
    sums = task.sums
    return replace(
        record, silos_left_out=tuple(sorted(task.sampled - finished)),
        quorum_wait_seconds=task.quorum_wait,
        silos_sampled=len(task.sampled), silos_reported=reporters, silos_skipped=len(task.skipped),
        silos_dropped=len(task.sampled) - reporters, silos_contributed=len(contributed),
        attempt=task.attempt, bytes_up=task.bytes_up,
        bytes_down=task.bytes_down + (task.broadcast.bytes_down if task.broadcast else 0),
        silos_received=len(task.broadcast.received) if task.broadcast else None,
        bytes_down_received=task.broadcast.bytes_down if task.broadcast else None,
        silo_train_loss=sums.mean("train_loss") if reporters else None,
        # Where a round's time goes: the silos' own computation (skipping silos report it too), against the
        # round's wall time. Both are means over the silos that sent them.
        silo_train_seconds=sums.mean("train_seconds") if reporters else None,
        # What the hub held beyond its steady state while silos downloaded and uploaded (target: flat in the
        # number of silos); hub_peak_rss_bytes also counts start-up, evaluation and fine-tuning.
        collecting_rss_growth_bytes=task.rss_peak_collecting - task.rss_at_open
        if task.rss_at_open is not None and task.rss_peak_collecting is not None else None)
