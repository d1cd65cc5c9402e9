"""A silo's Prometheus metrics, for the branch's operator (and the hub's, where the network lets it scrape).

Every series carries a `silo` label (the silo id, the CN of its certificate). One registry can hold many silos:
silo-sim's workers host many silos in one process and serve them all on one /metrics endpoint, one series per
silo (silo ids are few and stable, so the label stays low-cardinality); a standalone silo-client serves one.

    families = SiloMetricFamilies(CollectorRegistry())
    metrics = SiloMetrics(families, "branch-07", certs=Path("pki/silos/branch-07"))
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from security.pki import cert_days_left
from silo_core.metrics_http import MetricsServer, serve_metrics

NAN = float("nan")
PHASES = ("joining", "waiting", "backing_off", "done", "refused", "left")  # silo_client/connection.py Phase


class SiloMetricFamilies:
    """The metric families, once per registry; `SiloMetrics` binds them to one silo."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, s = self.registry, ["silo"]
        self.rounds_joined = Counter("silokit_silo_rounds_joined", "Rounds this silo trained for and reported "
                                     "(including skips).", s, registry=r)
        self.rounds_skipped = Counter("silokit_silo_rounds_skipped", "Rounds reported as skipped (no pseudo-label "
                                      "passed the threshold).", s, registry=r)
        self.train_duration = Histogram("silokit_silo_local_train_duration_seconds", "Local training time per "
                                        "round.", s, buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
                                        registry=r)
        self.round = Gauge("silokit_silo_round", "The last round this silo trained for.", s, registry=r)
        self.samples = Gauge("silokit_silo_samples", "Unlabeled images this silo holds (readable ones).", s,
                             registry=r)
        self.unreadable = Gauge("silokit_silo_unreadable_images", "Image files skipped as unreadable.", s,
                                registry=r)
        self.above_threshold = Gauge("silokit_silo_samples_above_threshold", "Images whose pseudo-label passed the "
                                     "threshold in the last round.", s, registry=r)
        self.pseudo_label_ratio = Gauge("silokit_silo_pseudo_label_ratio", "Share of images whose pseudo-label "
                                        "passed the threshold in the last round.", s, registry=r)
        self.pseudo_label_accuracy = Gauge("silokit_silo_pseudo_label_accuracy_ratio", "Share of passing "
                                           "pseudo-labels that were right (simulation only: needs true labels).",
                                           s, registry=r)
        self.sample_dp_epsilon = Gauge("silokit_silo_sample_dp_epsilon", "Sample-level DP epsilon this silo has "
                                       "spent in the run (privacy.sample_dp), at the hub's delta.", s, registry=r)
        # The silo's own ledger (silo_client/ledger.py), by which guarantee each figure is, at the policy's delta:
        self.epsilon = Gauge(
            "silokit_silo_epsilon", "Epsilon by this silo's own ledger, never the hub's numbers. guarantee="
            "\"client_dp\": client-level DP with distributed noise in this run, holds only while at least the round's "
            "minimum number of cohort silos add their noise honestly; \"sample_dp\": DP-SGD in this run, holds "
            "against any hub; \"image\": the tighter of the two for one image in this run (NaN: no guarantee); "
            "\"lifetime\": the sum of the runs' image epsilons across all runs and hubs.", ["silo", "guarantee"],
            registry=r)
        self.phase = Gauge("silokit_silo_connection_phase", "1 for the phase this silo's connection is in "
                           "(joining, waiting, backing_off, done, refused, left; silo_client/connection.py).",
                           ["silo", "phase"], registry=r)
        self.departures = Counter("silokit_silo_departures", "Runs this silo refused or left by its policy, by kind "
                                  "(refused, breach, budget).", ["silo", "kind"], registry=r)
        self.local_loss = Gauge("silokit_silo_local_loss", "Mean local training loss in the last trained round.", s,
                                registry=r)
        self.received = Counter("silokit_silo_received_bytes", "Bytes of round bundles downloaded from the hub.", s,
                                registry=r)
        self.sent = Counter("silokit_silo_sent_bytes", "Bytes of results uploaded to the hub.", s, registry=r)
        self.device = Gauge("silokit_silo_device_info", "The device this silo trains on (value 1).",
                            ["silo", "device"], registry=r)
        self.last_contact = Gauge("silokit_silo_last_contact_timestamp_seconds", "Unix time of the last call the "
                                  "hub answered.", s, registry=r)
        self.hub_errors = Counter("silokit_silo_hub_errors", "Calls to the hub that failed, by gRPC status.",
                                  ["silo", "code"], registry=r)
        self.certificates = _CertificateCollector()
        r.register(self.certificates)
        ProcessCollector(registry=r)  # the process hosting the silo(s): memory, CPU time, open files

    def serve(self, host: str, port: int) -> MetricsServer:
        return serve_metrics(self.registry, host, port, "pass --metrics-port with a free port (0 picks one)")


class SiloMetrics:
    """One silo's view of the families. Every method is cheap and never raises into the training loop."""

    def __init__(self, families: SiloMetricFamilies, silo: str, certs: Path | None = None):
        self.f, self.silo = families, silo
        self.device: str | None = None
        for family in (families.rounds_joined, families.rounds_skipped, families.train_duration, families.received,
                       families.sent):
            family.labels(silo)  # exported at zero from the start
        families.round.labels(silo).set(0)
        for gauge in (families.above_threshold, families.pseudo_label_ratio, families.pseudo_label_accuracy,
                      families.local_loss):
            gauge.labels(silo).set(NAN)  # unknown until the first round, not zero
        # Children used on every call or phase change, looked up once: labels() takes the family's lock, which a
        # host's hundreds of silos would otherwise queue on at start-up.
        self._last_contact = families.last_contact.labels(silo)
        self._last_contact.set(0)
        self._phases = {name: families.phase.labels(silo, name) for name in PHASES}
        for guarantee in ("client_dp", "sample_dp", "image", "lifetime"):
            families.epsilon.labels(silo, guarantee).set(NAN)  # no round charged yet
        if certs is not None:
            families.certificates.files[silo] = Path(certs) / "cert.pem"

    def contact(self) -> None:
        self._last_contact.set(time.time())

    def joined(self, device: str, samples: int, unreadable: int) -> None:
        self.contact()
        if self.device not in (None, device):  # one device per silo; a re-join may bring another
            self.f.device.remove(self.silo, self.device)
        self.device = device
        self.f.device.labels(self.silo, device).set(1)
        self.f.samples.labels(self.silo).set(samples)
        self.f.unreadable.labels(self.silo).set(unreadable)

    def unreadable(self, count: int) -> None:
        """Image files skipped as unreadable so far: at load, and found while training on files read lazily."""
        self.f.unreadable.labels(self.silo).set(count)

    def received(self, n: int) -> None:
        self.contact()
        self.f.received.labels(self.silo).inc(n)

    def sent(self, n: int) -> None:
        self.contact()
        self.f.sent.labels(self.silo).inc(n)

    def trained(self, round_: int, seconds: float, metrics: Mapping[str, float], skipped: bool) -> None:
        """After an accepted upload: the round's local training and what the algorithm reported."""
        f, s = self.f, self.silo
        f.rounds_joined.labels(s).inc()
        if skipped:
            f.rounds_skipped.labels(s).inc()
        f.round.labels(s).set(round_)
        f.train_duration.labels(s).observe(seconds)
        total, selected = metrics.get("pl_total"), metrics.get("pl_selected")
        if selected is not None:
            f.above_threshold.labels(s).set(selected)
            if total:
                f.pseudo_label_ratio.labels(s).set(selected / total)
            if selected and "pl_correct" in metrics:
                f.pseudo_label_accuracy.labels(s).set(metrics["pl_correct"] / selected)
        if "train_loss" in metrics:
            f.local_loss.labels(s).set(metrics["train_loss"])
        if "sample_dp_epsilon" in metrics:
            f.sample_dp_epsilon.labels(s).set(metrics["sample_dp_epsilon"])

    def hub_error(self, code: str) -> None:
        self.f.hub_errors.labels(self.silo, code).inc()

    def epsilon(self, client: float | None, sample: float | None, image: float, lifetime: float) -> None:
        """The ledger's figures after a round (None: that guarantee does not apply in this run)."""
        for guarantee, value in (("client_dp", client), ("sample_dp", sample), ("image", image),
                                 ("lifetime", lifetime)):
            self.f.epsilon.labels(self.silo, guarantee).set(NAN if value is None or value == float("inf")
                                                           else value)

    def phase(self, phase: str) -> None:
        """The connection's phase now (silo_client/connection.py): 1 for it, 0 for the others."""
        for name, child in self._phases.items():
            child.set(1.0 if name == phase else 0.0)

    def departed(self, kind: str) -> None:
        self.f.departures.labels(self.silo, kind).inc()


class _CertificateCollector(Collector):
    """Time left on each silo's own certificate, read from its bundle at scrape time (renewals show at once)."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("silokit_silo_certificate_remaining_seconds", "Time until this silo's client "
                                   "certificate expires.", labels=["silo"])
        for silo, path in sorted(self.files.items()):
            try:
                family.add_metric([silo], cert_days_left(path.read_bytes()) * 86400.0)
            except Exception:  # missing or unreadable: the TLS layer reports that; here it has no series
                continue
        yield family
