"""The hub's Prometheus metrics: what an operator needs to see how a federation is doing.

Two sources, no Prometheus code in the hub core:

- State read at scrape time from the `Hub` object (round, phase, silos, counters of accepted/refused updates and
  bytes, the latest `RoundRecord` in `hub.records.history`, certificate files). A restarted hub therefore shows the last
  checkpointed round's accuracy at once.
- Events from the round loop's sinks (silo_server/rounds/sinks.py: one `RoundRecord` per completed round) feed the
  histograms and the counters that only make sense per completed round.

The round record (silo_core/rounds.py) is the contract with the hub, the algorithms and the privacy and
secure-aggregation layers; its fields become these metrics (None leaves a gauge at NaN, or at zero for a feature not
in use, or at the algorithm's static value):

    scores.test_accuracy, scores.test_loss   silokit_hub_test_accuracy_ratio, silokit_hub_test_loss
    (hub.records.initial) test_accuracy              silokit_hub_initial_test_accuracy_ratio (before round 1)
    scores.validation_accuracy               silokit_hub_validation_accuracy_ratio, silokit_hub_best_round,
                                             silokit_hub_best_validation_accuracy_ratio
    pseudo_label_ratio, pseudo_label_accuracy  silokit_hub_pseudo_label_ratio, ..._pseudo_label_accuracy_ratio
    silo_train_loss                          silokit_hub_silo_train_loss (mean over the silos that sent it)
    silo_train_seconds                       silokit_hub_silo_train_seconds (mean over the silos that sent it)
    class_thresholds                         silokit_hub_class_threshold{class="<k>"}
    dp.epsilon, dp.epsilon_budget, dp.delta  silokit_hub_dp_epsilon_spent, ..._budget, ..._delta
    secagg.stage_seconds                     silokit_hub_secagg_stage_duration_seconds{stage="<stage>"}
    secagg.recoveries                        silokit_hub_secagg_recoveries_total (silos whose masks were recovered)
    round_seconds, aggregation_seconds       silokit_hub_round_duration_seconds, ..._aggregation_duration_seconds
    evaluation_seconds                       silokit_hub_evaluation_duration_seconds
    checkpoint_seconds                       silokit_hub_checkpoint_duration_seconds
    silos_sampled/reported/skipped/dropped   silokit_hub_round_silos{state=...}, silokit_hub_silo_dropouts_total
    silos_left_out                           silokit_hub_silo_left_out_total{silo}
    (Leave) silos' typed refusals          silokit_hub_silo_departures_total{kind, clause}
    aggregation.excluded, .down_weighted     silokit_hub_round_aggregation_silos{decision="excluded"|"down_weighted"}
                                             (the last round's; 0 under the mean), silokit_hub_aggregation_silos_total

Labels stay low-cardinality: `silo` (one per enrolled silo, a few to a few hundred), `phase`, `state`, `reason`,
`class`, `stage`, `certificate`, `decision`; never a round number or an image.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from security.pki import cert_days_left
from security.terms import CLAUSES
from silo_core.metrics_http import MetricsServer, serve_metrics
from silo_core.rounds import RoundRecord, nan_if_none
from silo_core.selection import BestRound
from silo_server.hub import PHASES, Hub
from silo_server.rounds.sinks import FailedAttempt

log = logging.getLogger("silo_server")

NAN = float("nan")

# Refusal reasons the hub and its servicer can count (registry.py, intake.py, servicer.py). Exported at zero from the
# start, so a rate over them is 0 and not "no data" before the first refusal; new reasons appear when first seen.
REFUSAL_REASONS = (
    "no_identity", "not_joined", "wrong_run", "stale_task", "not_sampled", "wrong_round", "duplicate",
    "bad_metrics", "bad_payload", "no_header",
    # security/gate.py and security/validation.py
    "not_allowed", "not_silo_certificate", "revoked", "expired", "bad_request", "bad_header", "bad_stream",
    "bad_checksum", "bad_tensors", "bad_weight", "non_finite", "update_norm", "oversized", "old_protocol",
    "bad_aggregate",
    # silo_server/wire/intake.py, silo_server/rounds/privacy.py and the registry
    "clip_norm", "bad_secagg", "second_certificate",
    # silo_server/wire/servicer.py: CallLimits, and an upload stream that stopped sending
    "too_many_calls", "call_rate", "stream_idle",
)
# The refusals of an upload that failed validation (servicer.py's header, security/validation.py's checks, the
# round's privacy: a clear result in a secure round, an update over the central-DP clip norm, a malformed
# secure-aggregation message or a secure sum that fails its check): the reasons ops/prometheus/alerts.yml's
# SilokitUpdatesRefused watches.
MALFORMED_UPDATE_REASONS = ("no_header", "bad_header", "bad_stream", "oversized", "bad_checksum", "bad_payload",
                            "bad_tensors", "non_finite", "bad_weight", "update_norm", "bad_metrics", "clip_norm",
                            "bad_secagg", "bad_aggregate")
CALL_METHODS = ("Join", "NextTask", "Download", "Upload", "Leave", "Health")
# A silo's typed refusals (Leave), by kind and the clause it names (security.terms.CLAUSES, or "other"): a bounded
# set, exported at zero from the start.
DEPARTURE_LABELS = tuple((kind, clause) for kind in ("refused", "breach", "budget") for clause in (*CLAUSES, "other"))
# Secure aggregation's stages (Bonawitz et al. 2017, one per protocol round). Exported at zero until used.
SECAGG_STAGES = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmasking")
ROUND_SILO_STATES = ("sampled", "reported", "skipped", "dropped")


class HubMetrics:
    """Prometheus metrics for one hub: a sink of the round records (silo_server/rounds/sinks.py) and a collector of the
    hub's state at scrape time."""

    def __init__(self, hub: Hub, *, certs: Path | None = None, registry: CollectorRegistry | None = None,
                 version: str = "0.2.0"):
        self.hub = hub
        self.certs = Path(certs) if certs else None
        # The certificate the hub serves, once its TLS credentials loaded one (a bundle whose new files do not load
        # together is not served, so the file on disk may be another): the hub's series follows it.
        self.served_certificate: bytes | None = None
        self.version = version
        self.registry = registry or CollectorRegistry()
        self.started = time.time()
        self.last_progress = self.started
        self.round_ends: list[float] = []  # when each round completed in this process (for rounds_silent)
        self.silo_certs: dict[str, bytes] = {}
        self.server: MetricsServer | None = None
        r = self.registry
        self.round_duration = Histogram(
            "silokit_hub_round_duration_seconds", "Wall time of a completed round, from hand-out to applied.",
            buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600), registry=r)
        self.aggregation_duration = Histogram(
            "silokit_hub_aggregation_duration_seconds",
            "Time the hub spent turning a round's sums into the next model (unmask, average, fine-tune, sBN).",
            buckets=(0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.evaluation_duration = Histogram(
            "silokit_hub_evaluation_duration_seconds",
            "Time the hub spent scoring a round's model on its validation split and test set.",
            buckets=(0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.checkpoint_duration = Histogram(
            "silokit_hub_checkpoint_duration_seconds",
            "Time the hub spent writing a round's checkpoint (model state, history, privacy accountant).",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.secagg_duration = Histogram(
            "silokit_hub_secagg_stage_duration_seconds", "Duration of a secure-aggregation stage in a round.",
            ["stage"], buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300), registry=r)
        for stage in SECAGG_STAGES:
            self.secagg_duration.labels(stage)
        self.secagg_recoveries = Counter(
            "silokit_hub_secagg_recoveries", "Dropped silos whose masks were recovered from the survivors' shares.",
            registry=r)
        self.aggregation_silos = Counter(
            "silokit_hub_aggregation_silos", "Silos a robust aggregation rule (aggregation.rule) excluded from a "
            "round or gave under half their part in the mean, summed over rounds.", ["decision"], registry=r)
        for decision in ("excluded", "down_weighted"):
            self.aggregation_silos.labels(decision)
        self.dropouts = Counter(
            "silokit_hub_silo_dropouts", "Sampled silos that did not report before a round attempt closed (applied "
            "or failed).", registry=r)
        self.left_out = Counter(
            "silokit_hub_silo_left_out", "Round attempts a silo was sampled for and left out of: it had not reported "
            "when the attempt closed (at its deadline, or rounds.wait_after_quorum_s after its quorum; a failed "
            "attempt counts too).", ["silo"], registry=r)
        self.progress = Gauge(
            "silokit_hub_last_progress_timestamp_seconds",
            "Unix time the hub last made progress (started, or completed a round).", registry=r)
        self.progress.set(self.started)
        self.registry.register(_HubStateCollector(self))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ... (Linux)
        hub.rounds.sinks.append(self)

    # ------------------------------------------------------------------ events
    def round_done(self, record: RoundRecord) -> None:  # RoundSink
        self.on_round(record)

    def attempt_failed(self, failed: FailedAttempt) -> None:  # RoundSink: a retried attempt closed without them too
        self.dropouts.inc(len(failed.left_out))
        for silo in failed.left_out:
            self.left_out.labels(silo).inc()

    def on_round(self, record: RoundRecord) -> None:
        now = time.time()
        self.round_ends.append(now)
        self.last_progress = now
        self.progress.set(now)
        for histogram, seconds in ((self.round_duration, record.round_seconds),
                                   (self.aggregation_duration, record.aggregation_seconds),
                                   (self.evaluation_duration, record.evaluation_seconds),
                                   (self.checkpoint_duration, record.checkpoint_seconds)):
            if seconds is not None:
                histogram.observe(seconds)
        self.dropouts.inc(max(0, record.silos_dropped or 0))
        for silo in record.silos_left_out:
            self.left_out.labels(silo).inc()
        if record.aggregation is not None:
            self.aggregation_silos.labels("excluded").inc(record.aggregation.excluded)
            self.aggregation_silos.labels("down_weighted").inc(record.aggregation.down_weighted)
        if record.secagg is not None:
            for stage, seconds in record.secagg.stage_seconds.items():
                self.secagg_duration.labels(stage).observe(seconds)
            self.secagg_recoveries.inc(max(0, record.secagg.recoveries))

    def observe_silo_certificate(self, silo_id: str, cert_pem: bytes | None) -> None:
        """Remember a silo's verified client certificate (from the TLS handshake) to export the time it has left."""
        if cert_pem:
            self.silo_certs[silo_id] = cert_pem

    # ------------------------------------------------------------------ serving
    def serve(self, host: str, port: int) -> int:
        self.server = serve_metrics(self.registry, host, port,
                                    "set metrics.port in hub.yaml to a free port (0 picks one) or metrics.enabled false")
        log.info("metrics at %s", self.server.url)
        return self.server.port

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _gauge(name: str, doc: str, value: float | None = None, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value, labels=labels)


def _seconds_left(pem: bytes) -> float | None:
    try:
        return cert_days_left(pem) * 86400.0
    except Exception:  # a certificate we cannot parse is reported by TLS itself; here it only has no metric
        return None


class _HubStateCollector(Collector):
    """Reads the hub's state at scrape time (under the hub's lock, briefly)."""

    def __init__(self, metrics: HubMetrics):
        self.m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        hub = self.m.hub
        now = time.time()
        with hub.cond:
            phase, round_now = hub.rounds.phase, hub.rounds.round
            # A silo waiting in a long-poll is heard from now (the registry counts it live, as here): last_seen is
            # set only when a poll starts and ends, so an idle silo in a 300 s poll showed as disconnected and, three
            # rounds on, silent.
            silos = [(s, now if (r.polling > 0 and r.last_seen) else r.last_seen, hub.records.contributed.get(s, 0),
                      r.num_unlabeled, r.skipped_images, r.left is not None)
                     for s, r in sorted(hub.registry.silos.items())]
            preparing = len(hub.registry.preparing_silos())
            counters, refusals = dict(hub.registry.counters), dict(hub.registry.refusals)
            task = hub.rounds.task
            live = (len(task.sampled), len(task.reported), task.attempt, list(task.plan.class_thresholds)) \
                if task is not None and task.open else None
        history = list(hub.records.history)
        last = history[-1] if history else RoundRecord(round=0)
        desc = hub.run_description

        info = _gauge("silokit_hub_info", "The run this hub serves (value 1).",
                      labels=["run_id", "algorithm", "model", "version"])
        info.add_metric([hub.run_id, str(desc.get("algorithm", "")), str(desc.get("model", "")), self.m.version], 1)
        yield info
        yield _gauge("silokit_hub_round", "The round in progress, or the last completed one between rounds.",
                     round_now)
        yield _gauge("silokit_hub_rounds_completed", "Rounds applied so far in this run (checkpointed).",
                     last.round)
        yield _gauge("silokit_hub_rounds_planned", "Rounds this run will take (rounds.total).",
                     hub.settings.rounds.total_rounds)
        phases = _gauge("silokit_hub_phase", "1 for the hub's current phase, 0 for the others.", labels=["phase"])
        for p in dict.fromkeys((*PHASES, phase)):
            phases.add_metric([p], 1.0 if p == phase else 0.0)
        yield phases
        yield _gauge("silokit_hub_round_attempt",
                     "Attempt of the round in progress (1 normally; more after a below-quorum retry; 0 between rounds).",
                     live[2] if live else 0)
        yield CounterMetricFamily("silokit_hub_round_attempts_below_quorum",
                                  "Round attempts that closed with fewer reports than the quorum and were retried.",
                                  value=counters.get("below_quorum", 0))

        # silos
        yield _gauge("silokit_hub_silos_enrolled", "Silos that joined this run since the hub started.", len(silos))
        connected = [s for s in silos if now - s[1] <= hub.registry.liveness_s]
        yield _gauge("silokit_hub_silos_connected", "Silos heard from within rounds.liveness_s.", len(connected))
        yield _gauge("silokit_hub_silos_preparing", "Connected silos still loading their images (not sampled yet).",
                     preparing)
        round_silos = _gauge("silokit_hub_round_silos", "Silos of the last completed round, by what they did.",
                             labels=["state"])
        for state, count in zip(ROUND_SILO_STATES, (last.silos_sampled, last.silos_reported, last.silos_skipped,
                                                     last.silos_dropped), strict=True):
            if count is not None:
                round_silos.add_metric([state], count)
        yield round_silos
        current = _gauge("silokit_hub_current_round_silos", "Silos sampled for the round in progress and those "
                         "that reported so far (0 between rounds).", labels=["state"])
        current.add_metric(["sampled"], live[0] if live else 0)
        current.add_metric(["reported"], live[1] if live else 0)
        yield current

        # updates and traffic
        accepted = CounterMetricFamily("silokit_hub_updates_accepted", "Results accepted into a round's sums "
                                       "(kind update) or as an empty report (kind skip).", labels=["kind"])
        accepted.add_metric(["update"], counters.get("accepted_updates", 0))
        accepted.add_metric(["skip"], counters.get("accepted_skips", 0))
        yield accepted
        refused = CounterMetricFamily("silokit_hub_refusals", "Requests refused, by reason (an upload refused "
                                      "changes nothing in the round).", labels=["reason"])
        for reason in sorted({*REFUSAL_REASONS, *refusals}):
            refused.add_metric([reason], refusals.get(reason, 0))
        yield refused
        by_silo = CounterMetricFamily(
            "silokit_hub_silo_refusals", "Requests refused, by silo (a name its certificate carries) and reason: which silo "
            "floods the hub (call_rate, too_many_calls) or sends what it must not.", labels=["silo", "reason"])
        for (silo, reason), n in sorted(dict(hub.registry.refusals_by_silo).items()):
            by_silo.add_metric([silo, reason], n)
        yield by_silo
        quarantined = GaugeMetricFamily(
            "silokit_hub_silo_quarantined", "1 for each silo quarantined for breaking a securely aggregated sum "
            "(not sampled until `silo-server --lift-quarantine NAME`).", labels=["silo"])
        for silo in sorted(hub.registry.quarantine.names() if hub.registry.quarantine is not None else ()):
            quarantined.add_metric([silo], 1.0)
        yield quarantined
        yield GaugeMetricFamily("silokit_hub_silos_quarantined", "Silos quarantined for breaking a securely "
                                "aggregated sum.", value=len(hub.registry.quarantine.names())
                                if hub.registry.quarantine is not None else 0)
        calls = CounterMetricFamily("silokit_hub_calls", "Calls the hub admitted (past the gate and the per-silo "
                                    "limits), by method.", labels=["method"])
        for method in CALL_METHODS:
            calls.add_metric([method], counters.get(f"calls:{method}", 0))
        yield calls
        departed = CounterMetricFamily(
            "silokit_hub_silo_departures", "Silos that refused the run's privacy terms or left the run (Leave), by "
            "kind (refused at join, breach of the pinned terms, budget spent) and the policy clause they named.",
            labels=["kind", "clause"])
        departures = dict(hub.registry.departures)
        for key in sorted({*DEPARTURE_LABELS, *departures}):  # at zero from the start, as the refusals
            departed.add_metric(list(key), departures.get(key, 0))
        yield departed
        yield CounterMetricFamily("silokit_hub_received_bytes", "Bytes of results received from silos.",
                                  value=counters.get("received_bytes", 0))
        yield CounterMetricFamily("silokit_hub_sent_bytes", "Bytes of round bundles sent to silos.",
                                  value=counters.get("sent_bytes", 0))

        # model quality
        tested = [h.scores for h in history if h.scores.test_accuracy is not None]
        yield _gauge("silokit_hub_test_accuracy_ratio", "Test accuracy after the last completed round (0..1).",
                     tested[-1].test_accuracy if tested else NAN)
        yield _gauge("silokit_hub_test_accuracy_previous_ratio", "Test accuracy after the round before the last.",
                     tested[-2].test_accuracy if len(tested) > 1 else NAN)
        yield _gauge("silokit_hub_test_loss", "Test cross-entropy after the last completed round.",
                     nan_if_none(tested[-1].test_loss) if tested else NAN)
        yield _gauge("silokit_hub_initial_test_accuracy_ratio", "Test accuracy of the initial model, trained on the "
                     "hub's labels alone before round 1, where the silos start from (0..1).",
                     nan_if_none(hub.records.initial.test_accuracy))
        validated = [h.scores.validation_accuracy for h in history if h.scores.validation_accuracy is not None]
        best = BestRound.from_history(history, hub.records.initial)
        yield _gauge("silokit_hub_validation_accuracy_ratio", "Accuracy on the hub's validation split after the last "
                     "completed round (0..1).", validated[-1] if validated else NAN)
        yield _gauge("silokit_hub_best_round", "The round whose model scored best on the validation split so far, "
                     "kept as best_model.safetensors (0: the initial model, trained on the hub's labels alone, or "
                     "none yet while the accuracy below is NaN).", best.round)
        yield _gauge("silokit_hub_best_validation_accuracy_ratio", "That round's validation accuracy (0..1).",
                     best.accuracy if best.found else NAN)
        yield _gauge("silokit_hub_pseudo_label_ratio", "Share of the silos' unlabeled images whose pseudo-label "
                     "passed the threshold in the last round.", nan_if_none(last.pseudo_label_ratio))
        yield _gauge("silokit_hub_pseudo_label_accuracy_ratio", "Share of the passing pseudo-labels that were right "
                     "(known in simulation only).", nan_if_none(last.pseudo_label_accuracy))
        yield _gauge("silokit_hub_silo_train_loss", "Mean local training loss of the silos in the last round.",
                     nan_if_none(last.silo_train_loss))
        yield _gauge("silokit_hub_silo_train_seconds", "Mean time a reporting silo spent in local training in the "
                     "last round (NaN under differential privacy or secure aggregation, where silos send no metrics).",
                     nan_if_none(last.silo_train_seconds))
        thresholds = _gauge("silokit_hub_class_threshold", "Confidence a pseudo-label of this class must reach.",
                            labels=["class"])
        for k, v in self._thresholds(last, live[3] if live else []):
            thresholds.add_metric([str(k)], v)
        yield thresholds

        # privacy and security: the last round that charged the accountant (a round with no update charges nothing)
        dp = next((h.dp for h in reversed(history) if h.dp is not None), None)
        yield _gauge("silokit_hub_dp_epsilon_spent", "Differential-privacy epsilon spent so far (0 without DP).",
                     dp.epsilon if dp is not None else 0.0)
        yield _gauge("silokit_hub_dp_epsilon_budget", "Differential-privacy epsilon budget (0 without DP or "
                     "without a budget).", (dp.epsilon_budget or 0.0) if dp is not None else 0.0)
        yield _gauge("silokit_hub_dp_delta", "Differential-privacy delta (0 without DP).",
                     (dp.delta or 0.0) if dp is not None else 0.0)
        decided = _gauge("silokit_hub_round_aggregation_silos", "Silos the robust aggregation rule (aggregation.rule) "
                         "excluded from the last round or gave under half their part in the mean (0 under the "
                         "mean).", labels=["decision"])
        rule = last.aggregation
        decided.add_metric(["excluded"], rule.excluded if rule is not None else 0.0)
        decided.add_metric(["down_weighted"], rule.down_weighted if rule is not None else 0.0)
        yield decided
        certs = _gauge("silokit_hub_certificate_remaining_seconds", "Time until the hub's own certificate (hub) or "
                       "the federation CA's (ca) expires.", labels=["certificate"])
        if self.m.certs is not None:
            for label, name in (("hub", "cert.pem"), ("ca", "ca.pem")):
                try:
                    served = self.m.served_certificate if label == "hub" else None
                    left = _seconds_left(served or (self.m.certs / name).read_bytes())
                except OSError:
                    left = None
                if left is not None:
                    certs.add_metric([label], left)
        yield certs

        # per silo (one series per enrolled silo)
        last_seen = _gauge("silokit_hub_silo_last_seen_timestamp_seconds", "Unix time the hub last heard from "
                           "the silo.", labels=["silo"])
        is_connected = _gauge("silokit_hub_silo_connected", "1 if the silo was heard from within rounds.liveness_s.",
                              labels=["silo"])
        silent = _gauge("silokit_hub_silo_rounds_silent", "Rounds completed since the hub last heard from the silo "
                        "(none for a silo that left the run).", labels=["silo"])
        contributed = _gauge("silokit_hub_silo_rounds_contributed", "Rounds whose sums hold this silo's update "
                             "(the whole run, across hub restarts).", labels=["silo"])
        images = _gauge("silokit_hub_silo_unlabeled_images", "Unlabeled images the silo declared at join.",
                        labels=["silo"])
        skipped = _gauge("silokit_hub_silo_skipped_images", "Unreadable image files the silo skipped.",
                         labels=["silo"])
        silo_certs = _gauge("silokit_hub_silo_certificate_remaining_seconds", "Time until the silo's client "
                           "certificate (as presented in its last join) expires.", labels=["silo"])
        ends = self.m.round_ends
        for silo_id, seen, rounds, n_images, n_skipped, departed in silos:
            last_seen.add_metric([silo_id], seen)
            is_connected.add_metric([silo_id], 1.0 if now - seen <= hub.registry.liveness_s else 0.0)
            if not departed:  # a branch that left the run on purpose is not missing (SilokitBranchLeft says so)
                silent.add_metric([silo_id], len(ends) - bisect.bisect_right(ends, seen))
            contributed.add_metric([silo_id], rounds)
            images.add_metric([silo_id], n_images)
            skipped.add_metric([silo_id], n_skipped)
            pem = self.m.silo_certs.get(silo_id)
            left = _seconds_left(pem) if pem else None
            if left is not None:
                silo_certs.add_metric([silo_id], left)
        yield from (last_seen, is_connected, silent, contributed, images, skipped, silo_certs)

    def _thresholds(self, last: RoundRecord, planned: list[float]) -> list[tuple[int, float]]:
        """Per-class thresholds: the round's own (FedSEAL), else the plan's, else the algorithm's single tau."""
        if last.class_thresholds:
            return list(last.class_thresholds.items())
        if planned:
            return list(enumerate(planned))
        desc = self.m.hub.run_description
        options = desc.get("algorithm_options", {})
        tau = options.get("tau")
        if tau is None or options.get("threshold_rule", "fixed") != "fixed":
            return []  # no single tau, or each silo computes its own per-class thresholds (SemiFL threshold_rule)
        return [(k, float(tau)) for k in range(int(desc.get("num_classes", 0)))]
