"""The one door out of the branch: every message this silo sends to the hub passes here.

Each message is checked against the branch's policy (its size; clear metrics kept in when the policy says so) and
appended to the silo's hash-chained audit (security/audit.py) BEFORE it goes on the wire: time, the hub's
certificate serial and fingerprint, run, round, task, message kind, tensor names, shapes and dtypes, byte count,
sha256 of the payload, the pinned terms' hash and the epsilon after the round. A message with no record was not
sent by this code; `silo-audit verify` checks the chain and that it agrees with the silo's ledger.

No image path, file name, DICOM header value or pixel enters the audit: only what the message itself carries.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from security.audit import AuditLog
from silo.v1 import silo_pb2
from silo_client.hub_link import upload_refused
from silo_client.ledger import EPSILON_KEYS, RELEASE, RunEpsilon
from silo_client.policy import BranchPolicy, Refusal, check_upload
from silo_core.tensors import CHUNK_BYTES, DTYPES, TensorSpec, check_tensors, encode, iter_chunks, sha256_hex

# Writes a release's ledger entry (or gives the figures of one already written) and returns its epsilon figures for
# the audit record: called only once the message passed the policy, so a message the silo refuses costs nothing.
Charge = Callable[[], dict | None]

log = logging.getLogger("silo_client")

UPLOAD_TIMEOUT_S = 600.0  # an upload call's own limit, kept when the hub says nothing longer
# The longest a hub can make an upload call wait (a task's upload_within_s): its rounds.deadline_s is at most a day;
# past that a hub's word is not taken, so a hostile one cannot hold a branch's call open for ever.
MAX_UPLOAD_WAIT_S = 86_400.0 + 60.0
UPLOAD_MARGIN_S = 30.0  # past the hub's own close: its refusal, not our timeout, should end a late upload


class PolicyStop(Exception):
    """Something this silo was about to send is outside its policy: nothing was sent; the silo leaves the run."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass(frozen=True)
class SentUpload:
    """A result sent in the clear: what went, and the ledger's figures it went with."""

    task_id: str
    tensors: dict[str, torch.Tensor]
    metrics: dict[str, float]
    skipped: bool
    epsilon: dict | None


def epsilon_fields(figures: RunEpsilon | None, lifetime: float | None,
                   release: int = 1) -> dict[str, float | int | None] | None:
    """What the audit records with every message derived from one charged update: the ledger's figures after it
    (EPSILON_KEYS) and which of its task's releases it was (RELEASE), so that silo-audit pairs each with its entry."""
    if figures is None:
        return None
    values = (figures.client, figures.sample, figures.image, lifetime)
    return {**dict(zip(EPSILON_KEYS, values, strict=True)), RELEASE: release}


def update_to_send(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec],
                   groups: Mapping[str, list[str]] | None, in_clear: bool) -> dict[str, torch.Tensor]:
    """A local result as it may leave, checked as the hub will check it (names, shapes, dtypes, finite values):
    in the clear each tensor in the dtype the hub declared, float16 for large ones under wire.half_precision;
    otherwise (secure aggregation, client-level DP) as float32, which silo_client/privacy.py clips, noises or masks.
    Raises CodecError: a float16 overflow of an update weighted by its image count, or our own bug."""
    if in_clear:
        sent = {k: (v.to(DTYPES[expected[k].dtype]) if k in expected and v.is_floating_point() else v)
                for k, v in tensors.items()}
        specs = dict(expected)
    else:
        sent = dict(tensors)
        specs = {k: TensorSpec(s.shape, "float32") if s.dtype == "float16" else s for k, s in expected.items()}
    check_tensors(sent, specs, groups)
    return sent


def metrics_allowed(metrics: Mapping[str, float], asked: list[str]) -> dict[str, float]:
    """The clear metrics among `metrics` whose names the terms ask for (names or fnmatch patterns)."""
    return {k: v for k, v in metrics.items() if any(fnmatch.fnmatchcase(k, p) for p in asked)}


class Outbox:
    """`stub` is the hub's Federation stub; `hub_identity()` the hub certificate's {"serial", "fingerprint"} as the
    silo's own handshake saw it (empty strings in --insecure-dev-only). Call `pin(run_id, terms_sha256)` when the
    terms of a run are checked; every later record carries them."""

    def __init__(self, stub: Any, audit: AuditLog, policy: BranchPolicy | None, hub_identity: Callable[[], dict]):
        self.stub = stub
        self.audit = audit
        self.policy = policy
        self.hub_identity = hub_identity
        self.run_id = ""
        self.terms_sha256 = ""
        self.chunk_bytes = CHUNK_BYTES
        # The last result sent in the clear, so that the same task asked again gets the same bytes (training again
        # would release a second, differently noised update), and the tasks whose upload the hub received and
        # refused, which are not sent again.
        self.last_upload: SentUpload | None = None
        self.refused_tasks: set[str] = set()
        # The last task polled and when (time.monotonic) the hub stops taking its upload, by its upload_within_s.
        self.upload_open: tuple[str, float] = ("", 0.0)

    def pin(self, run_id: str, terms_sha256: str, chunk_bytes: int = 0) -> None:
        self.run_id, self.terms_sha256 = run_id, terms_sha256
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES

    def _record(self, kind: str, **fields: Any) -> None:
        self.audit.append(kind, hub=self.hub_identity(), run=fields.pop("run", self.run_id) or None,
                          terms_sha256=self.terms_sha256 or None, **fields)

    # ------------------------------------------------------------------ calls without data
    def join(self, request: silo_pb2.JoinRequest, timeout: float) -> silo_pb2.JoinReply:
        if self.policy is not None and not self.policy.clear_metrics:
            # The device and the count of unreadable files are clear facts about the branch that no aggregation
            # needs; the image counts stay, as the hub bounds a silo's weight by them.
            request.device, request.skipped_images = "", 0
        self._record("join", bytes=request.ByteSize(), preparing=request.preparing,
                     num_unlabeled=request.num_unlabeled, num_labeled=request.num_labeled,
                     protocol_version=request.protocol_version)
        return self.stub.Join(request, timeout=timeout)

    def poll(self, request: silo_pb2.NextTaskRequest, timeout: float) -> silo_pb2.Task:
        self._record("poll", bytes=request.ByteSize(), round=request.last_round_done)
        task = self.stub.NextTask(request, timeout=timeout)
        within = task.upload_within_s
        if task.task_id:  # the latest word on this task: a SECAGG stage's time left replaces its TRAIN's
            told = math.isfinite(within) and within > 0
            self.upload_open = (task.task_id, time.monotonic() + min(within, MAX_UPLOAD_WAIT_S)) if told else ("", 0.0)
        return task

    def upload_timeout(self, task_id: str) -> float:
        """The upload call's limit: UPLOAD_TIMEOUT_S, or until shortly after the hub stops taking this task's
        upload when that is later (a silo waiting in the hub's upload queue keeps its place), at most
        MAX_UPLOAD_WAIT_S."""
        polled, until = self.upload_open
        if polled != task_id:
            return UPLOAD_TIMEOUT_S
        return max(UPLOAD_TIMEOUT_S, min(until - time.monotonic() + UPLOAD_MARGIN_S, MAX_UPLOAD_WAIT_S))

    def download(self, request: silo_pb2.DownloadRequest, round_number: int, timeout: float) -> Iterator[Any]:
        self._record("download_request", bytes=request.ByteSize(), round=round_number, task=request.task_id)
        return self.stub.Download(request, timeout=timeout)

    def leave(self, refusal: Refusal) -> None:
        """Tell the hub why this silo leaves (typed), after recording it. A hub too old to know Leave, or one that
        cannot be reached, is not waited for: the refusal stands either way."""
        message = refusal.to_proto()
        self._record("leave", bytes=message.ByteSize(), round=refusal.round, departure=refusal.kind,
                     clause=refusal.clause, required=refusal.required, offered=refusal.offered,
                     message=refusal.message)
        try:
            self.stub.Leave(silo_pb2.LeaveRequest(run_id=self.run_id, refusal=message), timeout=30)
        except Exception as err:  # grpc.RpcError, or a stub without Leave: the silo leaves regardless
            log.warning("could not tell the hub why this silo leaves (%s); it leaves regardless", err)

    # ------------------------------------------------------------------ calls with data
    def upload(self, task: silo_pb2.Task, tensors: Mapping[str, torch.Tensor], metrics: Mapping[str, float],
               skipped: bool, charge: Charge | None) -> int:
        """A result in the clear (a skip, or tensors). PolicyStop when the policy forbids it: nothing is sent and
        nothing charged (`charge` writes the ledger's entry only once the policy allows the upload)."""
        if self.policy is not None and not self.policy.clear_metrics:
            metrics = {}
        payload = encode(dict(tensors)) if tensors else b""
        header = silo_pb2.UploadHeader(run_id=self.run_id, task_id=task.task_id, round=task.round,
                                       total_bytes=len(payload), sha256=sha256_hex(payload), skipped=skipped,
                                       metrics=dict(metrics))
        self._check_size(len(payload) + header.ByteSize(), task.round)  # what the audit records as sent
        epsilon = charge() if charge is not None else None
        self._record("upload", round=task.round, task=task.task_id, bytes=len(payload) + header.ByteSize(),
                     sha256=header.sha256, skipped=skipped, metrics=sorted(metrics),
                     tensors=[[n, list(t.shape), str(t.dtype).removeprefix("torch.")]
                              for n, t in sorted(tensors.items())], epsilon=epsilon)
        self.last_upload = SentUpload(task.task_id, dict(tensors), dict(metrics), skipped, epsilon)
        try:
            self._stream(header, payload, self.upload_timeout(task.task_id))
        except grpc.RpcError as err:
            if upload_refused(err):  # the same bytes would be refused again: the task is waited out instead
                self.refused_tasks.add(task.task_id)
                self.last_upload = None
            raise
        return len(payload)

    def stage(self, task_id: str, round_number: int, stage: str, payload: bytes, charge: Charge | None,
              tensors: list | None = None) -> None:
        """A secure-aggregation stage message (keys, encrypted shares, the masked input, a signature, revealed
        shares, or an abort with its reason)."""
        header = silo_pb2.UploadHeader(run_id=self.run_id, task_id=task_id, round=round_number,
                                       total_bytes=len(payload), sha256=sha256_hex(payload), secagg_stage=stage)
        self._check_size(len(payload) + header.ByteSize(), round_number)
        epsilon = charge() if charge is not None else None
        self._record(f"secagg:{stage}", round=round_number, task=task_id, bytes=len(payload) + header.ByteSize(),
                     sha256=header.sha256, tensors=tensors, epsilon=epsilon)
        try:
            self._stream(header, payload, self.upload_timeout(task_id))
        except grpc.RpcError as err:
            if upload_refused(err):  # refused, not lost: sending it again would be refused again
                self.refused_tasks.add(task_id)
            raise

    def _check_size(self, size: int, round_number: int) -> None:
        refusal = check_upload(self.policy, size, round_number)
        if refusal is not None:
            raise PolicyStop(refusal)

    def _stream(self, header: silo_pb2.UploadHeader, payload: bytes, timeout: float) -> None:
        def messages() -> Iterator[silo_pb2.UploadMessage]:
            yield silo_pb2.UploadMessage(header=header)
            for offset, data in iter_chunks(payload, self.chunk_bytes):
                yield silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=offset, data=data))

        self.stub.Upload(messages(), timeout=timeout)
