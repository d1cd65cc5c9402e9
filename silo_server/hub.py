"""The hub: one object the gRPC servicer, the app and the metrics talk to, made of parts that each hold one concern
and can be read and tested alone:

    registry.py    SiloRegistry  silos, sessions, declared images, liveness, refusals and event counts
    round_loop.py  RoundLoop     sampling, quorum, deadline, retries, aggregation through the privacy layer
    intake.py      TaskIntake    NextTask answers, Download, Upload (validated, then summed), secagg stage messages
    scoring.py     RunRecords    run id, history, scores, checkpoints

They share one lock and condition variable (ChangeCondition). Plain Python, no gRPC: the servicer
(silo_server/servicer.py) is a thin shell that passes the caller's verified certificate identity and the message
in, and maps a Refusal to a gRPC status. Tests drive this class directly. Every field a silo sends goes through
security.validation before it is used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from security import validation
from security.audit import AuditLog
from security.terms import FIRST_RELEASE, PROTOCOL_VERSION, protocol_needed
from silo.v1 import silo_pb2
from silo_core.algorithms.base import HubAlgorithm, HubState
from silo_core.rounds import RoundRecord
from silo_server.breaker import QuarantineList
from silo_server.intake import TaskIntake, TaskView
from silo_server.privacy import HubPrivacy, RoundFailed
from silo_server.registry import CERT_WARN_DAYS, ChangeCondition, Departure, Refusal, SiloRecord, SiloRegistry
from silo_server.robust import AggregationSection
from silo_server.round_loop import PHASES, ActiveTask, RoundLoop, RssMeter
from silo_server.scoring import RunRecords
from silo_server.settings import HALF_MIN_ELEMENTS, RoundSettings, WireLimits, wire_specs

__all__ = ["CERT_WARN_DAYS", "HALF_MIN_ELEMENTS", "PHASES", "ActiveTask", "ChangeCondition", "Departure", "Hub",
           "Refusal",
           "RoundFailed", "RssMeter", "SiloRecord", "TaskView", "wire_specs"]


def _part(part: str, name: str) -> property:
    """An attribute of one of the hub's parts, read and set through the hub."""
    return property(lambda hub: getattr(getattr(hub, part), name),
                    lambda hub, value: setattr(getattr(hub, part), name, value))


class Hub:
    def __init__(
        self,
        algorithm: HubAlgorithm,
        *,
        state_dir: Path,
        total_rounds: int,
        run_description: dict[str, Any],
        silos_per_round: float = 1.0,
        silos_per_round_count: int | None = None,
        min_silos: int = 1,
        quorum: float = 0.5,
        quorum_silos: int | None = None,
        deadline_s: float = 600.0,
        max_attempts: int = 5,
        wait_after_quorum_s: float | None = None,
        liveness_s: float = 60.0,
        max_upload_bytes: int = 512 << 20,
        max_inflight_upload_bytes: int = 64 << 20,
        max_update_norm: float | None = None,
        half_precision: bool = False,
        evaluate: Callable[[HubState], dict[str, float]] | None = None,
        validate: Callable[[HubState], dict[str, float]] | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        seed: int = 0,
        privacy: HubPrivacy | None = None,
        round_hyperparameters: dict[str, Any] | None = None,
        aggregation: AggregationSection | None = None,
        audit: AuditLog | None = None,
    ):
        # hub.yaml's keywords, grouped by the part that uses them.
        settings = RoundSettings(total_rounds, silos_per_round, silos_per_round_count, min_silos, quorum,
                                 quorum_silos, deadline_s, max_attempts, seed, wait_after_quorum_s)
        wire = WireLimits(max_upload_bytes, max_inflight_upload_bytes, max_update_norm, half_precision)
        self.total_rounds = total_rounds
        self.privacy = privacy if privacy is not None and privacy.enabled else None
        self.cond = ChangeCondition()
        self.stop_event = threading.Event()
        self.audit = audit
        self.registry = SiloRegistry(self.cond, liveness_s, audit=audit, quarantine=QuarantineList(state_dir))
        self.records = RunRecords(state_dir, evaluate=evaluate, validate=validate, privacy=self.privacy, audit=audit)
        self.run_id = self.records.run_id
        self.run_description = {**run_description, "run_id": self.run_id, "total_rounds": total_rounds,
                                "protocol_version": PROTOCOL_VERSION}
        # The run's privacy terms, pinned for the run (security/terms.py): stated in the run description, and every
        # task's privacy agrees with them.
        self.terms: silo_pb2.PrivacyTerms = run_description.get("terms") or silo_pb2.PrivacyTerms()
        self.rounds = RoundLoop(algorithm, settings, self.registry, self.records, stop_event=self.stop_event,
                                privacy=self.privacy, half_precision=half_precision, max_update_norm=max_update_norm,
                                round_hyperparameters=round_hyperparameters, on_round=on_round,
                                aggregation=aggregation)
        self.intake = TaskIntake(self.registry, self.rounds, self.run_id, wire, self.terms)

    # What the app, the metrics and the tests read (and some set) on the hub, kept by the part that owns it.
    silos = _part("registry", "silos")
    refusals = _part("registry", "refusals")
    counters = _part("registry", "counters")
    cert_not_after = _part("registry", "cert_not_after")
    is_revoked = _part("registry", "is_revoked")
    liveness_s = _part("registry", "liveness_s")
    declared_before = _part("registry", "declared_before")
    algorithm = _part("rounds", "algorithm")
    sampling = _part("rounds", "sampling")
    max_weight_factor = _part("rounds", "max_weight_factor")
    on_round = _part("rounds", "on_round")
    task = _part("rounds", "task")
    phase = _part("rounds", "phase")
    round = _part("rounds", "round")
    state = _part("rounds", "state")
    stopped_reason = _part("rounds", "stopped_reason")
    failed_attempts = _part("rounds", "failed_attempts")
    history = _part("records", "history")
    initial = _part("records", "initial")
    state_dir = _part("records", "state_dir")
    upload_budget = _part("intake", "upload_budget")

    # ------------------------------------------------------------------ the silo registry
    @property
    def cert_days_left(self) -> dict[str, float]:
        return self.registry.cert_days_left

    def refuse(self, silo_id: str | None, code: str, reason: str, message: str) -> Refusal:
        return self.registry.refuse(silo_id, code, reason, message)

    def count_refusal(self, reason: str, silo_id: str | None = None) -> None:
        self.registry.count_refusal(reason, silo_id)

    def validate(self, silo_id: str | None, check: Callable[[], Any]) -> Any:
        return self.registry.validate(silo_id, check)

    def count(self, name: str, n: int = 1) -> None:
        self.registry.count(name, n)

    def check_session(self, silo_id: str, serial: int | None) -> None:
        self.registry.check_session(silo_id, serial)

    def join(self, silo_id: str, num_unlabeled: int, num_labeled: int, device: str, skipped_images: int = 0,
             preparing: bool = False, serial: int | None = None, protocol_version: int = 0,
             features: Iterable[str] = (), connection: str = "") -> dict[str, Any]:
        """Register a silo (SiloRegistry.join) and return the run description. A silo whose protocol cannot follow
        the run's privacy terms is refused here, with the version to install: a protocol-1 silo would read no
        privacy instructions at all (they were a JSON string) and send its result in the clear."""
        needed, wanted = protocol_needed(self.terms)
        missing = sorted(set(wanted) - set(features))
        speaks = protocol_version or 1  # a silo older than protocol 2 sends no version
        if speaks < needed or missing:
            speaks = (f"protocol {speaks}" + (f" without {', '.join(missing)}" if missing else "")
                      if protocol_version else f"protocol 1 (silokit before {FIRST_RELEASE[PROTOCOL_VERSION]})")
            raise self.refuse(silo_id, "PERMISSION_DENIED", "old_protocol",
                              f"this run's privacy terms need silokit wire protocol {needed} "
                              f"({', '.join(wanted)}); silo {silo_id} speaks {speaks}: install silokit "
                              f"{FIRST_RELEASE[needed]} or newer at the branch")
        self.registry.join(silo_id, num_unlabeled, num_labeled, device, skipped_images, preparing, serial,
                           protocol_version, connection)
        return self.run_description

    def leave(self, silo_id: str, run_id: str, departure: Departure) -> None:
        """A silo leaves the run (its policy refused the terms, a task breached them, its budget is spent): it is
        counted out of the current round at once and never sampled again in this run unless it joins again."""
        self.validate(silo_id, lambda: validation.check_id("run_id", run_id))
        with self.cond:
            self.intake.check_run(silo_id, run_id)
            first = self.registry.leave(silo_id, departure)
            if first:
                self.rounds.leave_round(silo_id)
            self.cond.notify_all()
        if first and self.audit is not None:
            d = departure
            self.audit.append("silo_departed", run=self.run_id, silo=silo_id, departure=d.kind, clause=d.clause,
                              required=d.required, offered=d.offered, message=d.message, round=d.round)

    def evict(self, silo_id: str) -> None:
        self.rounds.evict(silo_id)

    def check_revocations(self) -> None:
        self.rounds.check_revocations()

    def live_silos(self) -> list[str]:
        return self.registry.live_silos()

    def preparing_silos(self) -> list[str]:
        return self.registry.preparing_silos()

    def silos_not_told_done(self) -> list[str]:
        return self.registry.silos_not_told_done()

    # ------------------------------------------------------------------ calls from silos
    def next_task(self, silo_id: str, run_id: str, wait_s: float) -> TaskView:
        """A long-poll that holds the calling thread (tests, in-process callers). The gRPC servicer holds no thread
        while a silo waits: it calls start_poll, poll_task on every change (cond.listeners) and end_poll."""
        end = time.time() + wait_s
        self.start_poll(silo_id, run_id)
        try:
            with self.cond:
                while True:
                    view = self.poll_task(silo_id)
                    remaining = end - time.time()
                    if view.kind != "WAIT" or remaining <= 0 or self.stop_event.is_set():
                        return view
                    self.cond.wait(timeout=min(remaining, 1.0))
        finally:
            self.end_poll(silo_id)

    def start_poll(self, silo_id: str, run_id: str) -> None:
        """A silo begins a long-poll (SiloRegistry.start_poll) in this run."""
        self.validate(silo_id, lambda: validation.check_id("run_id", run_id))
        with self.cond:
            self.intake.check_run(silo_id, run_id)
            self.registry.start_poll(silo_id)

    def poll_task(self, silo_id: str) -> TaskView:
        with self.cond:
            return self.intake.task_for(silo_id)

    def end_poll(self, silo_id: str) -> None:
        self.registry.end_poll(silo_id)

    def download(self, silo_id: str, run_id: str, task_id: str) -> bytes:
        return self.intake.download(silo_id, run_id, task_id)

    def upload(self, silo_id: str, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        self.intake.upload(silo_id, header, chunks)

    # ------------------------------------------------------------------ the round loop
    def _sample_count(self, available: int) -> int:
        return self.rounds.sample_count(available)

    def _quorum_count(self, sampled: int) -> int:
        return self.rounds.quorum_count(sampled)

    def load_state(self) -> HubState | None:
        """Load and verify the latest checkpoint into the hub; None when there is none. HubApp calls this before it
        opens the port, so that a bad state folder stops the hub before any silo is served from it; CheckpointError
        says which file and how to recover."""
        return self.rounds.load_state()

    def resume_or_init(self) -> HubState:
        return self.rounds.resume_or_init()

    def run_round(self, state: HubState) -> HubState:
        return self.rounds.run_round(state)

    def run(self) -> HubState:
        """Resume or start, run every remaining round, and return the final state."""
        return self.rounds.run()

    def stop(self) -> None:
        self.rounds.stop()
