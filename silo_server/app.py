"""Assemble a hub from a validated HubConfig: data, model, algorithm, gRPC server; run it; export the result."""

from __future__ import annotations

import datetime as dt
import gc
import json
import logging
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from cryptography import x509

import silo_core
from security.audit import AUDIT_FILE, AuditError, AuditLog, read_records
from security.crl import RevocationList
from security.gate import PeerGate
from security.pki import BUNDLE_CA, BUNDLE_CRL, cert_days_left
from security.secagg.identity import PeerVerifier
from security.secagg.messages import MAX_TASK_MESSAGE_BYTES
from security.terms import PROTOCOL_VERSION, run_terms, terms_sha256
from security.terms import as_dict as terms_dict
from security.tls import ReloadingServerCredentials
from silo.v1 import silo_pb2
from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import HubData, HubState
from silo_core.data import (
    DEFAULT_CACHE_MB,
    DEFAULT_LOADER_WORKERS,
    ImageSet,
    describe_classes,
    load_demo,
    load_labeled_folder,
    load_torchvision,
)
from silo_core.files import write_json_atomic
from silo_core.models import (
    ModelSpec,
    WeightsReport,
    architecture,
    architecture_sha256,
    count_parameters,
    load_weights,
    starting_weights,
)
from silo_core.partition import split_labeled_per_class
from silo_core.rounds import RoundRecord, Scores
from silo_core.selection import BestRound
from silo_core.tensors import sha256_hex
from silo_core.training import evaluate, resolve_device
from silo_server.config import DataSource, HubConfig
from silo_server.hub import CERT_WARN_DAYS, Hub, HubSettings
from silo_server.metrics import HubMetrics
from silo_server.rounds.privacy import HubPrivacy
from silo_server.rounds.sinks import TensorBoardSink
from silo_server.state.checkpoint import BEST_MODEL, load_best_round, save_best_model, write_model
from silo_server.wire.servicer import FederationServer, FederationServicer

log = logging.getLogger("silo_server")


def load_source(src: DataSource, image_size: int, channels: int, cache_mb: float = DEFAULT_CACHE_MB,
                workers: int = DEFAULT_LOADER_WORKERS) -> ImageSet:
    """A data source's images: an imagefolder in memory or read from disk as the hub trains (``cache_mb``)."""
    if src.kind == "imagefolder":
        images = load_labeled_folder(src.path, image_size, channels, cache_mb=cache_mb, workers=workers)
    elif src.kind == "torchvision":
        images = load_torchvision(src.name, src.root, src.split == "train", image_size, channels)
    else:
        images = load_demo(src.split)
        if images.images.shape[-1] != image_size or images.images.shape[1] != channels:
            raise ValueError("the bundled demo data is 28x28 grayscale: set model.image_size 28 and in_channels 1")
    if images.skipped:
        log.warning("%d unreadable images skipped in %s (first: %s)", len(images.skipped),
                    src.path or src.name or "demo", images.skipped[0])
    if src.labels_per_class is not None:
        idx, _ = split_labeled_per_class(images.labels.numpy(), src.labels_per_class, src.seed)
        images = images.subset(np.sort(idx))
    return images


class HubApp:
    """A configured hub, ready to serve. Tests and silo-sim drive it in-process too."""

    def __init__(self, config: HubConfig, insecure_dev_only: bool = False):
        self.config = config
        self.insecure_dev_only = insecure_dev_only
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        self.device = resolve_device(config.run.device)
        m, d = config.model, config.data
        self.labeled = load_source(d.labeled, m.image_size, m.in_channels, d.cache_mb, d.loader_workers)
        if self.labeled.labels is None or len(self.labeled) < 2:
            raise ValueError("data.labeled must hold labeled images (at least 2)")
        # The class names go to every silo (RunDescription.classes, UTF-8 on the wire) and into the model card.
        unnamed = [c for c in self.labeled.classes if not utf8_text(c)]
        if unnamed:
            raise ValueError(f"data.labeled has a class folder whose name is not UTF-8 text ({unnamed[0]!r}); rename "
                             "it (silos name their labeled class folders the same)")
        self.test = load_source(d.test, m.image_size, m.in_channels, d.cache_mb, d.loader_workers) if d.test else None
        self.validation = validation = (load_source(d.validation, m.image_size, m.in_channels, d.cache_mb,
                                                    d.loader_workers) if d.validation else None)
        for key, split in (("data.test", self.test), ("data.validation", validation)):
            # Labels are positions in the sorted class list: a split with another list would be scored (and, for
            # validation, select models and FedSEAL's thresholds) against shifted labels without any error.
            if split is not None and list(split.classes) != list(self.labeled.classes):
                raise ValueError(f"{key} has classes {describe_classes(split.classes)} but data.labeled has "
                                 f"{describe_classes(self.labeled.classes)}: both must list the same classes (give a "
                                 "class the split lacks an empty folder)")
        self.spec = ModelSpec.from_config(m, len(self.labeled.classes))
        entry = get_algorithm(config.algorithm.name)
        self.options = config.algorithm.parsed_options()
        hub_data = HubData(
            self.labeled.images, self.labeled.labels,
            validation.images if validation else None, validation.labels if validation else None,
        )
        self.algorithm = entry.hub(self.options, self.spec, hub_data, self.device, config.run.seed,
                                   config.rounds.total)
        self.initial_weights_report = self.load_initial_weights()
        # The hub's own hash-chained audit (security/audit.py): runs and their config's hash, joins, silos that
        # left and why, refusals (once a minute per silo and reason), every checkpoint written. `silo-audit verify`
        # checks it as it checks a silo's.
        self.audit = AuditLog(Path(config.run.state_dir) / AUDIT_FILE)
        self.hub = Hub(
            self.algorithm,
            HubSettings.from_config(config),
            state_dir=config.run.state_dir,
            run_description=self.run_description(),
            privacy=HubPrivacy(config.privacy) if config.privacy.enabled else None,
            aggregation=config.aggregation,
            round_hyperparameters=({"sample_dp": config.privacy.sample_dp.hyperparameters()}
                                   if config.privacy.sample_dp.enabled else None),
            audit=self.audit,
            evaluate=self.evaluate if self.test is not None else None,
            validate=self.validate if validation is not None else None,
        )
        self.best_pending: torch.nn.Module | None = None  # the best round's model until its checkpoint is written
        self.hub.records.after_save = self.keep_best_model
        if config.run.tensorboard is not None:  # one more sink of the round records (silo_server/rounds/sinks.py)
            self.hub.rounds.sinks.append(TensorBoardSink(Path(config.run.tensorboard) / self.hub.run_id,
                                                         initial=lambda: self.hub.records.initial))
        # The best round so far on the validation split; its model is kept in the state dir across restarts.
        self.best = (load_best_round(config.run.state_dir, self.hub.run_id) if validation is not None
                     else BestRound())
        self.metrics = (HubMetrics(self.hub, certs=config.server.certs,
                                   version=getattr(silo_core, "__version__", "0.2.0"))
                        if config.metrics.enabled else None)
        self.server: FederationServer | None = None
        self.port: int | None = None

    def load_initial_weights(self) -> WeightsReport | None:
        """Read model.init_weights / init_from_run once, try them on the model now (a file that does not fit stops
        the hub here, before any silo is served), log what loaded, and hand them to the algorithm's hub half for
        its initial training. The run description is unchanged: silos never see the file, only the model."""
        m = self.config.model
        start = starting_weights(m.init_from_run, m.init_weights, self.spec)
        if start is None:
            return None
        weights, source = start
        report = load_weights(self.spec.build(), weights, self.spec.num_classes, source)
        for i, line in enumerate(report.lines()):
            log.log(logging.WARNING if i and report.worrying else logging.INFO, line)
        self.algorithm.initial_weights = weights
        return report

    def initial_weights_card(self) -> dict[str, Any] | None:
        """Where the run's starting model came from (model.init_weights / init_from_run), for the model card: the
        file, its sha256 as read now, and what loaded; None for a random start."""
        report = self.initial_weights_report
        if report is None:
            return None
        path = Path(report.source)
        return {
            "file": str(path),
            "sha256": sha256_hex(path.read_bytes()) if path.is_file() else None,
            "loaded": len(report.loaded),
            "stem_summed_over_colour": list(report.summed_stem),
            "head_reinitialised": list(report.head),
            "missing": list(report.missing),
            "unexpected": list(report.unexpected),
        }

    def run_description(self) -> dict[str, Any]:
        c = self.config
        return {
            "algorithm": c.algorithm.name,
            "algorithm_options": self.options.model_dump(mode="json"),
            "model": self.spec.name,
            "model_options": self.spec.options,
            "model_factory": self.spec.factory or "",
            "architecture": architecture(self.spec.build()),
            "num_classes": self.spec.num_classes,
            "classes": list(self.labeled.classes),
            "in_channels": self.spec.in_channels,
            "image_size": self.spec.image_size,
            "mean": self.spec.mean,
            "std": self.spec.std,
            "max_upload_bytes": c.wire.max_upload_bytes,
            "chunk_bytes": c.wire.chunk_bytes,
            "terms": self.terms(),
        }

    def terms(self) -> silo_pb2.PrivacyTerms:
        """The run's privacy terms (security/terms.py), pinned for the run and stated in the run description."""
        c, p = self.config, self.config.privacy
        silo = get_algorithm(c.algorithm.name).silo
        asked = [*silo.clear_metrics, "train_seconds"] if (silo is not None and p.clear_metrics) else []
        rate = c.rounds.silos_per_round if c.rounds.silos_per_round_count is None else 0.0
        return run_terms(secure_aggregation=p.secure_aggregation, dp=p.dp, sample_dp=p.sample_dp,
                         total_rounds=c.rounds.total, min_cohort=p.secure_aggregation.min_cohort,
                         clear_metrics=asked, sample_rate=rate, signed=not self.insecure_dev_only)

    def departures(self) -> dict[str, dict[str, Any]]:
        """The silos that refused this run's terms or left it, and why, as the hub's audit recorded them (the last
        word of each silo; a silo that joined again afterwards is not listed): for --check and the model card."""
        out: dict[str, dict[str, Any]] = {}
        try:
            for _, record in read_records(self.audit.path):
                if record.get("kind") == "silo_departed" and record.get("run") == self.hub.run_id:
                    out[record["silo"]] = record
                elif record.get("kind") == "join" and not record.get("preparing"):
                    out.pop(record.get("silo"), None)
        except AuditError as err:
            log.warning("cannot read the hub's audit to list departed silos: %s", err)
        return out

    def evaluate(self, state: HubState) -> dict[str, float]:
        model = self.algorithm.served_model(state)
        return evaluate(model, self.test.images, self.test.labels, self.spec.mean, self.spec.std, self.device)

    def validate(self, state: HubState) -> dict[str, float]:
        """Score the round's model on the validation split and keep it when it is the best round so far."""
        model = self.algorithm.served_model(state)
        result = evaluate(model, self.validation.images, self.validation.labels, self.spec.mean, self.spec.std,
                          self.device)
        if self.best.offer(state.round, result["accuracy"]):
            self.best_pending = model  # written once the round's checkpoint is (keep_best_model)
        return result

    def keep_best_model(self) -> None:
        """After a checkpoint: write the best round's model, if that round is new. Not before the checkpoint: a hub
        killed between the two would resume with a privacy accountant that does not count the round whose noised
        model best_model.safetensors already held."""
        model, self.best_pending = self.best_pending, None
        if model is None:
            return
        save_best_model(self.config.run.state_dir, model, self.hub.run_id, self.best)
        log.info("round %d is the best so far on the validation split (%.2f%%): %s updated", self.best.round,
                 100 * self.best.accuracy, BEST_MODEL)

    def load_checkpoint(self) -> HubState | None:
        """Load and verify the latest checkpoint (None without one), and finish what a hub killed between a round's
        checkpoint and its best-model write left undone: the checkpoint holds that round's model, so it is written
        now, and best_model.safetensors, the model card and the best-round gauge agree again."""
        state = self.hub.rounds.load_state()
        if state is None or self.validation is None:
            return state
        recorded = BestRound.from_history(self.hub.records.history, self.hub.records.initial)
        if recorded.found and recorded.round == state.round and recorded != self.best:
            self.best = recorded
            save_best_model(self.config.run.state_dir, self.algorithm.served_model(state), self.hub.run_id, recorded)
            log.warning("round %d was the best on the validation split (%.2f%%) but the hub stopped before keeping its "
                        "model; %s now holds it", recorded.round, 100 * recorded.accuracy, BEST_MODEL)
        return state

    # -------------------------------------------------------------- serving
    def start_server(self) -> int:
        s = self.config.server
        # The bundle first: a missing or broken bundle is the likelier mistake, and its error says what to run.
        if not self.insecure_dev_only:
            self.credentials = ReloadingServerCredentials(s.certs, on_load=self._hub_certificate_loaded)
        gate = self.make_gate()
        if gate.revocations is not None:  # a silo busy training is evicted from its round when it is revoked
            self.hub.registry.is_revoked = gate.revocations.is_revoked
            if self.hub.privacy is not None:  # secure aggregation checks every silo's signed keys, as silos do
                self.hub.privacy.verifier = PeerVerifier((Path(s.certs) / BUNDLE_CA).read_bytes(),
                                                         gate.revocations.is_revoked)
                self.hub.privacy.run_id = self.hub.run_id
        # Threads only for the hub calls that may block (join, download, upload); waiting silos hold none.
        self.pool = futures.ThreadPoolExecutor(max_workers=s.max_workers, thread_name_prefix="hub-call")
        servicer = FederationServicer(
            self.hub, s.long_poll_s, self.config.wire.chunk_bytes, gate,
            on_join=self.metrics.observe_silo_certificate if self.metrics else None,
            header_timeout_s=s.upload_header_timeout_s, stream_idle_s=s.upload_idle_s, pool=self.pool,
        )
        self.server = FederationServer(servicer, options=[
            ("grpc.max_receive_message_length", self.config.wire.chunk_bytes + (64 << 10)),
            ("grpc.max_send_message_length", max(self.config.wire.chunk_bytes + (64 << 10), MAX_TASK_MESSAGE_BYTES)),
            # gRPC shares a port with another process by default (SO_REUSEPORT): a second hub, or a restart
            # while the old hub still runs, would bind "successfully" and split the silos' calls between them.
            ("grpc.so_reuseport", 0),
            # A long-poll carries no data for minutes: accept the silos' keepalive pings (every 30 s) meanwhile,
            # and ping them ourselves so a vanished silo's held call ends.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        port_file = Path(self.config.run.state_dir) / "port"
        port, picked_before = s.port, False
        if port == 0 and port_file.is_file():
            # A restart with server.port 0: running silos keep dialing the port the first start picked, so come back
            # on that one rather than on a new free port they would never find.
            port, picked_before = self._picked_port(port_file), True
        host = "127.0.0.1" if self.insecure_dev_only else s.host  # dev mode: loopback only, no TLS, no identity
        self.port = self._bind(f"{host}:{port}", None if self.insecure_dev_only else self.credentials.credentials,
                               port_file if picked_before else None)
        # /metrics after the silos' port is bound: a metrics port the system picks (metrics.port 0) can then never
        # be the port this hub was just told to listen on (silo-sim picks that one ahead of the hub's start; CI once
        # saw the system hand the same free port to /metrics first).
        if self.metrics is not None and self.metrics.server is None:  # after the certificates are known good
            m = self.config.metrics
            metrics_port = self.metrics.serve(m.host, m.port)
            (Path(self.config.run.state_dir) / "metrics_port").write_text(str(metrics_port))
        self.server.start()
        port_file.write_text(str(self.port))
        if self.insecure_dev_only:
            self._warn_insecure(s.host)
        else:
            log.info("hub listening on %s:%d (mutual TLS, certificates from %s)", s.host, self.port, s.certs)
        return self.port

    @staticmethod
    def _picked_port(port_file: Path) -> int:
        text = port_file.read_text().strip()
        if not text.isdigit() or not 0 < int(text) <= 65535:
            raise OSError(f"{port_file} should hold the port this hub picked on its first start (server.port: 0), "
                          f"but holds {text[:20]!r}; set server.port in the config to the port the silos dial")
        return int(text)

    def _bind(self, address: str, credentials: grpc.ServerCredentials | None, port_file: Path | None = None) -> int:
        """Listen on address; `port_file` names where a port picked on an earlier start came from (server.port 0)."""
        port = self.server.add_port(address, credentials)
        if port:
            return port
        if port_file is not None:
            raise OSError(f"cannot listen on {address}, the port this hub picked on its first start (server.port: "
                          f"0, kept in {port_file}) and the one its silos dial: it is taken now; set server.port in "
                          f"the config explicitly (to a free port, and point the silos at it)")
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not local; "
                      f"set server.port in the config to a free port")

    def make_gate(self) -> PeerGate:
        """Who may call: identity from the verified certificate, checked against the CRL and the allowlist."""
        sec = self.config.security
        if self.insecure_dev_only:
            return PeerGate(allowed_silos=sec.allowed_silos, insecure_dev=True)
        certs = self.config.server.certs
        crl = sec.crl or Path(certs) / BUNDLE_CRL
        revocations = RevocationList(crl, Path(certs) / BUNDLE_CA)
        log.info("revocation list %s: %d revoked certificates; checked on every call, reloaded when it changes",
                 crl, len(revocations.revoked_serials))
        if sec.allowed_silos is not None:
            log.info("allowlist: %d silos may join (security.allowed_silos)", len(sec.allowed_silos))
        return PeerGate(revocations=revocations, allowed_silos=sec.allowed_silos)

    def check_security(self) -> None:
        """What start_server would refuse, without listening: the bundle, the CRL, the allowlist."""
        if not self.insecure_dev_only:
            ReloadingServerCredentials(self.config.server.certs, on_load=self._hub_certificate_loaded)
        self.make_gate()

    def _hub_certificate_loaded(self, cert_pem: bytes) -> None:
        cert = x509.load_pem_x509_certificate(cert_pem)
        if self.metrics is not None:
            self.metrics.served_certificate = cert_pem
        self.hub.registry.cert_not_after["hub"] = cert.not_valid_after_utc
        days = cert_days_left(cert_pem)
        level = logging.WARNING if days < CERT_WARN_DAYS else logging.INFO
        log.log(level, "hub certificate serial %x: expires in %.1f days (%s)%s", cert.serial_number, days,
                f"{cert.not_valid_after_utc:%Y-%m-%d}",
                "; renew it with `silo-certs renew hub` and copy cert.pem and key.pem into server.certs"
                if days < CERT_WARN_DAYS else "")

    def _warn_insecure(self, configured_host: str) -> None:
        bar = "!" * 100
        lines = [
            bar,
            f"INSECURE DEVELOPMENT MODE (--insecure-dev-only): plaintext gRPC on 127.0.0.1:{self.port} only.",
            "No encryption and no certificates: silos DECLARE their id (silo-client --insecure-dev-only --silo-id)",
            "and any process on this machine can claim to be any silo. Never use this mode with real data.",
            "Drop --insecure-dev-only to serve with mutual TLS.",
            bar,
        ]
        if configured_host not in ("127.0.0.1", "localhost", "::1"):
            lines.insert(2, f"server.host {configured_host} is ignored in this mode: nothing listens beyond loopback.")
        for line in lines:
            log.warning(line)

    def stop(self, grace: float = 1.0) -> None:
        self.hub.stop()
        self.hub.rounds.close_sinks()
        if self.server is not None:
            self.server.stop(grace)
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.metrics is not None:
            self.metrics.close()

    def run(self) -> HubState:
        """Serve, run every round, export the model, linger so silos hear that the run is over, stop."""
        # The checkpoint is loaded and verified before the port opens: a bad state folder stops the hub with one
        # line before any silo is served from it. A fresh run's initial training still comes after (in hub.run),
        # while the silos load their images.
        if self.hub.rounds.state is None:
            self.load_checkpoint()
        self.audit.append("run_start", run=self.hub.run_id, config_sha256=config_sha256(self.config),
                          terms_sha256=terms_sha256(self.hub.terms), protocol_version=PROTOCOL_VERSION,
                          resumed_after_round=self.hub.rounds.state.round if self.hub.rounds.state is not None else 0)
        if self.server is None:
            self.start_server()

        def on_signal(signum, frame):
            log.warning("signal %d: stopping after saving state (the last checkpoint is kept)", signum)
            self.hub.stop()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_signal)
        # What start-up built (modules, model, data, server) lives for the run: frozen, the collector's full scans
        # skip it (they were about 7% of the hub's CPU while 1,000 silos joined, perf).
        gc.freeze()
        try:
            try:
                state = self.hub.run()
            except Exception:
                # The error goes up and the process exits; a Prometheus that scrapes this endpoint sees it failed
                # (silokit_hub_phase), not the phase it was in.
                self.hub.rounds.set_phase("failed")
                if self.metrics is not None and self.metrics.server is not None:
                    self.metrics.server.wait_for_scrape(self.config.metrics.final_scrape_s)
                raise
            if self.hub.stop_event.is_set():
                return state
            self.export(state)
            self.done_at = time.time()
            linger_until = time.time() + self.config.server.linger_s
            stay_until = time.time() + self.config.server.min_linger_s  # at most linger_s (config.py checks)
            while time.time() < linger_until and not self.hub.stop_event.is_set():
                if time.time() >= stay_until and not self._silos_still_waiting():
                    break
                time.sleep(0.2)
            if self.metrics is not None and self.metrics.server is not None:
                self.metrics.server.wait_for_scrape(self.config.metrics.final_scrape_s)  # the final round's values
            return state
        finally:
            self.stop()

    def _silos_still_waiting(self) -> bool:
        # After the final round every waiting silo hears DONE at once (its long-poll is answered); the hub stays
        # only until each live silo has heard it, or for server.linger_s at most.
        return bool(self.hub.registry.silos_not_told_done())

    # -------------------------------------------------------------- the result
    def export(self, state: HubState) -> Path:
        out = Path(self.config.run.state_dir)
        model = self.algorithm.served_model(state)
        weights = write_model(out / "model.safetensors", model)
        final = self.hub.records.history[-1].scores if self.hub.records.history else Scores()
        card = {
            "format": "silokit model card v1",
            "created": dt.datetime.now(dt.UTC).isoformat(),
            "silokit_version": getattr(silo_core, "__version__", "0.2.0"),
            "run_id": self.hub.run_id,
            "run_name": self.config.run.name,
            "algorithm": self.config.algorithm.name,
            "algorithm_options": self.options.model_dump(mode="json"),
            "model": {
                "name": self.spec.name, "factory": self.spec.factory, "options": self.spec.options,
                "num_classes": self.spec.num_classes,
                "architecture_sha256": architecture_sha256(architecture(model)),
                "in_channels": self.spec.in_channels, "image_size": self.spec.image_size,
                "normalize_mean": self.spec.mean, "normalize_std": self.spec.std,
                "parameters": count_parameters(model),
            },
            "classes": self.labeled.classes,
            "rounds": state.round,
            "hub_labeled_images": len(self.labeled),
            "silos": self.silos_card(),
            "final_metrics": final.to_json(),
            "best_round": self.best_round_card(),
            "privacy": self.hub.privacy.summary() if self.hub.privacy else {"secure_aggregation": False},
            "initial_weights": self.initial_weights_card(),
            "stopped_early": self.hub.rounds.stopped_reason or None,
            "privacy_terms": {"sha256": terms_sha256(self.hub.terms), "terms": terms_dict(self.hub.terms)},
            "silos_departed": {s: {k: d[k] for k in ("departure", "clause", "required", "offered", "message")}
                               for s, d in sorted(self.departures().items())},
            "weights_file": weights.name,
            "weights_sha256": sha256_hex(weights.read_bytes()),
            "weights_round": state.round,  # the round whose model weights_file holds (best_round has its own)
            "inference": f"load with safetensors, build {self.algorithm.served_structure}, load_state_dict, call "
                         ".eval() (silo-predict and silo-export do this); inputs are images scaled to [0,1] then "
                         "normalised with normalize_mean/std",
        }
        write_json_atomic(out / "model_card.json", card)
        if self.validation is not None:
            self.log_best_round(out / BEST_MODEL)
        log.info("final model written to %s (card: %s)", weights, out / "model_card.json")
        return weights

    def log_best_round(self, path: Path) -> None:
        if not self.best.found:
            return
        if self.best.round == 0 and self.hub.records.history:
            # The silos' rounds made the model worse on the hub's own labeled split: the operator should hear it
            # before deploying either file, not find it in the card.
            log.warning("best round on the validation split: 0 (%.2f%%), the initial model: no round beat the hub's "
                        "labels alone, so %s holds it and model.safetensors (the last round) scored lower; look at "
                        "the rounds' validation accuracy and pseudo-label pass rate in history.json before "
                        "deploying either", 100 * self.best.accuracy, path)
        else:  # round 0 without rounds: a run of zero rounds keeps its initial model
            log.info("best round on the validation split: %d (%.2f%%), in %s", self.best.round,
                     100 * self.best.accuracy, path)

    def silos_card(self) -> dict[str, dict[str, Any]]:
        """Every silo of the run: those joined since the hub (re)started, and those whose updates are in the model
        from before a restart and that have not joined since (their images as declared then, kept in the
        checkpoint; their unreadable files unknown): the card listed only the first."""
        registry, contributed = self.hub.registry, self.hub.records.contributed
        declared = registry.declared_images()
        card: dict[str, dict[str, Any]] = {
            s: {"rounds_contributed": contributed.get(s, 0), "unlabeled_images": r.num_unlabeled,
                "skipped_images": r.skipped_images} for s, r in registry.silos.items()}
        for s, rounds in contributed.items():
            card.setdefault(s, {"rounds_contributed": rounds, "unlabeled_images": declared.get(s),
                                "skipped_images": None})
        return dict(sorted(card.items()))

    def best_round_card(self) -> dict[str, Any] | None:
        """The model card's account of best_model.safetensors; None without a validation split."""
        path = Path(self.config.run.state_dir) / BEST_MODEL
        if self.validation is None or not self.best.found or not path.is_file():
            return None
        # The round's test scores (round 0: the initial model's), unless a hub crash made it keep a model that the
        # redone round did not beat.
        scored = [RoundRecord(round=0, scores=self.hub.records.initial), *self.hub.records.history]
        scores = next((h.scores for h in scored if h.round == self.best.round
                       and h.scores.validation_accuracy == self.best.accuracy), Scores())
        return {
            "round": self.best.round,
            "chosen_by": f"accuracy on data.validation ({len(self.validation)} images); a tie goes to the later round",
            "validation_accuracy": self.best.accuracy,
            "metrics": {k: v for k, v in scores.to_json().items() if k.startswith("test_")},
            "weights_file": path.name,
            "weights_sha256": sha256_hex(path.read_bytes()),
        }


def describe(config: HubConfig) -> str:
    return json.dumps(config.model_dump(mode="json"), indent=2)


def config_sha256(config: HubConfig) -> str:
    """A fingerprint of the validated config (canonical JSON): the audit records it per run, never the config
    itself, whose paths name the hub's data."""
    return sha256_hex(json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode())


def utf8_text(name: str) -> bool:
    """Whether a name read from the file system is text the wire can carry (a folder named in another encoding
    reaches Python with surrogates, which protobuf refuses)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
