"""The hub: round loop, silo registry, task hand-out, upload validation and streaming aggregation.

Plain Python, no gRPC: the servicer (silo_server/servicer.py) is a thin shell that passes the caller's verified
certificate identity and the message in, and maps a Refusal to a gRPC status. Tests drive this class directly.
Every field a silo sends goes through security.validation before it is used.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import math
import resource
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from security import validation
from security.secagg import ProtocolError
from security.secagg.messages import DuplicateMessage
from silo_core.algorithms.base import HubAlgorithm, HubState, RoundPlan
from silo_core.files import write_json_atomic
from silo_core.rounds import RoundRecord, Sampling, Scores, records_from_json
from silo_core.tensors import ChunkAssembler, CodecError, TensorSpec, TooLarge, encode, sha256_hex
from silo_server.aggregate import RunningSum, UploadBudget
from silo_server.checkpoint import load_latest, save_checkpoint
from silo_server.privacy import STAGE_UPLOADS, BudgetExhausted, HubPrivacy, PrivateSums, RoundFailed

log = logging.getLogger("silo_server")

PHASES = ("starting", "waiting_for_silos", "training", "aggregating", "done", "failed")
CERT_WARN_DAYS = 14.0  # certificates closer to expiry than this are logged as warnings


class Refusal(Exception):
    """A request the hub will not act on. `code` is a gRPC status name; `reason` a low-cardinality label."""

    def __init__(self, code: str, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class ChangeCondition(threading.Condition):
    """The hub's lock and condition variable. notify_all also calls `listeners` (under the lock: they must only
    schedule work), so the gRPC servicer's long-polls learn of a change without a thread waiting for each silo."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.listeners: list[Callable[[], None]] = []

    def notify_all(self) -> None:
        super().notify_all()
        for listener in self.listeners:
            listener()


@dataclass
class SiloRecord:
    silo_id: str
    num_unlabeled: int = 0
    num_labeled: int = 0
    device: str = ""
    skipped_images: int = 0
    joined_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    rounds_contributed: int = 0
    ready: bool = True  # False while the silo loads its images (JoinRequest.preparing): not sampled yet
    # The images the silo declared when it first joined ready: fixed for the run, it bounds the silo's weight (a
    # re-join may lower it, never raise it).
    declared_images: int | None = None
    serial: int | None = None  # the certificate serial of the silo's live session (None: --insecure-dev-only)
    polling: int = 0  # NextTask calls held open right now: a silo waiting in a long-poll is live
    # Left a round without reporting (dropped out, aborted, was refused): not sampled again until it polls again.
    dropped: bool = False
    told_done: bool = False  # has heard that the run is over


@dataclass
class ActiveTask:
    round: int
    attempt: int
    task_id: str
    plan: RoundPlan
    bundle: bytes
    bundle_sha256: str
    hyperparameters_json: str
    sampled: set[str]
    deadline: float
    expected: dict[str, TensorSpec]  # what uploads must hold, in wire dtypes
    started: float = field(default_factory=time.time)
    reported: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)
    downloaded: set[str] = field(default_factory=set)
    sums: RunningSum = field(default_factory=RunningSum)
    bytes_up: int = 0
    bytes_down: int = 0
    open: bool = True
    privacy: Any = None  # RoundPrivacy when privacy is on (silo_server/privacy.py)
    accepted: dict[str, TensorSpec] | None = None  # what uploads must hold, when it differs from plan.expected
    weight_caps: dict[str, float] = field(default_factory=dict)  # the most weight each sampled silo may carry
    gone: set[str] = field(default_factory=set)  # sampled silos known to have left the round (revoked, aborted)
    rss_at_open: int | None = None  # hub RSS when the task opened, and its peak until the task closed (Linux)
    rss_peak_collecting: int | None = None


class RssMeter:
    """The hub's resident memory and peak, with the kernel's peak counter restarted at each round's opening so
    that the collection phase is measured on its own (Linux /proc; elsewhere every reading is None)."""

    def __init__(self) -> None:
        self._earlier_peak = 0  # the process peak from before the latest restart

    @staticmethod
    def _status(field_name: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field_name + ":"):
                        return int(line.split()[1]) * 1024  # kB
        except OSError:
            return None
        return None

    def peak(self) -> int | None:
        return self._status("VmHWM")

    def restart(self) -> int | None:
        """Remember the peak so far, restart the kernel's peak at the current RSS and return that RSS."""
        self._earlier_peak = max(self._earlier_peak, self.peak() or 0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
        except OSError:
            return None
        return self._status("VmRSS")

    def process_peak(self) -> int:
        usage_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return max(self._earlier_peak, self.peak() or 0, usage_peak)


@dataclass
class TaskView:
    """What NextTask answers, transport-neutral."""

    kind: str  # "WAIT" | "TRAIN" | "SECAGG" | "DONE"
    round: int = 0
    task_id: str = ""
    bundle_bytes: int = 0
    bundle_sha256: str = ""
    hyperparameters_json: str = "{}"
    class_thresholds: list[float] = field(default_factory=list)
    expected: dict[str, TensorSpec] = field(default_factory=dict)
    retry_after_s: float = 1.0
    message: str = ""
    privacy_json: str = ""  # TRAIN: DP instructions and the secure-aggregation session, as JSON
    secagg_stage: str = ""  # SECAGG: the stage to run (share_keys, masked_input, unmask) and its input
    secagg_payload: bytes = b""


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
    ):
        self.algorithm = algorithm
        self.state_dir = Path(state_dir)
        self.total_rounds = total_rounds
        # Each of sampling and quorum is a fraction, or a count when the count is given (never a value read as
        # either: rounds.silos_per_round_count and rounds.quorum_silos in hub.yaml).
        self.sampling = Sampling(silos_per_round, silos_per_round_count, seed)
        self.min_silos = min_silos
        self.quorum = quorum
        self.quorum_silos = quorum_silos
        self.deadline_s = deadline_s
        self.max_attempts = max_attempts
        self.liveness_s = liveness_s
        self.max_upload_bytes = max_upload_bytes
        self.upload_budget = UploadBudget(max_inflight_upload_bytes)
        self.rss_meter = RssMeter()
        self.max_update_norm = max_update_norm
        self.half_precision = half_precision
        self.evaluate = evaluate
        self.validate_model = validate  # the hub's validation split: validation_* per round, model selection
        self.on_round = on_round
        self.seed = seed
        self.privacy = privacy if privacy is not None and privacy.enabled else None
        # Added to every plan's hyperparameters (privacy.sample_dp: the silos' DP-SGD settings).
        self.round_hyperparameters = dict(round_hyperparameters or {})
        self.stopped_reason = ""
        self.failed_attempts = 0  # attempts of the current round that failed in a row
        self.declared_before: dict[str, int] = {}  # images each silo declared, from the checkpoint
        # Given a certificate serial, whether the CRL lists it now (HubApp sets it from the gate's CRL).
        self.is_revoked: Callable[[int], bool] | None = None
        # Weighted runs: no silo carries more than this many times the median images declared by the round's
        # sampled silos (security.max_weight_factor).
        self.max_weight_factor = 4.0

        self.cond = ChangeCondition()
        self.silos: dict[str, SiloRecord] = {}
        self.task: ActiveTask | None = None
        self.phase = "starting"
        self.round = 0
        self.history: list[RoundRecord] = []
        self.initial = Scores()  # the initial model's scores, before round 1
        self.refusals: dict[str, int] = {}
        # Expiry of the hub's own certificate ("hub") and of each silo's (by silo id), as seen on the wire.
        self.cert_not_after: dict[str, dt.datetime] = {}
        # Monotonic event counts since this process started, read by silo_server/metrics.py at scrape time.
        self.counters: dict[str, int] = {}
        self.stop_event = threading.Event()
        self.state: HubState | None = None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.run_id = self._load_or_make_run_id()
        self.run_description = {**run_description, "run_id": self.run_id, "total_rounds": total_rounds}

    # ------------------------------------------------------------------ identity of the run
    def _load_or_make_run_id(self) -> str:
        path = self.state_dir / "run.json"
        if path.is_file():
            return json.loads(path.read_text())["run_id"]
        run_id = uuid.uuid4().hex
        write_json_atomic(path, {"run_id": run_id, "created": time.time()})
        return run_id

    # ------------------------------------------------------------------ calls from silos
    def refuse(self, silo_id: str | None, code: str, reason: str, message: str) -> Refusal:
        # Messages may quote what a silo sent: escaped and cut, so no peer can write a line of its own into the log
        # or into the status it gets back.
        message = validation.printable(message, 300)
        with self.cond:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
        log.warning("refused %s from %s: %s", reason, validation.printable(silo_id or "?", 140), message)
        return Refusal(code, reason, message)

    def count_refusal(self, reason: str) -> None:
        """Count a refusal whose logging the caller does itself (e.g. once per burst, not once per call)."""
        with self.cond:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def _count(self, name: str, n: int = 1) -> None:
        with self.cond:
            self.counters[name] = self.counters.get(name, 0) + n

    def _touch(self, silo_id: str) -> SiloRecord:
        record = self.silos.get(silo_id)
        if record is None:
            raise self.refuse(silo_id, "FAILED_PRECONDITION", "not_joined", "silo has not joined this run; call Join")
        record.last_seen = time.time()
        return record

    @property
    def cert_days_left(self) -> dict[str, float]:
        """Days until each known certificate expires: "hub" for the hub's own, silo ids for the silos'."""
        now = dt.datetime.now(dt.UTC)
        return {name: (t - now).total_seconds() / 86400.0 for name, t in list(self.cert_not_after.items())}

    def evict(self, silo_id: str) -> None:
        """A silo whose certificate was revoked: never sampled again (its record stays for the model card), and it
        leaves the current round at once, so the round goes on with the rest instead of waiting out its deadline."""
        with self.cond:
            record = self.silos.get(silo_id)
            if record is not None:
                if record.last_seen:
                    log.warning("silo %s is revoked: it leaves the run%s", silo_id,
                                " and its round" if self.task and silo_id in self.task.sampled else "")
                record.last_seen = 0.0
                record.serial = None
            self._leave_round(silo_id)
            self.cond.notify_all()

    def _leave_round(self, silo_id: str) -> None:
        """Count a sampled silo out of the current round (call under the lock)."""
        t = self.task
        if t is None or silo_id not in t.sampled or silo_id in t.gone:
            return
        if t.privacy is None and silo_id in t.reported:
            return  # its result is in the sums already (under secure aggregation a report is only its keys)
        t.gone.add(silo_id)
        if t.privacy is not None:
            HubPrivacy.drop(t.privacy, silo_id)

    def check_revocations(self) -> None:
        """Evict every silo of the current round whose certificate the CRL now lists (a silo busy training makes
        no call the gate could refuse, so the round loop asks)."""
        if self.is_revoked is None or self.task is None:
            return
        for silo_id in sorted(self.task.sampled - self.task.gone):
            record = self.silos.get(silo_id)
            if record is not None and record.serial is not None and self.is_revoked(record.serial):
                self.evict(silo_id)

    def check_session(self, silo_id: str, serial: int | None) -> None:
        """One live session per identity: a call made with another certificate for the same name than the one the
        silo's session joined with is refused (see join)."""
        record = self.silos.get(silo_id)
        if serial is None or record is None or record.serial is None or record.serial == serial:
            return
        raise self.refuse(silo_id, "PERMISSION_DENIED", "second_certificate",
                          f"silo {silo_id} has a live session under another certificate (serial {record.serial:x}); "
                          f"one session per silo")

    def validate(self, silo_id: str | None, check: Callable[[], Any]) -> Any:
        """Run a security.validation check; its failure becomes a counted, logged Refusal."""
        try:
            return check()
        except validation.Invalid as e:
            raise self.refuse(silo_id, e.code, e.reason, e.message) from None

    def join(self, silo_id: str, num_unlabeled: int, num_labeled: int, device: str, skipped_images: int = 0,
             preparing: bool = False, serial: int | None = None) -> dict[str, Any]:
        """Register a silo and return the run description. A silo that is still `preparing` (loading its images,
        which needs the run's image size) is known but not sampled until it joins again ready.

        The images a silo declares the first time it joins ready are fixed for the run: they bound its weight, and a
        re-join can lower them but never raise them. A second certificate for the same name (`serial`) is refused
        while the first one's session is live, so it cannot take that silo's place or records."""
        self.validate(silo_id, lambda: validation.check_join(num_unlabeled, num_labeled, device, skipped_images))
        with self.cond:
            record = self.silos.get(silo_id) or SiloRecord(silo_id)
            if serial is not None and record.serial is not None and record.serial != serial:
                if self._is_live(record):
                    log.warning("a second certificate for silo %s (serial %x) tried to join while the session of "
                                "serial %x is live: refused; if both are yours, revoke one (`silo-certs issue-silo %s "
                                "--replace` or `silo-certs revoke`)", silo_id, serial, record.serial, silo_id)
                    self._count("second_certificate")
                    raise self.refuse(silo_id, "ALREADY_EXISTS", "second_certificate",
                                      f"silo {silo_id} already has a live session under another certificate; "
                                      "one session per silo")
                log.info("silo %s now joins with certificate serial %x (was %x)", silo_id, serial, record.serial)
            declared = num_unlabeled + num_labeled
            if record.declared_images is None and silo_id in self.declared_before:
                record.declared_images = self.declared_before[silo_id]  # declared before the hub restarted
            if not preparing:
                if record.declared_images is not None and declared > record.declared_images:
                    log.warning("silo %s re-joined declaring %d images; it keeps the %d it declared first (a silo's "
                                "count is fixed for the run)", silo_id, declared, record.declared_images)
                record.declared_images = (declared if record.declared_images is None
                                          else min(declared, record.declared_images))
            record.num_unlabeled, record.num_labeled = num_unlabeled, num_labeled
            record.device, record.skipped_images = device, skipped_images
            record.serial = serial if serial is not None else record.serial
            record.last_seen = time.time()
            record.ready = not preparing
            self.silos[silo_id] = record
            self.cond.notify_all()
        if preparing:
            log.info("silo %s connected and is loading its images (%d unlabeled, %d labeled files); it is sampled "
                     "once it reports ready", silo_id, num_unlabeled, num_labeled)
            return self.run_description
        days = self.cert_days_left.get(silo_id)
        log.info("silo %s joined (%d unlabeled, %d labeled images, device %s%s)", silo_id, num_unlabeled,
                 num_labeled, device, "" if days is None else f", certificate expires in {days:.0f} days")
        if days is not None and days < CERT_WARN_DAYS:
            log.warning("the certificate of silo %s expires in %.1f days: renew it (`silo-certs renew %s`)",
                        silo_id, days, silo_id)
        return self.run_description

    def _check_run(self, silo_id: str, run_id: str) -> None:
        if run_id != self.run_id:
            raise self.refuse(silo_id, "FAILED_PRECONDITION", "wrong_run",
                              f"run {run_id or '(none)'} is not this hub's run; call Join again")

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
        """A silo begins a long-poll: it is live while it waits, and a silo that dropped out of a round may be
        sampled again now that it asks for work."""
        self.validate(silo_id, lambda: validation.check_id("run_id", run_id))
        with self.cond:
            self._check_run(silo_id, run_id)
            record = self._touch(silo_id)
            record.polling += 1
            if record.dropped:
                record.dropped = False
                self.cond.notify_all()

    def poll_task(self, silo_id: str) -> TaskView:
        with self.cond:
            return self._task_for(silo_id)

    def end_poll(self, silo_id: str) -> None:
        with self.cond:
            record = self.silos.get(silo_id)
            if record is not None:
                record.polling = max(0, record.polling - 1)
                if record.last_seen:  # a revoked silo stays unheard of
                    record.last_seen = time.time()

    def _task_for(self, silo_id: str) -> TaskView:
        if self.phase in ("done", "failed"):
            record = self.silos.get(silo_id)
            if record is not None:
                record.told_done = True
            return TaskView("DONE", message=f"run {self.phase}")
        t = self.task
        if t and t.open and silo_id in t.sampled and silo_id not in t.reported:
            return TaskView(
                "TRAIN", round=t.round, task_id=t.task_id, bundle_bytes=len(t.bundle), bundle_sha256=t.bundle_sha256,
                hyperparameters_json=t.hyperparameters_json, class_thresholds=list(t.plan.class_thresholds),
                expected=t.expected, privacy_json=t.privacy.privacy_json(t.task_id) if t.privacy else "",
            )
        if t and t.privacy is not None and silo_id in t.sampled:
            stage = HubPrivacy.view(t.privacy, silo_id)
            if stage is not None:
                return TaskView("SECAGG", round=t.round, task_id=t.task_id, secagg_stage=stage[0],
                                secagg_payload=stage[1])
        return TaskView("WAIT", retry_after_s=0.5, message=f"phase {self.phase}, round {self.round}")

    def _task_of(self, silo_id: str, task_id: str) -> ActiveTask:
        t = self.task
        if t is None or t.task_id != task_id or not t.open:
            raise self.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                              f"task {task_id} is not the current open task (round over or replaced)")
        if silo_id not in t.sampled:
            raise self.refuse(silo_id, "PERMISSION_DENIED", "not_sampled",
                              f"silo {silo_id} was not sampled for round {t.round}")
        return t

    def download(self, silo_id: str, run_id: str, task_id: str) -> bytes:
        self.validate(silo_id, lambda: (validation.check_id("run_id", run_id), validation.check_id("task_id", task_id)))
        with self.cond:
            self._check_run(silo_id, run_id)
            self._touch(silo_id)
            t = self._task_of(silo_id, task_id)
            t.downloaded.add(silo_id)
            t.bytes_down += len(t.bundle)
            self._count("sent_bytes", len(t.bundle))
            return t.bundle

    def upload(self, silo_id: str, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        """Validate a whole result before it touches the round's sums; any fault refuses it and changes nothing."""
        if header.get("secagg_stage"):
            return self._secagg_upload(silo_id, header, chunks)
        h = self.validate(silo_id, lambda: validation.check_upload_header(header))
        with self.cond:
            self._check_run(silo_id, h.run_id)
            record = self._touch(silo_id)
            t = self._task_of(silo_id, h.task_id)
            if h.round != t.round:
                raise self.refuse(silo_id, "FAILED_PRECONDITION", "wrong_round",
                                  f"upload names round {h.round}, current round is {t.round}")
            if silo_id in t.reported:
                raise self.refuse(silo_id, "ALREADY_EXISTS", "duplicate", f"silo {silo_id} already reported round "
                                  f"{t.round}")

            # A silo's weight counts its images: never more than it declared when it first joined, and never more
            # than the round's share cap (its weight is scaled down to that).
            max_weight = float(max(1, record.declared_images or 0))
            share_cap = t.weight_caps.get(silo_id, max_weight)
        metrics, skipped, total = h.metrics, h.skipped, h.total_bytes

        def still_open() -> bool:
            return t.open and self.task is t

        def read() -> dict[str, torch.Tensor]:
            payload = validation.read_stream(total, h.sha256, chunks, self.max_upload_bytes, still_open=still_open)
            if skipped:
                return {}
            tensors = validation.decode_tensors(payload)
            validation.check_update(tensors, t.accepted or t.expected, self.max_update_norm, max_weight,
                                    t.plan.groups, unit_weight=t.plan.unit_weight)
            if not t.plan.unit_weight:
                factor = validation.cap_weight(tensors, share_cap, validation.weight_prefixes(tensors))
                if factor < 1.0:
                    self._count("weight_capped")
                    log.warning("round %d: silo %s's weight scaled by %.3g to the round's cap of %g (%g x the median "
                                "declared images, security.max_weight_factor)", t.round, silo_id, factor, share_cap,
                                self.max_weight_factor)
            if t.privacy is not None:
                try:
                    HubPrivacy.check_clear_upload(t.privacy, tensors)
                except ProtocolError as err:
                    raise validation.Invalid("FAILED_PRECONDITION", "privacy", str(err)) from None
            return tensors

        # The announced size is checked before any room is reserved for it: a silo cannot hold more of the budget
        # than the round's tensors take.
        self.validate(silo_id, lambda: validation.check_upload_size(total, self.max_upload_bytes,
                                                                     t.accepted or t.expected))
        with self.upload_budget.hold(total, still_open):
            tensors = self.validate(silo_id, read)
            self._add_upload(silo_id, t, tensors, metrics, skipped, total)
        log.info("round %d: %s from %s (%d/%d reported)", t.round, "skip" if skipped else "update", silo_id,
                 len(t.reported), len(t.sampled))

    def _add_upload(self, silo_id: str, t: ActiveTask, tensors: dict[str, torch.Tensor], metrics: dict[str, float],
                    skipped: bool, total: int) -> None:
        with self.cond:
            if self.task is not t or not t.open:
                raise self.refuse(silo_id, "FAILED_PRECONDITION", "stale_task", "the round closed during the upload")
            if silo_id in t.reported:
                raise self.refuse(silo_id, "ALREADY_EXISTS", "duplicate", "duplicate upload")
            t.sums.add(tensors, metrics)
            t.reported.add(silo_id)
            if skipped:
                t.skipped.add(silo_id)
            else:
                self.silos[silo_id].rounds_contributed += 1
            t.bytes_up += total
            self._count("received_bytes", total)
            self._count("accepted_skips" if skipped else "accepted_updates")
            self.cond.notify_all()

    def _secagg_upload(self, silo_id: str, header: dict[str, Any], chunks: Iterable[tuple[int, bytes]]) -> None:
        """A secure-aggregation stage message (silo_server/privacy.py checks it against the session). A message the
        session cannot use counts its sender out of the session at once, so the stage need not wait for it."""
        stage = header["secagg_stage"]
        if stage not in STAGE_UPLOADS:
            raise self.refuse(silo_id, "INVALID_ARGUMENT", "bad_secagg",
                              f"unknown secure-aggregation stage {stage!r}; one of {', '.join(STAGE_UPLOADS)}")
        with self.cond:
            self._check_run(silo_id, header.get("run_id", ""))
            self._touch(silo_id)
            t = self.task
            if t is None or t.task_id != header.get("task_id", "") or t.privacy is None:
                raise self.refuse(silo_id, "FAILED_PRECONDITION", "stale_task",
                                  f"task {header.get('task_id')} is not the current secure-aggregation round")
            if silo_id not in t.sampled:
                raise self.refuse(silo_id, "PERMISSION_DENIED", "not_sampled",
                                  f"silo {silo_id} was not sampled for round {t.round}")
            if stage == "advertise_keys" and not t.open:
                raise self.refuse(silo_id, "FAILED_PRECONDITION", "stale_task", "the training phase is over")
        total = int(header.get("total_bytes", 0))
        # Checked before any room in the upload budget is held: a silo cannot hold more of it than its stage takes,
        # nor send more than wire.max_upload_bytes.
        limit = min(self.max_upload_bytes, HubPrivacy.stage_bytes(t.privacy, stage))
        if total > limit:
            raise self.refuse(silo_id, "RESOURCE_EXHAUSTED", "oversized",
                              f"a {stage} message of {total} bytes exceeds the {limit} this round's session allows")
        # Under the budget like any upload: a hundred masked inputs arriving together wait for room in turn.
        with self.upload_budget.hold(total, lambda: self.task is t):
            try:
                assembler = ChunkAssembler(total, limit)
                for offset, data in chunks:
                    assembler.add(offset, data)
                payload = assembler.finish(str(header.get("sha256", "")))
            except CodecError as err:
                code = "RESOURCE_EXHAUSTED" if isinstance(err, TooLarge) else "INVALID_ARGUMENT"
                with self.cond:
                    if self.task is t:
                        self._leave_round(silo_id)  # a message the session cannot use: a dropout
                        self.cond.notify_all()
                raise self.refuse(silo_id, code, "bad_payload", str(err)) from None
            with self.cond:
                if self.task is not t:
                    raise self.refuse(silo_id, "FAILED_PRECONDITION", "stale_task", "the round closed during the upload")
                try:
                    HubPrivacy.receive(t.privacy, silo_id, stage, payload)
                except ProtocolError as err:
                    duplicate = isinstance(err, DuplicateMessage)
                    if not duplicate:  # the first message of a stage stands; a broken one is a dropout
                        self._leave_round(silo_id)
                        self.cond.notify_all()
                    raise self.refuse(silo_id, "ALREADY_EXISTS" if duplicate else "INVALID_ARGUMENT", "bad_secagg",
                                      str(err)) from None
                if stage == "abort":
                    self._leave_round(silo_id)
                if stage == "advertise_keys":  # the silo's training result is ready (and stays with the silo)
                    t.reported.add(silo_id)
                    self.silos[silo_id].rounds_contributed += 1
                t.bytes_up += total
                self.cond.notify_all()
        log.info("round %d: secure aggregation %s from %s", t.round, stage, silo_id)

    # ------------------------------------------------------------------ the round loop
    def live_silos(self) -> list[str]:
        """Silos that can be sampled: heard from within liveness_s and done preparing."""
        return self._heard_from(ready=True)

    def preparing_silos(self) -> list[str]:
        """Silos heard from within liveness_s that are still loading their images."""
        return self._heard_from(ready=False)

    def _heard_from(self, ready: bool) -> list[str]:
        return sorted(s for s, r in self.silos.items() if r.ready == ready and not r.dropped and self._is_live(r))

    def _is_live(self, record: SiloRecord) -> bool:
        """Waiting in a long-poll right now, or heard from within liveness_s (a revoked silo never is)."""
        if not record.last_seen:
            return False
        return record.polling > 0 or time.time() - record.last_seen <= self.liveness_s

    def _sample_count(self, available: int) -> int:
        return self.sampling.how_many(available)

    def _quorum_count(self, sampled: int) -> int:
        # A count above the silos sampled this round (fewer were live) waits for all of them, never for more.
        if self.quorum_silos is not None:
            return min(sampled, self.quorum_silos)
        # Rounded before the ceiling: 0.55 * 100 is 55.00000000000001, which must need 55 reports, not 56.
        return max(1, math.ceil(round(self.quorum * sampled, 9)))

    def silos_not_told_done(self) -> list[str]:
        """Silos still live that have not heard the run is over (the app waits for them, up to server.linger_s)."""
        with self.cond:
            return sorted(s for s, r in self.silos.items() if not r.told_done and self._is_live(r))

    def _set_phase(self, phase: str) -> None:
        with self.cond:
            self.phase = phase
            self.cond.notify_all()

    def _wait_for_silos(self) -> list[str]:
        self._set_phase("waiting_for_silos")
        last_log = 0.0
        needed = max(self.min_silos, self._fewest_sampled())
        with self.cond:
            while not self.stop_event.is_set():
                live = self.live_silos()
                if len(live) >= needed:
                    return live
                if time.time() - last_log > 10:
                    preparing = len(self.preparing_silos())
                    dropped = sum(1 for r in self.silos.values() if r.dropped and self._is_live(r))
                    log.info("waiting for silos: %d ready%s%s, %d needed to start a round%s", len(live),
                             f" ({preparing} more loading their images)" if preparing else "",
                             f" ({dropped} more left the last round and have not asked for work since)" if dropped
                             else "", needed,
                             " (secure aggregation's dropout tolerance)" if needed > self.min_silos else "")
                    last_log = time.time()
                self.cond.wait(timeout=1.0)
        return []

    def load_state(self) -> HubState | None:
        """Load and verify the latest checkpoint into the hub (silo_server/checkpoint.py says what is checked); None
        when there is none. HubApp calls this before it opens the port, so that a bad state folder stops the hub
        before any silo is served from it; CheckpointError says which file and how to recover."""
        loaded = load_latest(self.state_dir, total_rounds=self.total_rounds, check=self.algorithm.served_model)
        if loaded is None:
            return None
        state, info = loaded
        self.declared_before = {str(k): int(v) for k, v in (info.get("declared_images") or {}).items()
                                if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
        self.history = records_from_json(info.get("history", []))
        self.initial = Scores.from_json(info.get("initial", {}))
        if self.privacy is not None:
            self.privacy.load_state_dict(info.get("privacy"))
        log.info("resumed from checkpoint after round %d", state.round)
        self.state, self.round = state, state.round
        return state

    def resume_or_init(self) -> HubState:
        state = self.state if self.state is not None else self.load_state()  # loaded already when HubApp started
        if state is None:
            log.info("no checkpoint in %s: initial hub training", self.state_dir)
            state = self.algorithm.init_state()
            self.history = []
            # What the hub's labels alone taught the model before the silos start from it; scoring it now also
            # pays the evaluation's first-call costs before round 1 rather than in it.
            self.initial = self._score(state)
            if self.initial != Scores():
                log.info("initial model (the hub's labels alone): %s",
                         json.dumps({k: _short(v) for k, v in self.initial.to_json().items()}))
            self._checkpoint(state)
        self.round = state.round
        return state

    def _checkpoint(self, state: HubState) -> None:
        history, initial = [r.to_json() for r in self.history], self.initial.to_json()
        info: dict[str, Any] = {"run_id": self.run_id, "history": history, "initial": initial,
                                # fixed for the run: a restarted hub must not let a silo declare more
                                "declared_images": self._declared_images()}
        if self.privacy is not None:
            info["privacy"] = self.privacy.state_dict()  # the accountant: a restarted hub continues the same count
        save_checkpoint(self.state_dir, state, info)
        write_json_atomic(self.state_dir / "history.json",
                          {"run_id": self.run_id, "initial": initial, "rounds": history})

    def run_round(self, state: HubState) -> HubState:
        r = state.round + 1
        plan = self.algorithm.begin_round(state)
        if not self.algorithm.needs_silos:
            started = time.time()
            state, metrics = self.algorithm.finish_round(state, {}, {})
            return self._complete_round(state, metrics, started, None)
        bundle = encode(plan.tensors, half=self.half_precision)
        for attempt in itertools.count(1):
            live = self._wait_for_silos()
            if self.stop_event.is_set():
                raise InterruptedError("hub stopping")
            # Secure aggregation needs enough silos in a round to survive its documented dropouts.
            sampled = set(self.sampling.sample(live, r, attempt, at_least=self._fewest_sampled()))
            task = ActiveTask(
                round=r, attempt=attempt, task_id=f"{self.run_id[:8]}-r{r}-a{attempt}-{uuid.uuid4().hex[:6]}",
                plan=plan, bundle=bundle, bundle_sha256=sha256_hex(bundle),
                hyperparameters_json=json.dumps({**plan.hyperparameters, **self.round_hyperparameters}),
                sampled=sampled,
                deadline=time.time() + self.deadline_s, expected=wire_specs(plan.expected, self.half_precision),
            )
            with self.cond:
                task.weight_caps = validation.weight_cap(
                    {s: self.silos[s].declared_images or 1 for s in sampled}, self.max_weight_factor)
            need = self._quorum_count(len(sampled))
            if self.privacy is not None:  # raises BudgetExhausted before anything is handed out
                task.privacy = self.privacy.begin(task.task_id, plan.expected, sampled, len(self.silos), need)
                task.accepted = task.privacy.accepted
            log.info("round %d attempt %d: sampled %d of %d silos, quorum %d", r, attempt, len(sampled), len(live), need)
            task.rss_at_open = self.rss_meter.restart()
            with self.cond:
                self.task, self.round, self.phase = task, r, "training"
                self.cond.notify_all()
                # Until every sampled silo reported or is known gone (revoked, aborted), or the deadline.
                while not sampled <= task.reported | task.gone and time.time() < task.deadline:
                    if self.stop_event.is_set():
                        raise InterruptedError("hub stopping")
                    self.cond.wait(timeout=0.5)
                    self.check_revocations()
                task.open = False
                self.phase = "aggregating"
            task.rss_peak_collecting = self.rss_meter.peak()
            private = None
            try:
                if self.privacy is not None:
                    private = self.privacy.complete(self, task, need)  # unmasked, noised and charged
                    aggregation_started = time.time()
                    state, metrics = self.algorithm.finish_round(state, private.sums, private.metrics)
                else:
                    if len(task.reported) < need:
                        raise RoundFailed(f"{len(task.reported)} of {len(sampled)} sampled silos reported, below "
                                          f"quorum {need}")
                    aggregation_started = time.time()
                    state, metrics = self.algorithm.finish_round(state, task.sums.result(), task.sums.metrics)
                aggregation_seconds = time.time() - aggregation_started
            except RoundFailed as failed:
                self._round_failed(task, str(failed))
                continue
            self._mark_dropped(task)
            return self._complete_round(state, metrics, task.started, task, aggregation_seconds, private)
        raise AssertionError("unreachable")

    def _declared_images(self) -> dict[str, int]:
        with self.cond:
            declared = dict(self.declared_before)
            declared.update({s: r.declared_images for s, r in self.silos.items() if r.declared_images is not None})
            return declared

    def _fewest_sampled(self) -> int:
        return self.privacy.fewest_sampled() if self.privacy is not None else 1

    def _mark_dropped(self, task: ActiveTask) -> None:
        """Sampled silos that did not report are not sampled again until they poll again."""
        with self.cond:
            left = task.sampled - (task.reported - task.gone)
            if task.privacy is not None:
                left |= HubPrivacy.dropouts(task.privacy)  # reported their keys, then fell silent
            for silo_id in left:
                record = self.silos.get(silo_id)
                if record is not None:
                    record.dropped = True

    def _round_failed(self, task: ActiveTask, reason: str) -> None:
        """Silos failing a round never stop the hub: it logs why, counts it and retries after a growing pause."""
        self._mark_dropped(task)
        with self.cond:
            self.task = None
            self.failed_attempts += 1
            failures = self.failed_attempts
        self._count("rounds_failed")
        if "below quorum" in reason:
            self._count("below_quorum")
        pause = min(60.0, 2.0 ** (failures - 1))
        log.warning("round %d attempt %d failed: %s; retrying in %.0f s", task.round, task.attempt, reason, pause)
        if failures % self.max_attempts == 0:
            log.error("round %d has failed %d times in a row (last: %s); the hub keeps retrying: check that enough "
                      "silos are connected and healthy (rounds.min_silos, rounds.quorum, the silos' logs)",
                      task.round, failures, reason)
        self.stop_event.wait(pause)

    def _complete_round(self, state: HubState, metrics: dict[str, float], started: float, task: ActiveTask | None,
                        aggregation_seconds: float | None = None, private: PrivateSums | None = None) -> HubState:
        scoring_started = time.time()
        scores = self._score(state)
        evaluation_seconds = (time.time() - scoring_started
                              if self.validate_model is not None or self.evaluate is not None else None)
        record = RoundRecord(
            round=state.round, scores=scores, round_seconds=time.time() - started,
            aggregation_seconds=aggregation_seconds, evaluation_seconds=evaluation_seconds,
            hub_peak_rss_bytes=self.rss_meter.process_peak(),
            dp=private.dp if private is not None else None, secagg=private.secagg if private is not None else None,
            algorithm=dict(metrics))
        if task is not None:
            record = self._with_silos(record, task)
        self.history.append(record)
        self.failed_attempts = 0
        self._checkpoint(state)
        with self.cond:
            self.task = None
            self.round = state.round
        log.info("round %d done: %s", state.round, json.dumps({k: _short(v) for k, v in record.to_json().items()}))
        self._log_security()
        if self.on_round is not None:
            self.on_round(record)
        return state

    @staticmethod
    def _with_silos(record: RoundRecord, task: ActiveTask) -> RoundRecord:
        """What the round's silos did: who reported, bytes, their mean training loss and time, the hub's memory."""
        reporters = len(task.reported - task.gone)  # a silo that reported, then aborted, dropped out
        sums = task.sums
        return replace(
            record, silos_sampled=len(task.sampled), silos_reported=reporters, silos_skipped=len(task.skipped),
            silos_dropped=len(task.sampled) - reporters, attempt=task.attempt, bytes_up=task.bytes_up,
            bytes_down=task.bytes_down,
            silo_train_loss=sums.metrics["train_loss"] / sums.contributors
            if reporters and "train_loss" in sums.metrics and sums.contributors else None,
            # Where a round's time goes: the silos' own computation (skipping silos report it too), against the
            # round's wall time.
            silo_train_seconds=sums.metrics["train_seconds"] / reporters
            if reporters and "train_seconds" in sums.metrics else None,
            # What the hub held beyond its steady state while silos downloaded and uploaded (target: flat in the
            # number of silos); hub_peak_rss_bytes also counts start-up, evaluation and fine-tuning.
            collecting_rss_growth_bytes=task.rss_peak_collecting - task.rss_at_open
            if task.rss_at_open is not None and task.rss_peak_collecting is not None else None)

    def _score(self, state: HubState) -> Scores:
        """The served model's scores on the validation split and the test set, where the hub has them."""
        validation = self.validate_model(state) if self.validate_model is not None else None
        test = self.evaluate(state) if self.evaluate is not None else None
        return Scores.measured(test=test, validation=validation)

    def _log_security(self) -> None:
        """Once a round: certificate expiry (hub and the soonest silo) and the refusals so far, by reason."""
        days = self.cert_days_left
        parts = [f"hub {days.pop('hub'):.1f}"] if "hub" in days else []
        if days:
            soonest = min(days, key=days.__getitem__)
            parts.append(f"{len(days)} silos, soonest {soonest} {days[soonest]:.1f}")
        if parts:
            log.info("certificate days left: %s", "; ".join(parts))
        if self.refusals:
            log.info("refusals so far: %s", json.dumps(dict(sorted(self.refusals.items()))))

    def run(self) -> HubState:
        """Resume or start, run every remaining round, and return the final state."""
        state = self.resume_or_init()
        self.state = state
        try:
            while state.round < self.total_rounds and not self.stop_event.is_set():
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
        self._set_phase("done")
        return state

    def stop(self) -> None:
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()


HALF_MIN_ELEMENTS = 1024


def wire_specs(expected: dict[str, TensorSpec], half: bool) -> dict[str, TensorSpec]:
    """With half precision, large float32 tensors (weights, deltas) travel as float16; small ones (weights, counts)
    stay float32 so that counts remain exact."""
    if not half:
        return dict(expected)
    return {name: TensorSpec(spec.shape, "float16")
            if spec.dtype == "float32" and math.prod(spec.shape) >= HALF_MIN_ELEMENTS else spec
            for name, spec in expected.items()}


def _short(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v
