"""A silo's Prometheus metrics, for the branch's operator (and the hub's, where the network lets it scrape).

Every series carries a `silo` label (the silo id, the CN of its certificate). One registry can hold many silos:
silo-sim's workers host many silos in one process and serve them all on one /metrics endpoint, one series per
silo (silo ids are few and stable, so the label stays low-cardinality); a standalone silo-client serves one.

    families = SiloMetricFamilies(CollectorRegistry())
    metrics = SiloMetrics(families, "branch-07", certs=Path("pki/silos/branch-07"))
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from security.pki import cert_days_left
from silo_core.metrics_http import MetricsServer, serve_metrics

NAN = float("nan")
PHASES = ("joining", "waiting", "backing_off", "done", "refused", "left")  # silo_client/connection.py Phase


@dataclass(frozen=True)
class Family:
    """One metric family a silo exports: its name, kind, help, and the label beside `silo` (None: only `silo`)."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    label: str | None = None


TRAIN_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

ROUNDS_JOINED = Family("silokit_silo_rounds_joined", "counter", "Rounds this silo trained for and reported "
                       "(including skips).")
ROUNDS_SKIPPED = Family("silokit_silo_rounds_skipped", "counter", "Rounds reported as skipped (no pseudo-label "
                        "passed the threshold).")
TRAIN_DURATION = Family("silokit_silo_local_train_duration_seconds", "histogram", "Local training time per round.")
ROUND = Family("silokit_silo_round", "gauge", "The last round this silo trained for.")
SAMPLES = Family("silokit_silo_samples", "gauge", "Unlabeled images this silo holds (readable ones).")
UNREADABLE = Family("silokit_silo_unreadable_images", "gauge", "Image files skipped as unreadable.")
ABOVE_THRESHOLD = Family("silokit_silo_samples_above_threshold", "gauge", "Images whose pseudo-label passed the "
                         "threshold in the last round.")
PSEUDO_LABEL_RATIO = Family("silokit_silo_pseudo_label_ratio", "gauge", "Share of images whose pseudo-label passed "
                            "the threshold in the last round.")
PSEUDO_LABEL_ACCURACY = Family("silokit_silo_pseudo_label_accuracy_ratio", "gauge", "Share of passing pseudo-labels "
                               "that were right (simulation only: needs true labels).")
SAMPLE_DP_EPSILON = Family("silokit_silo_sample_dp_epsilon", "gauge", "Sample-level DP epsilon this silo has spent "
                           "in the run (privacy.sample_dp), at the hub's delta.")
# The silo's own ledger (silo_client/ledger.py), by which guarantee each figure is, at the policy's delta:
EPSILON = Family(
    "silokit_silo_epsilon", "gauge", "Epsilon by this silo's own ledger, never the hub's numbers. guarantee="
    "\"client_dp\": client-level DP with distributed noise in this run, holds only while at least the round's "
    "minimum number of cohort silos add their noise honestly; \"sample_dp\": DP-SGD in this run, holds "
    "against any hub; \"image\": the tighter of the two for one image in this run (NaN: no guarantee); "
    "\"lifetime\": the sum of the runs' image epsilons across all runs and hubs.", "guarantee")
PHASE = Family("silokit_silo_connection_phase", "gauge", "1 for the phase this silo's connection is in (joining, "
               "waiting, backing_off, done, refused, left; silo_client/connection.py).", "phase")
DEPARTURES = Family("silokit_silo_departures", "counter", "Runs this silo refused or left by its policy, by kind "
                    "(refused, breach, budget).", "kind")
LOCAL_LOSS = Family("silokit_silo_local_loss", "gauge", "Mean local training loss in the last trained round.")
RECEIVED = Family("silokit_silo_received_bytes", "counter", "Bytes of round bundles downloaded from the hub.")
SENT = Family("silokit_silo_sent_bytes", "counter", "Bytes of results uploaded to the hub.")
DEVICE = Family("silokit_silo_device_info", "gauge", "The device this silo trains on (value 1).", "device")
LAST_CONTACT = Family("silokit_silo_last_contact_timestamp_seconds", "gauge", "Unix time of the last call the hub "
                      "answered.")
UPDATES_UNSENT = Family("silokit_silo_updates_unsent", "counter", "Rounds this silo trained for whose update failed "
                        "its own check before sending (a float16 overflow under the hub's wire.half_precision, "
                        "say): nothing was sent.")
HUB_ERRORS = Family("silokit_silo_hub_errors", "counter", "Calls to the hub that failed, by gRPC status.", "code")
FAMILIES = (ROUNDS_JOINED, ROUNDS_SKIPPED, TRAIN_DURATION, ROUND, SAMPLES, UNREADABLE, ABOVE_THRESHOLD,
            PSEUDO_LABEL_RATIO, PSEUDO_LABEL_ACCURACY, SAMPLE_DP_EPSILON, EPSILON, PHASE, DEPARTURES, LOCAL_LOSS,
            RECEIVED, SENT, DEVICE, LAST_CONTACT, UPDATES_UNSENT, HUB_ERRORS)


class SiloMetricFamilies:
    """The silo families of one registry, for any number of silos; `SiloMetrics` is one silo's view of them.

    Each silo's values are plain numbers, turned into metric families only when scraped: a silo-sim host sets up
    hundreds of silos at start-up, and a labelled child per family and silo from prometheus_client cost about 1 ms
    of CPU per silo, a quarter of the host's start-up work."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.lock = threading.Lock()
        # silo -> family name -> value (families with a second label: label value -> value); histograms as
        # [bucket counts..., +Inf count, sum]
        self.values: dict[str, dict[str, Any]] = {}
        self.registry.register(_SiloCollector(self))
        self.certificates = _CertificateCollector()
        self.registry.register(self.certificates)
        ProcessCollector(registry=self.registry)  # the process hosting the silo(s): memory, CPU time, open files

    def serve(self, host: str, port: int) -> MetricsServer:
        return serve_metrics(self.registry, host, port, "pass --metrics-port with a free port (0 picks one)")


class _SiloCollector(Collector):
    def __init__(self, families: SiloMetricFamilies):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        with self.families.lock:
            silos = {silo: {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                            for k, v in values.items()} for silo, values in self.families.values.items()}
        for family in FAMILIES:
            labels = ["silo"] if family.label is None else ["silo", family.label]
            if family.kind == "histogram":
                metric = HistogramMetricFamily(family.name, family.help, labels=labels)
            elif family.kind == "counter":
                metric = CounterMetricFamily(family.name, family.help, labels=labels)
            else:
                metric = GaugeMetricFamily(family.name, family.help, labels=labels)
            for silo in sorted(silos):
                value = silos[silo].get(family.name)
                if value is None:
                    continue
                if family.kind == "histogram":
                    counts, total = value[:-1], value[-1]
                    cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
                    bounds = [floatToGoString(b) for b in TRAIN_BUCKETS] + ["+Inf"]
                    metric.add_metric([silo], list(zip(bounds, cumulative, strict=True)), total)
                elif family.label is None:
                    metric.add_metric([silo], value)
                else:
                    for second, v in sorted(value.items()):
                        metric.add_metric([silo, second], v)
            yield metric


class SiloMetrics:
    """One silo's view of the families. Every method is cheap and never raises into the training loop."""

    def __init__(self, families: SiloMetricFamilies, silo: str, certs: Path | None = None):
        self.f, self.silo = families, silo
        self.device: str | None = None
        with families.lock:
            families.values[silo] = {
                # exported at zero from the start
                ROUNDS_JOINED.name: 0.0, ROUNDS_SKIPPED.name: 0.0, RECEIVED.name: 0.0, SENT.name: 0.0,
                UPDATES_UNSENT.name: 0.0,
                TRAIN_DURATION.name: [0] * (len(TRAIN_BUCKETS) + 1) + [0.0], ROUND.name: 0.0, LAST_CONTACT.name: 0.0,
                # unknown until the first round, not zero
                ABOVE_THRESHOLD.name: NAN, PSEUDO_LABEL_RATIO.name: NAN, PSEUDO_LABEL_ACCURACY.name: NAN,
                LOCAL_LOSS.name: NAN,
                EPSILON.name: dict.fromkeys(("client_dp", "sample_dp", "image", "lifetime"), NAN),  # none charged yet
            }
        self.values = families.values[silo]
        if certs is not None:
            # The certificate this silo dials with: its bundle is read once, when it starts, so a renewed file on
            # disk is not in use before a restart and must not silence the expiry alert.
            try:
                families.certificates.in_use[silo] = (Path(certs) / "cert.pem").read_bytes()
            except OSError:  # missing or unreadable: the TLS layer reports that; here it has no series
                pass

    def _set(self, family: Family, value: float, label: str | None = None) -> None:
        with self.f.lock:
            if label is None:
                self.values[family.name] = value
            else:
                self.values.setdefault(family.name, {})[label] = value

    def _add(self, family: Family, amount: float, label: str | None = None) -> None:
        with self.f.lock:
            if label is None:
                self.values[family.name] = self.values.get(family.name, 0.0) + amount
            else:
                series = self.values.setdefault(family.name, {})
                series[label] = series.get(label, 0.0) + amount

    def contact(self) -> None:
        self._set(LAST_CONTACT, time.time())

    def joined(self, device: str, samples: int, unreadable: int) -> None:
        self.contact()
        with self.f.lock:  # one device per silo: a re-join may bring another, which replaces it
            self.values[DEVICE.name] = {device: 1.0}
        self.device = device
        self._set(SAMPLES, samples)
        self._set(UNREADABLE, unreadable)

    def unreadable(self, count: int) -> None:
        """Image files skipped as unreadable so far: at load, and found while training on files read lazily."""
        self._set(UNREADABLE, count)

    def received(self, n: int) -> None:
        self.contact()
        self._add(RECEIVED, n)

    def sent(self, n: int) -> None:
        self.contact()
        self._add(SENT, n)

    def trained(self, round_: int, seconds: float, metrics: Mapping[str, float], skipped: bool) -> None:
        """After an accepted upload: the round's local training and what the algorithm reported."""
        self._add(ROUNDS_JOINED, 1)
        if skipped:
            self._add(ROUNDS_SKIPPED, 1)
        self._set(ROUND, round_)
        with self.f.lock:
            histogram = self.values[TRAIN_DURATION.name]
            histogram[bisect.bisect_left(TRAIN_BUCKETS, seconds)] += 1
            histogram[-1] += seconds
        total, selected = metrics.get("pl_total"), metrics.get("pl_selected")
        if selected is not None:
            self._set(ABOVE_THRESHOLD, selected)
            if total:
                self._set(PSEUDO_LABEL_RATIO, selected / total)
            if selected and "pl_correct" in metrics:
                self._set(PSEUDO_LABEL_ACCURACY, metrics["pl_correct"] / selected)
        if "train_loss" in metrics:
            self._set(LOCAL_LOSS, metrics["train_loss"])
        if "sample_dp_epsilon" in metrics:
            self._set(SAMPLE_DP_EPSILON, metrics["sample_dp_epsilon"])

    def unsent(self) -> None:
        """A trained update that failed the silo's own check: nothing was sent."""
        self._add(UPDATES_UNSENT, 1)

    def hub_error(self, code: str) -> None:
        self._add(HUB_ERRORS, 1, code)

    def epsilon(self, client: float | None, sample: float | None, image: float, lifetime: float) -> None:
        """The ledger's figures after a round (None: that guarantee does not apply in this run)."""
        for guarantee, value in (("client_dp", client), ("sample_dp", sample), ("image", image),
                                 ("lifetime", lifetime)):
            self._set(EPSILON, NAN if value is None or value == float("inf") else value, guarantee)

    def phase(self, phase: str) -> None:
        """The connection's phase now (silo_client/connection.py): 1 for it, 0 for the others."""
        with self.f.lock:
            self.values[PHASE.name] = {name: 1.0 if name == phase else 0.0 for name in PHASES}

    def departed(self, kind: str) -> None:
        self._add(DEPARTURES, 1, kind)


class _CertificateCollector(Collector):
    """Time left on the certificate each silo dials with (read from its bundle when it started, as the silo does:
    a renewal shows once the silo restarts on it)."""

    def __init__(self) -> None:
        self.in_use: dict[str, bytes] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("silokit_silo_certificate_remaining_seconds", "Time until this silo's client "
                                   "certificate expires.", labels=["silo"])
        for silo, pem in sorted(self.in_use.items()):
            try:
                family.add_metric([silo], cert_days_left(pem) * 86400.0)
            except Exception:  # not a certificate: the TLS layer reports that; here it has no series
                continue
        yield family
