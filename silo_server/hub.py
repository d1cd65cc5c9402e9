"""The hub: one object the gRPC servicer, the app and the metrics talk to, made of parts that each hold one concern
and can be read and tested alone:

    registry.py    SiloRegistry  silos, sessions, declared images, liveness, refusals and event counts
    round_loop.py  RoundLoop     sampling, quorum, deadline, retries, aggregation through the privacy layer
    intake.py      TaskIntake    NextTask answers, Download, Upload (validated, then summed), secagg stage messages
    scoring.py     RunRecords    run id, history, scores, checkpoints

They share one lock and condition variable (ChangeCondition). Plain Python, no gRPC: the servicer
(silo_server/wire/servicer.py) is a thin shell that passes the caller's verified certificate identity and the message
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
from silo_server.rounds.breaker import QuarantineList
from silo_server.rounds.memory import RssMeter
from silo_server.rounds.privacy import HubPrivacy, RoundFailed
from silo_server.rounds.robust import AggregationSection
from silo_server.rounds.round_loop import PHASES, RoundLoop
from silo_server.rounds.task import ActiveTask
from silo_server.settings import HALF_MIN_ELEMENTS, HubSettings, RoundSettings, WireLimits, wire_specs
from silo_server.state.registry import (
    CERT_WARN_DAYS,
    ChangeCondition,
    Departure,
    Refusal,
    SiloRecord,
    SiloRegistry,
)
from silo_server.state.scoring import RunRecords
from silo_server.wire.intake import TaskIntake, TaskView

__all__ = ["CERT_WARN_DAYS", "HALF_MIN_ELEMENTS", "PHASES", "ActiveTask", "ChangeCondition", "Departure", "Hub",
           "HubSettings", "Refusal", "RoundFailed", "RoundSettings", "RssMeter", "SiloRecord", "TaskView", "WireLimits",
           "wire_specs"]


class Hub:
    """Built from the typed settings (HubSettings.from_config for hub.yaml). What the hub does itself is answer the
    calls silos make and run the rounds; everything else is reached through its parts: hub.registry (silos,
    refusals, counters, liveness), hub.rounds (the task, phase, round, state, sampling), hub.records (history,
    scores, checkpoints) and hub.intake (uploads)."""

    def __init__(
        self,
        algorithm: HubAlgorithm,
        settings: HubSettings,
        *,
        state_dir: Path,
        run_description: dict[str, Any],
        privacy: HubPrivacy | None = None,
        aggregation: AggregationSection | None = None,
        round_hyperparameters: dict[str, Any] | None = None,
        audit: AuditLog | None = None,
        evaluate: Callable[[HubState], dict[str, float]] | None = None,
        validate: Callable[[HubState], dict[str, float]] | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
    ):
        self.settings = settings
        total_rounds = settings.rounds.total_rounds
        self.privacy = privacy if privacy is not None and privacy.enabled else None
        self.cond = ChangeCondition()
        self.stop_event = threading.Event()
        self.audit = audit
        self.registry = SiloRegistry(self.cond, settings.liveness_s, audit=audit,
                                     quarantine=QuarantineList(state_dir))
        self.records = RunRecords(state_dir, evaluate=evaluate, validate=validate, privacy=self.privacy, audit=audit)
        self.run_id = self.records.run_id
        self.run_description = {**run_description, "run_id": self.run_id, "total_rounds": total_rounds,
                                "protocol_version": PROTOCOL_VERSION}
        # The run's privacy terms, pinned for the run (security/terms.py): stated in the run description, and every
        # task's privacy agrees with them.
        self.terms: silo_pb2.PrivacyTerms = run_description.get("terms") or silo_pb2.PrivacyTerms()
        self.rounds = RoundLoop(algorithm, settings.rounds, self.registry, self.records, stop_event=self.stop_event,
                                privacy=self.privacy, half_precision=settings.wire.half_precision,
                                max_update_norm=settings.wire.max_update_norm,
                                round_hyperparameters=round_hyperparameters, on_round=on_round,
                                aggregation=aggregation)
        self.intake = TaskIntake(self.registry, self.rounds, self.run_id, settings.wire, self.terms)

    # ------------------------------------------------------------------ joining and leaving
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
            raise self.registry.refuse(silo_id, "PERMISSION_DENIED", "old_protocol",
                                       f"this run's privacy terms need silokit wire protocol {needed} "
                                       f"({', '.join(wanted)}); silo {silo_id} speaks {speaks}: install silokit "
                                       f"{FIRST_RELEASE[needed]} or newer at the branch")
        self.registry.join(silo_id, num_unlabeled, num_labeled, device, skipped_images, preparing, serial,
                           protocol_version, connection)
        return self.run_description

    def leave(self, silo_id: str, run_id: str, departure: Departure) -> None:
        """A silo leaves the run (its policy refused the terms, a task breached them, its budget is spent): it is
        counted out of the current round at once and never sampled again in this run unless it joins again."""
        self.registry.validate(silo_id, lambda: validation.check_id("run_id", run_id))
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
        self.registry.validate(silo_id, lambda: validation.check_id("run_id", run_id))
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
    def run(self) -> HubState:
        """Resume or start, run every remaining round, and return the final state."""
        return self.rounds.run()

    def stop(self) -> None:
        self.rounds.stop()
