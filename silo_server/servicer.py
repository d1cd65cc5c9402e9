"""The gRPC face of the hub: identity from the verified client certificate, messages in, Refusals out as statuses.

Every call first passes the PeerGate (security/gate.py: certificate, CRL, expiry, allowlist); every field is then
validated (security/validation.py) before the hub acts on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import grpc

from security import validation
from security.gate import AccessDenied, PeerGate
from security.tls import peer_certificate
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_core.tensors import iter_chunks
from silo_server.hub import Hub, Refusal

_KINDS = {"WAIT": silo_pb2.Task.WAIT, "TRAIN": silo_pb2.Task.TRAIN, "DONE": silo_pb2.Task.DONE,
          "SECAGG": silo_pb2.Task.SECAGG}


def run_description_message(desc: dict) -> silo_pb2.RunDescription:
    return silo_pb2.RunDescription(
        run_id=desc["run_id"],
        algorithm=desc["algorithm"],
        model=desc["model"],
        num_classes=desc["num_classes"],
        in_channels=desc["in_channels"],
        image_size=desc["image_size"],
        total_rounds=desc["total_rounds"],
        algorithm_options_json=json.dumps(desc["algorithm_options"]),
        normalize_mean=desc["mean"],
        normalize_std=desc["std"],
        model_options_json=json.dumps(desc.get("model_options", {})),
        max_upload_bytes=desc["max_upload_bytes"],
        chunk_bytes=desc["chunk_bytes"],
    )


class FederationServicer(silo_pb2_grpc.FederationServicer):
    def __init__(self, hub: Hub, long_poll_s: float, chunk_bytes: int, gate: PeerGate | None = None,
                 on_join: Callable[[str, bytes | None], None] | None = None):
        self.hub = hub
        self.long_poll_s = long_poll_s
        self.chunk_bytes = chunk_bytes
        self.gate = gate or PeerGate()
        self.on_join = on_join  # (silo id, its verified certificate PEM): e.g. metrics of certificate expiry

    def _identity(self, context: grpc.ServicerContext) -> str:
        try:
            peer = self.gate.admit(context)
        except AccessDenied as denied:
            if denied.reason == "revoked" and denied.silo_id:
                self.hub.evict(denied.silo_id)  # never sampled again
            who = denied.silo_id or f"unidentified peer {context.peer()}"
            self.hub.refuse(who, denied.code, denied.reason, denied.message)
            context.abort(getattr(grpc.StatusCode, denied.code), denied.message)
        if peer.not_after is not None:
            self.hub.cert_not_after[peer.silo_id] = peer.not_after
        return peer.silo_id

    @staticmethod
    def _abort(context: grpc.ServicerContext, refusal: Refusal):
        context.abort(getattr(grpc.StatusCode, refusal.code), refusal.message)

    def Join(self, request, context):
        silo_id = self._identity(context)
        try:
            # The fields the hub core does not see are checked here; the rest in Hub.join.
            self.hub.validate(silo_id, lambda: validation.check_client_info(request.client_version,
                                                                            request.capabilities))
            desc = self.hub.join(silo_id, int(request.num_unlabeled), int(request.num_labeled), request.device,
                                 int(request.skipped_images), preparing=bool(request.preparing))
        except Refusal as r:
            self._abort(context, r)
        if self.on_join is not None:
            self.on_join(silo_id, peer_certificate(context))
        return silo_pb2.JoinReply(silo_id=silo_id, run=run_description_message(desc))

    def NextTask(self, request, context):
        silo_id = self._identity(context)
        wait = self.long_poll_s
        remaining = context.time_remaining()
        if remaining is not None:
            wait = max(0.0, min(wait, remaining - 1.0))
        try:
            view = self.hub.next_task(silo_id, request.run_id, wait)
        except Refusal as r:
            self._abort(context, r)
        return silo_pb2.Task(
            kind=_KINDS[view.kind],
            run_id=self.hub.run_id,
            round=view.round,
            task_id=view.task_id,
            bundle_bytes=view.bundle_bytes,
            bundle_sha256=view.bundle_sha256,
            hyperparameters_json=view.hyperparameters_json,
            class_thresholds=view.class_thresholds,
            expected=[silo_pb2.TensorSpec(name=n, shape=list(s.shape), dtype=s.dtype) for n, s in view.expected.items()],
            retry_after_s=view.retry_after_s,
            message=view.message,
            privacy_json=view.privacy_json,
            secagg_stage=view.secagg_stage,
            secagg_payload=view.secagg_payload,
        )

    def Download(self, request, context) -> Iterator[silo_pb2.Chunk]:
        silo_id = self._identity(context)
        try:
            bundle = self.hub.download(silo_id, request.run_id, request.task_id)
        except Refusal as r:
            self._abort(context, r)
        for offset, data in iter_chunks(bundle, self.chunk_bytes):
            yield silo_pb2.Chunk(offset=offset, data=data)

    def Upload(self, request_iterator, context):
        silo_id = self._identity(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            self.hub.refuse(silo_id, "INVALID_ARGUMENT", "no_header", "upload must start with an UploadHeader")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "upload must start with an UploadHeader message")
        h = first.header
        header = {
            "run_id": h.run_id, "task_id": h.task_id, "round": h.round, "total_bytes": h.total_bytes,
            "sha256": h.sha256, "skipped": h.skipped, "metrics": dict(h.metrics), "secagg_stage": h.secagg_stage,
        }

        def chunks():
            for message in request_iterator:
                if message.WhichOneof("part") != "chunk":
                    # Raised inside the hub's stream check, so it is counted and logged like any refusal.
                    raise validation.Invalid("INVALID_ARGUMENT", "bad_stream",
                                             "only chunks may follow the upload header")
                yield message.chunk.offset, message.chunk.data

        try:
            self.hub.upload(silo_id, header, chunks())
        except Refusal as r:
            self._abort(context, r)
        return silo_pb2.UploadReply(accepted=True, message="accepted")
