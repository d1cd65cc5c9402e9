"""A silo: dials out to the hub, joins, long-polls for tasks, trains locally, uploads summable results.

Images never leave this process: only what the algorithm's silo half returns (weighted deltas, counts) is sent.
The hub being away (down, restarting, unreachable) is normal: the silo backs off and reconnects, and joins again
when the hub no longer knows it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from security.tls import secure_channel
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_client.privacy import SiloPrivacy, upload_stage
from silo_core.algorithms import get_algorithm
from silo_core.algorithms.base import RoundPlan, SiloAlgorithm, SiloData
from silo_core.data import IMAGE_EXTENSIONS, DataError, load_unlabeled_folder
from silo_core.models import ModelSpec
from silo_core.tensors import (
    CodecError,
    TensorSpec,
    assemble,
    check_tensors,
    decode,
    encode,
    iter_chunks,
    sha256_hex,
)
from silo_core.training import resolve_device

VERSION = "0.1.0"


class SiloError(RuntimeError):
    """A problem the operator of this silo must fix; the message says what and how."""


@dataclass
class SiloSettings:
    hub: str
    certs: Path
    data: Path
    device: str = "auto"
    state_dir: Path | None = None
    connect_timeout_s: float = 300.0  # give up when the hub has been unreachable this long (0: never)
    sim_labels: Path | None = None  # simulation only: true labels, to report pseudo-label accuracy
    name: str = ""  # for log lines; identity itself comes from the certificate


def count_image_files(root: Path) -> int:
    if not root.is_dir():
        raise DataError(f"data folder {root} does not exist; pass --data with the folder of this silo's images")
    return sum(1 for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith("."))


def describe_rpc_error(err: grpc.RpcError, hub: str) -> str:
    details = (err.details() or "").replace("\n", " ")
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        if any(w in low for w in ("ssl", "certificate", "handshake", "tls")):
            return (f"TLS handshake with the hub at {hub} failed ({details[:160]}); check that --certs holds a "
                    f"bundle issued by the hub's CA and that --hub names the host on the hub certificate")
        return f"cannot reach the hub at {hub} ({details[:160]}); check --hub HOST:PORT and that silo-server runs"
    return f"{err.code().name}: {details}"


class SiloClient:
    def __init__(self, settings: SiloSettings, train_lock: threading.Lock | None = None,
                 stop_event: threading.Event | None = None):
        self.s = settings
        self.log = logging.getLogger(f"silo_client.{settings.name}" if settings.name else "silo_client")
        self.train_lock = train_lock or threading.Lock()
        self.stop_event = stop_event or threading.Event()
        self.device = resolve_device(settings.device)
        self.num_files = count_image_files(settings.data)
        if self.num_files == 0:
            raise DataError(f"data folder {settings.data} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                            f"point --data at the folder of this silo's images")
        self.channel = secure_channel(settings.hub, settings.certs, options=[
            ("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_permit_without_calls", 0),
        ])
        self.stub = silo_pb2_grpc.FederationStub(self.channel)
        self.run: silo_pb2.RunDescription | None = None
        self.silo_id = ""
        self.algorithm: SiloAlgorithm | None = None
        self.data: SiloData | None = None
        self.data_key: tuple[int, int] | None = None
        self.rounds_done: list[int] = []
        self.skipped_images = 0
        self.privacy = SiloPrivacy(send_result=self._upload,
                                   send_stage=lambda *args: upload_stage(self, *args))

    # ------------------------------------------------------------------ setup from the run description
    def _join(self) -> None:
        num_images = len(self.data.images) if self.data is not None else self.num_files
        reply = self.stub.Join(silo_pb2.JoinRequest(
            client_version=VERSION, num_unlabeled=num_images, num_labeled=0, capabilities=["semifl"],
            device=str(self.device), skipped_images=self.skipped_images,
        ), timeout=30)
        run = reply.run
        if self.run is None or run.run_id != self.run.run_id:
            self.log.info("joined run %s as %s: %s, %s, %d rounds", run.run_id[:8], reply.silo_id, run.algorithm,
                          run.model, run.total_rounds)
        self.run, self.silo_id = run, reply.silo_id
        self._prepare(run)

    def _prepare(self, run: silo_pb2.RunDescription) -> None:
        key = (run.image_size, run.in_channels)
        if self.data is None or self.data_key != key:
            images = load_unlabeled_folder(self.s.data, run.image_size, run.in_channels)
            self.skipped_images = len(images.skipped)
            for path, reason in images.skipped[:5]:
                self.log.warning("skipped unreadable image %s: %s", path, reason)
            if images.skipped:
                self.log.warning("%d of %d image files skipped as unreadable", len(images.skipped), self.num_files)
            state_dir = self.s.state_dir or (self.s.data.parent / f".silokit-state-{self.s.data.name}")
            state_dir.mkdir(parents=True, exist_ok=True)
            self.data = SiloData(images=images.images, true_labels=self._sim_labels(len(images)),
                                 state_dir=state_dir, silo_id=self.silo_id)
            self.data_key = key
            self.log.info("loaded %d images from %s (%d skipped)", len(images), self.s.data, len(images.skipped))
        self.data.silo_id = self.silo_id
        entry = get_algorithm(run.algorithm)
        if entry.silo is None:
            raise SiloError(f"algorithm {run.algorithm} runs at the hub only; silos have nothing to do")
        options = entry.options.model_validate(json.loads(run.algorithm_options_json or "{}"))
        spec = ModelSpec(
            name=run.model, num_classes=run.num_classes, in_channels=run.in_channels, image_size=run.image_size,
            mean=list(run.normalize_mean), std=list(run.normalize_std),
            options=json.loads(run.model_options_json or "{}"),
        )
        self.algorithm = entry.silo(options, spec, self.device)

    def _sim_labels(self, n: int) -> torch.Tensor | None:
        if self.s.sim_labels is None:
            return None
        labels = json.loads(Path(self.s.sim_labels).read_text())
        if len(labels) != n:
            self.log.warning("simulation labels (%d) do not match the %d images loaded; ignoring them", len(labels), n)
            return None
        return torch.tensor(labels, dtype=torch.int64)

    # ------------------------------------------------------------------ one task
    def _download(self, task: silo_pb2.Task) -> dict[str, torch.Tensor]:
        stream = self.stub.Download(silo_pb2.DownloadRequest(run_id=self.run.run_id, task_id=task.task_id),
                                    timeout=600)
        payload = assemble(((c.offset, c.data) for c in stream), task.bundle_bytes, task.bundle_sha256,
                           max_bytes=max(task.bundle_bytes, 1))
        tensors = decode(payload)
        # float16 on the wire (wire.half_precision) is widened back before training.
        return {k: (v.float() if v.dtype == torch.float16 else v) for k, v in tensors.items()}

    def _upload(self, task: silo_pb2.Task, tensors: dict[str, torch.Tensor], metrics: dict[str, float],
                skipped: bool) -> None:
        payload = encode(tensors) if tensors else b""
        header = silo_pb2.UploadHeader(
            run_id=self.run.run_id, task_id=task.task_id, round=task.round, total_bytes=len(payload),
            sha256=sha256_hex(payload), skipped=skipped, metrics=metrics,
        )

        def messages() -> Iterator[silo_pb2.UploadMessage]:
            yield silo_pb2.UploadMessage(header=header)
            for offset, data in iter_chunks(payload, int(self.run.chunk_bytes) or (1 << 20)):
                yield silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=offset, data=data))

        self.stub.Upload(messages(), timeout=600)

    def _train(self, task: silo_pb2.Task) -> None:
        expected = {s.name: TensorSpec(tuple(s.shape), s.dtype) for s in task.expected}
        tensors = self._download(task)
        plan = RoundPlan(round=task.round, tensors=tensors, hyperparameters=json.loads(task.hyperparameters_json or "{}"),
                         expected=expected, class_thresholds=list(task.class_thresholds))
        started = time.time()
        with self.train_lock:
            result = self.algorithm.local_update(plan, self.data)
        metrics = {**result.metrics, "train_seconds": time.time() - started}
        if not result.skipped:
            check_tensors(result.tensors, expected)  # our own bug must not reach the hub as garbage
        if task.privacy_json:  # DP and/or secure aggregation: silo_client/privacy.py decides what leaves
            sent = self.privacy.submit(self.silo_id, task, result, expected)
        else:
            self._upload(task, result.tensors if not result.skipped else {}, metrics, result.skipped)
            sent = "skipped (nothing passed the threshold)" if result.skipped else "update sent"
        self.rounds_done.append(task.round)
        self.log.info("round %d: %s in %.1fs (%d of %d pseudo-labeled)", task.round, sent,
                      metrics["train_seconds"], int(metrics.get("pl_selected", 0)), int(metrics.get("pl_total", 0)))

    # ------------------------------------------------------------------ the loop
    def run_forever(self) -> int:
        """Take part until the hub says the run is done. Returns 0 then; raises SiloError on fatal problems."""
        backoff, unreachable_since = 1.0, None
        joined = False
        while not self.stop_event.is_set():
            try:
                if not joined:
                    self._join()
                    joined = True
                task = self.stub.NextTask(silo_pb2.NextTaskRequest(
                    run_id=self.run.run_id, last_round_done=self.rounds_done[-1] if self.rounds_done else 0,
                ), timeout=60)
                backoff, unreachable_since = 1.0, None
                if task.kind == silo_pb2.Task.DONE:
                    self.log.info("the hub says the run is over (%s); %d rounds contributed", task.message,
                                  len(self.rounds_done))
                    return 0
                if task.kind == silo_pb2.Task.TRAIN:
                    self._train(task)
                elif task.kind == silo_pb2.Task.SECAGG:
                    self.privacy.run_stage(task)
                elif task.retry_after_s > 0:
                    self.stop_event.wait(min(task.retry_after_s, 5.0))
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    # The hub restarted, or our task went stale: re-join and carry on.
                    self.log.info("hub says: %s; joining again", err.details())
                    joined = False
                    continue
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise SiloError(f"the hub refused this silo: {err.details()}; check --certs") from None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    now = time.time()
                    unreachable_since = unreachable_since or now
                    message = describe_rpc_error(err, self.s.hub)
                    if self.s.connect_timeout_s and now - unreachable_since > self.s.connect_timeout_s:
                        raise SiloError(f"{message}; gave up after {self.s.connect_timeout_s:.0f}s") from None
                    self.log.warning("%s; retrying in %.0fs", message, backoff)
                    self.stop_event.wait(backoff * (0.75 + 0.5 * random.random()))
                    backoff = min(backoff * 2, 30.0)
                    joined = False if code == grpc.StatusCode.UNAVAILABLE else joined
                    continue
                self.log.warning("hub refused a request: %s", describe_rpc_error(err, self.s.hub))
                self.stop_event.wait(1.0)
            except CodecError as err:
                self.log.warning("bad bundle from the hub (%s); asking again", err)
                self.stop_event.wait(1.0)
        return 0

    def close(self) -> None:
        self.channel.close()
