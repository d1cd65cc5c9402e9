"""What silos fetch from a round and send back: the NextTask answer, the round's bundle (Download) and their
results (Upload), each validated before it is used; a result is summed into the round only whole and valid.
Secure-aggregation stage messages come in here too and are checked by the round's session (privacy.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from security import validation
from security.secagg import ProtocolError
from security.secagg.messages import DuplicateMessage, StageNotOpen
from silo.v1 import silo_pb2
from silo_core.tensors import TensorSpec
from silo_server.rounds.aggregate import UploadBudget
from silo_server.rounds.privacy import STAGE_UPLOADS, HubPrivacy
from silo_server.rounds.round_loop import RoundLoop
from silo_server.rounds.task import ActiveTask
from silo_server.settings import WireLimits
from silo_server.state.registry import SiloRegistry

log = logging.getLogger("silo_server")


@dataclass
class TaskView:
    """What NextTask answers, transport-neutral."""

    kind: str  # "WAIT" | "TRAIN" | "RECEIVE" | "SECAGG" | "DONE"
    round: int = 0
    task_id: str = ""
    bundle_bytes: int = 0
    bundle_sha256: str = ""
    hyperparameters_json: str = "{}"
    class_thresholds: list[float] = field(default_factory=list)
    expected: dict[str, TensorSpec] = field(default_factory=dict)
    retry_after_s: float = 1.0
    message: str = ""
    privacy: silo_pb2.TaskPrivacy | None = None  # TRAIN: the round's privacy, typed (None: the run has none)
    secagg_stage: str = ""  # SECAGG: the stage to run (share_keys, masked_input, consistency, unmask), its input
    secagg_payload: bytes = b""
    upload_within_s: float = 0.0  # TRAIN, SECAGG: seconds from now that the hub still takes the task's upload


def _left(deadline: float) -> float:
    """Seconds until `deadline` (Unix time), never below 0: what a task's upload_within_s tells the silo."""
    return max(0.0, deadline - time.time())


class TaskIntake:
    def __init__(self, registry: SiloRegistry, rounds: RoundLoop, run_id: str, wire: WireLimits,
                 terms: silo_pb2.PrivacyTerms | None = None):
        self.registry = registry
        self.terms = terms or silo_pb2.PrivacyTerms()  # pinned for the run: every task's privacy agrees with them
        self.rounds = rounds  # its current task, phase and round; silos leaving a round
        self.cond = registry.cond
        self.run_id = run_id
        self.wire = wire
        self.upload_budget = UploadBudget(wire.max_inflight_upload_bytes)

    def check_run(self, silo_id: str, run_id: str) -> None:
        if run_id != self.run_id:
            raise self.registry.refuse(silo_id, "FAILED_PRECONDITION", "wrong_run",
                                       f"run {run_id or '(none)'} is not this hub's run; call Join again")

    # ------------------------------------------------------------------ NextTask
    def task_for(self, silo_id: str) -> TaskView:
        """What the silo should do now (call under the lock)."""
        rounds = self.rounds
        if rounds.phase == "done":
            self.registry.tell_done(silo_id)
            return TaskView("DONE", message="run done")
        if rounds.phase == "failed":
            # Not DONE: a silo takes DONE for the run's end and exits for good, while the hub stopped by an error
            # is restarted (systemd, an operator) and resumes from its checkpoint; the silo waits, then rejoins.
            return TaskView("WAIT", retry_after_s=5.0, message="the hub stopped on an error; it resumes from its "
                            "checkpoint when restarted")
        t = rounds.task
        if t and t.open and silo_id in t.sampled and silo_id not in t.reported:
            return TaskView(
                "TRAIN", round=t.round, task_id=t.task_id, bundle_bytes=len(t.bundle), bundle_sha256=t.bundle_sha256,
                hyperparameters_json=t.hyperparameters_json, class_thresholds=list(t.plan.class_thresholds),
                expected=t.expected, privacy=self._task_privacy(t), upload_within_s=_left(t.deadline),
            )
        if t and t.open and self._may_receive(silo_id, t):
            # The round's model without a part in it: the same bundle and plan as TRAIN, nothing to upload. An old
            # silo that does not know RECEIVE waits retry_after_s and asks again.
            return TaskView(
                "RECEIVE", round=t.round, task_id=t.task_id, bundle_bytes=len(t.bundle), bundle_sha256=t.bundle_sha256,
                hyperparameters_json=t.hyperparameters_json, class_thresholds=list(t.plan.class_thresholds),
                expected=t.expected, retry_after_s=1.0,
            )
        if t and t.privacy is not None and silo_id in t.sampled:
            stage = HubPrivacy.view(t.privacy, silo_id)
            if stage is not None:
                return TaskView("SECAGG", round=t.round, task_id=t.task_id, secagg_stage=stage[0],
                                secagg_payload=stage[1], upload_within_s=_left(t.privacy.outbox_deadline))
        return TaskView("WAIT", retry_after_s=0.5, message=f"phase {rounds.phase}, round {rounds.round}")

    def _task_privacy(self, t: ActiveTask) -> silo_pb2.TaskPrivacy | None:
        sample_dp = self.terms.sample_dp if self.terms.sample_dp.enabled else None
        if t.privacy is not None:
            return t.privacy.task_privacy(t.task_id, sample_dp)
        return silo_pb2.TaskPrivacy(sample_dp=sample_dp) if sample_dp is not None else None

    def _may_receive(self, silo_id: str, t: ActiveTask) -> bool:
        """A silo outside the round's sample gets the round's model when the algorithm broadcasts it: once a round,
        and only when done loading its images (call under the lock)."""
        if t.broadcast is None or silo_id in t.sampled or silo_id in t.broadcast.received:
            return False
        record = self.registry.silos.get(silo_id)
        return record is not None and record.ready

    def _task_of(self, silo_id: str, task_id: str, receiving: bool = False) -> ActiveTask:
        """The open task `task_id` names, if this silo has a part in it: sampled, or (`receiving`, a download) a
        silo the round's model is broadcast to. Such a silo may still download while the round is aggregated: it
        was told RECEIVE when the round opened, but a busy silo host (silo-sim's, say) can get to it only after the
        sampled silos have reported."""
        t = self.rounds.task
        receiver = receiving and t is not None and t.broadcast is not None and silo_id not in t.sampled
        if t is None or t.task_id != task_id or not (t.open or (receiver and not t.broadcast.closed)):
            raise self.registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                       f"task {task_id} is not the current open task (round over or replaced)")
        if silo_id not in t.sampled and not receiver:
            raise self.registry.refuse(silo_id, "PERMISSION_DENIED", "not_sampled",
                                       f"silo {silo_id} was not sampled for round {t.round}")
        return t

    # ------------------------------------------------------------------ Download
    def download(self, silo_id: str, run_id: str, task_id: str) -> bytes:
        self.registry.validate(silo_id, lambda: (validation.check_id("run_id", run_id),
                                                 validation.check_id("task_id", task_id)))
        with self.cond:
            self.check_run(silo_id, run_id)
            self.registry.touch(silo_id)
            t = self._task_of(silo_id, task_id, receiving=True)
            if silo_id in t.sampled:
                t.downloaded.add(silo_id)
                t.bytes_down += len(t.bundle)
            else:  # a silo the round's model is broadcast to (task_for answered RECEIVE)
                t.broadcast.received.add(silo_id)
                t.broadcast.bytes_down += len(t.bundle)
            self.registry.count("sent_bytes", len(t.bundle))
            return t.bundle

    # ------------------------------------------------------------------ Upload
    def upload(self, silo_id: str, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        """Validate a whole result before it touches the round's sums; any fault refuses it and changes nothing."""
        if header.get("secagg_stage"):
            return self._secagg_upload(silo_id, header, chunks)
        registry, wire = self.registry, self.wire
        h = registry.validate(silo_id, lambda: validation.check_upload_header(header))
        with self.cond:
            self.check_run(silo_id, h.run_id)
            record = registry.touch(silo_id)
            t = self._task_of(silo_id, h.task_id)
            if h.round != t.round:
                raise registry.refuse(silo_id, "FAILED_PRECONDITION", "wrong_round",
                                      f"upload names round {h.round}, current round is {t.round}")
            if silo_id in t.reported:
                raise registry.refuse(silo_id, "ALREADY_EXISTS", "duplicate", f"silo {silo_id} already reported "
                                      f"round {t.round}")

            # A silo's weight counts its images: never more than it declared when it first joined, and never more
            # than the round's share cap (its weight is scaled down to that).
            max_weight = float(max(1, record.declared_images or 0))
            share_cap = t.weight_caps.get(silo_id, max_weight)
        metrics, skipped, total = h.metrics, h.skipped, h.total_bytes

        def still_open() -> bool:
            return t.open and self.rounds.task is t

        def read() -> dict[str, torch.Tensor]:
            payload = validation.read_stream(total, h.sha256, chunks, wire.max_upload_bytes, still_open=still_open)
            if skipped:
                return {}
            tensors = validation.decode_tensors(payload)
            validation.check_update(tensors, t.accepted or t.expected, wire.max_update_norm, max_weight,
                                    t.plan.groups, unit_weight=t.plan.unit_weight)
            if not t.plan.unit_weight:
                factor = validation.cap_weight(tensors, share_cap, validation.weight_prefixes(tensors))
                if factor < 1.0:
                    registry.count("weight_capped")
                    log.warning("round %d: silo %s's weight scaled by %.3g to the round's cap of %g (%g x the median "
                                "declared images, security.max_weight_factor)", t.round, silo_id, factor, share_cap,
                                self.rounds.settings.max_weight_factor)
            if t.privacy is not None:
                HubPrivacy.check_clear_upload(t.privacy, tensors)
            return tensors

        # The announced size is checked before any room is reserved for it: a silo cannot hold more of the budget
        # than the round's tensors take.
        registry.validate(silo_id, lambda: validation.check_upload_size(total, wire.max_upload_bytes,
                                                                         t.accepted or t.expected))
        with self.upload_budget.hold(total, still_open):
            tensors = registry.validate(silo_id, read)
            # A robust rule (aggregation.rule) needs each update: it goes to its own file, outside the hub's RAM.
            stored = None
            if t.updates is not None and tensors:
                try:
                    stored = t.updates.write(tensors)
                except OSError:
                    if still_open():
                        raise
                    raise registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                          "the round closed during the upload") from None
            try:
                self._add_upload(silo_id, t, tensors, metrics, skipped, total, stored)
            except BaseException:
                if stored is not None:
                    t.updates.discard(stored)
                raise
        log.info("round %d: %s from %s (%d/%d reported)", t.round, "skip" if skipped else "update", silo_id,
                 len(t.reported), len(t.sampled))

    def _add_upload(self, silo_id: str, t: ActiveTask, tensors: dict[str, torch.Tensor], metrics: dict[str, float],
                    skipped: bool, total: int, stored: Path | None = None) -> None:
        with self.cond:
            if self.rounds.task is not t or not t.open:
                raise self.registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                           "the round closed during the upload")
            if silo_id in t.reported:
                raise self.registry.refuse(silo_id, "ALREADY_EXISTS", "duplicate", "duplicate upload")
            if silo_id in t.gone:  # counted out while it streamed (its certificate revoked, say): not in the sums
                raise self.registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                           "this silo was counted out of the round during the upload")
            self.rounds.accept_result(silo_id, t, tensors, metrics, skipped, total, stored)

    def _secagg_upload(self, silo_id: str, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        """A secure-aggregation stage message (silo_server/rounds/privacy.py checks it against the session). A message the
        session cannot use counts its sender out of the session at once, so the stage need not wait for it."""
        registry, rounds = self.registry, self.rounds
        stage = header["secagg_stage"]
        if stage not in STAGE_UPLOADS:
            raise registry.refuse(silo_id, "INVALID_ARGUMENT", "bad_secagg",
                                  f"unknown secure-aggregation stage {stage!r}; one of {', '.join(STAGE_UPLOADS)}")
        with self.cond:
            self.check_run(silo_id, header.get("run_id", ""))
            registry.touch(silo_id)
            t = rounds.task
            if t is None or t.task_id != header.get("task_id", "") or t.privacy is None:
                raise registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                      f"task {header.get('task_id')} is not the current secure-aggregation round")
            if silo_id not in t.sampled:
                raise registry.refuse(silo_id, "PERMISSION_DENIED", "not_sampled",
                                      f"silo {silo_id} was not sampled for round {t.round}")
            if stage == "advertise_keys" and not t.open:
                raise registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task", "the training phase is over")
        h = registry.validate(silo_id, lambda: validation.check_upload_header(header))  # a negative size, say
        total = h.total_bytes
        # Checked before any room in the upload budget is held: a silo cannot hold more of it than its stage takes,
        # nor send more than wire.max_upload_bytes.
        limit = min(self.wire.max_upload_bytes, HubPrivacy.stage_bytes(t.privacy, stage))
        if total > limit:
            raise registry.refuse(silo_id, "RESOURCE_EXHAUSTED", "oversized",
                                  f"a {stage} message of {total} bytes exceeds the {limit} this round's session allows")
        # Under the budget like any upload: a hundred masked inputs arriving together wait for room in turn.
        def still_open() -> bool:
            return rounds.task is t

        with self.upload_budget.hold(total, still_open):
            # As a clear upload's stream: empty chunks, gaps and overlaps refused, and the round's close ends it (a
            # stream kept open past its round held its room in the budget, an Upload slot and a worker thread).
            try:
                payload = validation.read_stream(total, h.sha256, chunks, limit, still_open=still_open)
            except validation.Invalid as err:
                # A message the session cannot use makes its sender a dropout; a stream that stalled (the silo may
                # send it again) or outlived its round does not.
                if err.reason not in ("stream_idle", "stale_task"):
                    with self.cond:
                        if rounds.task is t:
                            rounds.leave_round(silo_id)
                            self.cond.notify_all()
                raise registry.refuse(silo_id, err.code, err.reason, err.message) from None
            with self.cond:
                if rounds.task is not t:
                    raise registry.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                          "the round closed during the upload")
                try:
                    rounds.accept_stage(silo_id, t, stage, payload, total)
                except ProtocolError as err:
                    duplicate = isinstance(err, DuplicateMessage)
                    if not duplicate:  # the first message of a stage stands; a late or broken one is a dropout
                        rounds.leave_round(silo_id)
                        self.cond.notify_all()
                    # Only a message the session cannot use is bad_secagg (alerted on as malformed): a repeat is a
                    # duplicate and a late answer (a stage deadline missed) stale, as for clear uploads.
                    code, reason = (("ALREADY_EXISTS", "duplicate") if duplicate else
                                    ("FAILED_PRECONDITION", "stale_task") if isinstance(err, StageNotOpen) else
                                    ("INVALID_ARGUMENT", "bad_secagg"))
                    raise registry.refuse(silo_id, code, reason, str(err)) from None
        log.info("round %d: secure aggregation %s from %s", t.round, stage, silo_id)
