"""The silo's privacy layer: DP on its own update, and its half of secure aggregation over the wire.

A TRAIN task with privacy instructions (Task.privacy_json) changes what happens to the local result:

- "dp": the update is clipped to the round's norm (and, with distributed noise, this silo's share of the Gaussian
  noise is added) before anything leaves the process (security/dp.py).
- "secagg": the result is not uploaded at all. The silo keeps it, starts a SecAgg+ session and uploads only its
  public keys (stage advertise_keys). The hub then hands out the share_keys, masked_input and unmask stages as
  SECAGG tasks; each answer goes back through Upload with UploadHeader.secagg_stage. A silo that has nothing to
  contribute still takes part with zeros, so the hub cannot tell it apart.

Under either, no clear per-silo metrics are sent (they are derived from the silo's data).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from security.dp import SiloInstructions, privatize_update
from security.secagg import SecAggError, SiloSession
from silo.v1 import silo_pb2
from silo_core.algorithms.base import SiloResult
from silo_core.tensors import CHUNK_BYTES, DTYPES, TensorSpec, iter_chunks, sha256_hex

log = logging.getLogger("silo_client")


@dataclass
class Pending:
    session: SiloSession
    tensors: dict[str, torch.Tensor]
    round: int
    answers: dict[str, bytes] = field(default_factory=dict)  # stage -> what we sent (resent if asked again)


class SiloPrivacy:
    """Transport-free: `send_result(task, tensors, metrics, skipped)` uploads a result as usual and
    `send_stage(task_id, round, stage, payload)` uploads a secure-aggregation stage message."""

    def __init__(self, send_result: Callable[..., None], send_stage: Callable[[str, int, str, bytes], None]):
        self.send_result, self.send_stage = send_result, send_stage
        self.pending: dict[str, Pending] = {}  # session (= task id) -> state

    def submit(self, silo_id: str, task: silo_pb2.Task, result: SiloResult, expected: dict[str, TensorSpec]) -> str:
        """Apply the task's privacy instructions to a local result and send what the protocol allows."""
        info = json.loads(task.privacy_json)
        secagg = "secagg" in info
        tensors = {} if result.skipped else dict(result.tensors)
        if secagg and result.skipped:  # take part with zeros: the hub learns only the sum
            tensors = {n: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for n, s in expected.items()}
        if "dp" in info and tensors:
            instructions = SiloInstructions.from_json(info["dp"])
            tensors, stats = privatize_update(tensors, instructions)
            log.info("round %d: update norm %.4g, clip %.4g%s", task.round, stats["update_norm"],
                     instructions.clip_norm, " (clipped)" if stats["clipped"] else "")
            tensors = {n: t.to(torch.float32) if t.is_floating_point() else t for n, t in tensors.items()}
        if not secagg:
            self.send_result(task, tensors, {}, result.skipped)
            return "update sent (clipped" + (", noised)" if info["dp"].get("noise_std") else ")")
        session_id = str(info["secagg"]["session"])
        self.pending = {session_id: Pending(SiloSession(session_id, silo_id), tensors, task.round)}
        payload = self.pending[session_id].session.advertise_keys()
        self.send_stage(task.task_id, task.round, "advertise_keys", payload)
        return "keys advertised for secure aggregation"

    def run_stage(self, task: silo_pb2.Task) -> None:
        """Answer one SECAGG task; a session that cannot go on says so (stage abort) and is forgotten."""
        stage, p = task.secagg_stage, self.pending.get(task.task_id)
        if p is None:
            self.send_stage(task.task_id, task.round, "abort", b"no session here (silo restarted?)")
            return
        if stage in p.answers:  # our answer was lost on the way: send the same bytes again
            self.send_stage(task.task_id, task.round, stage, p.answers[stage])
            return
        try:
            if stage == "share_keys":
                answer = p.session.share_keys(task.secagg_payload)
            elif stage == "masked_input":
                answer = p.session.masked_input(task.secagg_payload, p.tensors)
                if p.session.clipped_values:
                    log.warning("round %d: %d values outside the fixed-point range were clipped; widen "
                                "privacy.secure_aggregation.quantization at the hub", p.round, p.session.clipped_values)
                p.tensors = {}
            elif stage == "unmask":
                answer = p.session.unmask(task.secagg_payload)
            else:
                raise SecAggError(f"unknown stage {stage!r}")
        except SecAggError as err:
            log.warning("round %d: leaving secure aggregation: %s", task.round, err)
            self.pending.pop(task.task_id, None)
            self.send_stage(task.task_id, task.round, "abort", str(err).encode())
            return
        p.answers[stage] = answer
        self.send_stage(task.task_id, task.round, stage, answer)
        log.info("round %d: secure aggregation %s sent (%d bytes)", task.round, stage, len(answer))
        if stage == "unmask":
            self.pending.pop(task.task_id, None)


def upload_stage(client, task_id: str, round_number: int, stage: str, payload: bytes) -> None:
    """The gRPC way to send a stage message: Upload with UploadHeader.secagg_stage, chunked, with its sha256."""
    header = silo_pb2.UploadHeader(run_id=client.run.run_id, task_id=task_id, round=round_number,
                                   total_bytes=len(payload), sha256=sha256_hex(payload), secagg_stage=stage)

    def messages() -> Iterator[silo_pb2.UploadMessage]:
        yield silo_pb2.UploadMessage(header=header)
        for offset, data in iter_chunks(payload, int(client.run.chunk_bytes) or CHUNK_BYTES):
            yield silo_pb2.UploadMessage(chunk=silo_pb2.Chunk(offset=offset, data=data))

    client.stub.Upload(messages(), timeout=600)
