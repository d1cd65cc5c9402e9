"""The gRPC face of the hub: identity from the verified client certificate, messages in, Refusals out as statuses.

Every call first passes the PeerGate (security/gate.py: certificate, CRL, expiry, allowlist), then the silo's
per-identity call limits (CallLimits): no silo may hold more than one call of each kind at a time, so one
certificate cannot take the capacity every other silo needs. Every field is then validated
(security/validation.py) before the hub acts on it.

The server runs on grpc.aio in a thread of its own (FederationServer): a silo waiting in a long-poll is a
suspended coroutine, not a parked thread, so the hub can hold every idle silo's NextTask until there is work for
it. The hub core stays plain blocking Python; calls that may block (Join, Download, Upload) run on a thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from security import validation
from security.gate import AccessDenied, Peer, PeerGate
from security.terms import CLAUSES
from security.tls import RETRY_AFTER_KEY, peer_certificate
from silo.v1 import silo_pb2, silo_pb2_grpc
from silo_core.tensors import iter_chunks
from silo_server.hub import Departure, Hub, Refusal
from silo_server.state.registry import BurstLog

log = logging.getLogger("silo_server")

_KINDS = {"WAIT": silo_pb2.Task.WAIT, "TRAIN": silo_pb2.Task.TRAIN, "DONE": silo_pb2.Task.DONE,
          "SECAGG": silo_pb2.Task.SECAGG, "RECEIVE": silo_pb2.Task.RECEIVE}

# Calls one silo may have in flight at once, by method. A silo's own client never needs more than one at a time.
CALLS_PER_SILO = {"Join": 1, "NextTask": 1, "Download": 1, "Upload": 1, "Leave": 1, "Health": 1}
MAX_CALLS_PER_SILO = 3  # of all kinds together
HEADER_TIMEOUT_S = 10.0  # an upload must send its header this soon after it opens
STREAM_IDLE_S = 60.0  # and never go longer than this between two chunks


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
        model_factory=desc.get("model_factory", ""),
        architecture=[silo_pb2.TensorSpec(name=t.name, shape=list(t.shape), dtype=t.dtype)
                      for t in desc.get("architecture", [])],
        protocol_version=desc.get("protocol_version", 0),
        terms=desc.get("terms"),
        classes=desc.get("classes", []),
    )


_DEPARTURE_KINDS = {silo_pb2.PolicyRefusal.REFUSED: "refused", silo_pb2.PolicyRefusal.BREACH: "breach",
                    silo_pb2.PolicyRefusal.BUDGET: "budget"}


def departure_of(refusal: silo_pb2.PolicyRefusal) -> Departure:
    """A silo's typed refusal as the hub keeps it: its words escaped and cut, its clause one of the known ones."""
    clause = refusal.clause if refusal.clause in CLAUSES else "other"
    return Departure(kind=_DEPARTURE_KINDS.get(refusal.kind, "other"), clause=clause,
                     required=validation.printable(refusal.required, 200),
                     offered=validation.printable(refusal.offered, 200),
                     message=validation.printable(refusal.message, 400), round=max(0, int(refusal.round)))


@dataclass(frozen=True)
class Rate:
    """A token bucket: `per_second` calls on average, up to `burst` at once."""

    per_second: float
    burst: float


# Calls one silo may start per second, by method. An honest silo needs far fewer (bench/README.md, "What an honest
# silo asks of the hub": at most 2 Joins, 6 NextTasks, 1 Download and 5 Uploads a round, seconds apart); a silo
# past its rate is refused with RESOURCE_EXHAUSTED and told when to retry (silo-client waits that long).
CALL_RATES = {"Join": Rate(1.0, 10.0), "NextTask": Rate(5.0, 20.0), "Download": Rate(2.0, 10.0),
              "Upload": Rate(5.0, 20.0), "Leave": Rate(0.2, 3.0), "Health": Rate(2.0, 10.0)}
# A refused call is answered after a pause (at most this long; a rate refusal's pause is its wait for a token):
# a client that calls back to back then makes a few calls a second, not thousands, and the hub's CPU goes to the
# other silos. At most TARPIT_PER_SILO refusals of one silo pause at once; beyond that they are answered at once,
# so a silo cannot hold the hub's memory with paused calls.
TARPIT_MAX_S, TARPIT_PER_SILO = 1.0, 8
# The retry-after of a call refused because the silo has as many open as allowed: when one of them ends is unknown.
OPEN_CALL_RETRY_S = 1.0


class CallLimits:
    """Calls per silo: in flight, capped per method and in all, and started per second, a token bucket per method.
    Excess calls are refused at once (the caller learns RESOURCE_EXHAUSTED and, for a rate, when to retry),
    counted per silo, and logged through the hub's burst log: one WARNING a silo and reason per `warn_every_s`,
    with the count refused since the last one."""

    def __init__(self, per_method: dict[str, int] | None = None, per_silo: int = MAX_CALLS_PER_SILO,
                 warn_every_s: float = 60.0, rates: dict[str, Rate] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.per_method = dict(CALLS_PER_SILO if per_method is None else per_method)
        self.per_silo = per_silo
        self.warn_every_s = warn_every_s
        self.rates = dict(CALL_RATES if rates is None else rates)
        self.clock = clock
        self.in_flight: dict[str, dict[str, int]] = {}
        self.tokens: dict[tuple[str, str], tuple[float, float]] = {}  # (silo, method) -> (tokens, at)
        self.refused: dict[str, int] = {}  # silo -> calls refused since the hub started
        self.pausing: dict[str, int] = {}  # silo -> refused calls being held before their answer (tarpit)
        self.burst = BurstLog(warn_every_s)
        self._lock = threading.Lock()

    def acquire(self, silo_id: str, method: str) -> Refused | None:
        """Take a slot; None if granted, else why not (and, for a rate, how long until a token is free)."""
        with self._lock:
            calls = self.in_flight.setdefault(silo_id, {})
            retry_after = 0.0
            if calls.get(method, 0) >= self.per_method.get(method, 1):
                reason, text = "too_many_calls", f"{method}: {self.per_method.get(method, 1)} at a time per silo"
            elif sum(calls.values()) >= self.per_silo:
                reason, text = "too_many_calls", f"{self.per_silo} calls at a time per silo"
            elif (retry_after := self._take_token(silo_id, method)) > 0:
                rate = self.rates[method]
                reason, text = "call_rate", f"{method}: {rate.per_second:g} a second per silo, {rate.burst:g} at once"
            else:
                calls[method] = calls.get(method, 0) + 1
                return None
            self.refused[silo_id] = self.refused.get(silo_id, 0) + 1
            pause = 0.0
            if self.pausing.get(silo_id, 0) < TARPIT_PER_SILO:
                pause = min(TARPIT_MAX_S, retry_after if reason == "call_rate" else TARPIT_MAX_S)
                self.pausing[silo_id] = self.pausing.get(silo_id, 0) + 1
        what = "has more calls open than allowed" if reason == "too_many_calls" else "calls faster than allowed"
        self.burst.warn((silo_id, reason), lambda n: (
            f"silo {silo_id} {what} ({text}): {n} refused since the last warning; further refusals in the "
            f"next {self.warn_every_s:.0f} s are counted, not logged"))
        return Refused(reason, text, max(0.0, retry_after - pause), pause)

    def _take_token(self, silo_id: str, method: str) -> float:
        """0 when the bucket had a token (one is taken), else the seconds until it will (call under the lock)."""
        rate = self.rates.get(method)
        if rate is None:
            return 0.0
        now = self.clock()
        tokens, at = self.tokens.get((silo_id, method), (rate.burst, now))
        tokens = min(rate.burst, tokens + (now - at) * rate.per_second)
        if tokens >= 1.0:
            self.tokens[(silo_id, method)] = (tokens - 1.0, now)
            return 0.0
        self.tokens[(silo_id, method)] = (tokens, now)
        return (1.0 - tokens) / rate.per_second

    def paused(self, silo_id: str) -> None:
        """A refused call's pause is over (it is being answered)."""
        with self._lock:
            left = self.pausing.get(silo_id, 0) - 1
            if left > 0:
                self.pausing[silo_id] = left
            else:
                self.pausing.pop(silo_id, None)

    def release(self, silo_id: str, method: str) -> None:
        with self._lock:
            calls = self.in_flight.get(silo_id, {})
            calls[method] = max(0, calls.get(method, 0) - 1)
            if not any(calls.values()):
                self.in_flight.pop(silo_id, None)


@dataclass(frozen=True)
class Refused:
    reason: str  # too_many_calls or call_rate
    text: str
    retry_after_s: float = 0.0  # after the pause: how much longer until a token is free
    pause_s: float = 0.0  # how long the hub holds the refusal before answering it


class _Slot:
    """A per-silo call slot held for the duration of a call (async context manager)."""

    def __init__(self, servicer: FederationServicer, context: Any, method: str, check_session: bool = True):
        self.servicer, self.context, self.method, self.check_session = servicer, context, method, check_session
        self.peer: Peer | None = None

    async def __aenter__(self) -> Peer:
        s = self.servicer
        peer = await s._admit(self.context)
        if self.check_session:
            try:
                s.hub.registry.check_session(peer.silo_id, peer.serial)
            except Refusal as r:
                await s._abort(self.context, r)
        refused = s.limits.acquire(peer.silo_id, self.method)
        if refused is not None:
            s.hub.registry.count_refusal(refused.reason, peer.silo_id)
            if refused.pause_s > 0:  # no thread is held: the call waits on the event loop
                try:
                    await asyncio.sleep(refused.pause_s)
                finally:
                    s.limits.paused(peer.silo_id)
            # Every limit refusal says when to try again, so that a silo tells "not now" from "received and
            # refused" (silo_client/hub_link.py upload_refused): an upload refused because the silo's previous one
            # is still open on the hub is sent again, not dropped.
            wait_s = refused.retry_after_s if refused.reason == "call_rate" else OPEN_CALL_RETRY_S
            self.context.set_trailing_metadata(((RETRY_AFTER_KEY, str(math.ceil(wait_s * 1000))),))
            if refused.reason == "call_rate":
                await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"silo {peer.silo_id} calls faster than allowed ({refused.text}); retry in "
                                         f"{refused.retry_after_s:.2f} s")
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"too many calls open from silo {peer.silo_id} ({refused.text}); wait for the "
                                     "open one to finish")
        s.hub.registry.count(f"calls:{self.method}")  # what silos ask of the hub, by call (silokit_hub_calls_total)
        self.peer = peer
        return peer

    async def __aexit__(self, *exc: Any) -> None:
        self.servicer.limits.release(self.peer.silo_id, self.method)


class _ChunkStream:
    """An upload's chunks, read on the pool thread that checks the upload, each awaited on the event loop: at most
    `idle_s` apart, and given up between chunks once the check's `still_open` turns false (the round closed), so a
    stalled stream does not hold its room in the upload budget past its round (validation.read_stream)."""

    WAKE_S = 0.5  # how often a wait for the next chunk looks whether the round is still open

    def __init__(self, next_message: Callable[[], Any], loop: asyncio.AbstractEventLoop, idle_s: float):
        self.next_message, self.loop, self.idle_s = next_message, loop, idle_s
        self.still_open: Callable[[], bool] = lambda: True

    def stop_waiting_when(self, still_open: Callable[[], bool]) -> None:
        self.still_open = still_open

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, bytes]:
        future = asyncio.run_coroutine_threadsafe(self.next_message(), self.loop)
        give_up = time.monotonic() + self.idle_s
        while True:
            try:
                message = future.result(timeout=max(0.0, min(self.WAKE_S, give_up - time.monotonic())))
                break
            except concurrent.futures.TimeoutError:
                if not self.still_open():
                    future.cancel()
                    raise validation.Invalid("FAILED_PRECONDITION", "stale_task",
                                             "the round closed during the upload") from None
                if time.monotonic() >= give_up:
                    future.cancel()
                    raise validation.Invalid("DEADLINE_EXCEEDED", "stream_idle",
                                             f"no chunk for {self.idle_s:g} s: an upload must keep sending") from None
        if message is None:
            raise StopIteration
        if message.WhichOneof("part") != "chunk":
            # Raised inside the hub's stream check, so it is counted and logged like any refusal.
            raise validation.Invalid("INVALID_ARGUMENT", "bad_stream", "only chunks may follow the upload header")
        return message.chunk.offset, message.chunk.data


class FederationServicer(silo_pb2_grpc.FederationServicer):
    def __init__(self, hub: Hub, long_poll_s: float, chunk_bytes: int, gate: PeerGate | None = None,
                 on_join: Callable[[str, bytes | None], None] | None = None, *,
                 limits: CallLimits | None = None, header_timeout_s: float = HEADER_TIMEOUT_S,
                 stream_idle_s: float = STREAM_IDLE_S, pool: concurrent.futures.Executor | None = None):
        self.hub = hub
        self.long_poll_s = long_poll_s
        self.chunk_bytes = chunk_bytes
        self.gate = gate or PeerGate()
        self.on_join = on_join  # (silo id, its verified certificate PEM): e.g. metrics of certificate expiry
        self.limits = limits or CallLimits()
        self.limits.burst = hub.registry.burst  # one burst log for every refusal path: the gate's, the limits', the hub's
        self.header_timeout_s = header_timeout_s
        self.stream_idle_s = stream_idle_s
        self.pool = pool  # blocking hub calls run here (None: the loop's default executor)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future | None = None
        self._run_message: tuple[dict | None, silo_pb2.RunDescription] = (None, silo_pb2.RunDescription())

    # ------------------------------------------------------------------ plumbing
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop: every change in the hub (hub.cond.notify_all) wakes the long-polls."""
        self._loop = loop
        self._changed = loop.create_future()
        self.hub.cond.listeners.append(lambda: loop.call_soon_threadsafe(self._wake))

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = self._loop.create_future()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _admit(self, context: grpc.aio.ServicerContext) -> Peer:
        try:
            peer = self.gate.admit(context)
        except AccessDenied as denied:
            if denied.reason == "revoked" and denied.silo_id:
                # Out of its round and never sampled again, when the revoked certificate is the one its session
                # holds: a call with an old certificate, revoked when the silo was given a new one, leaves the
                # silo's live session alone.
                self.hub.rounds.evict(denied.silo_id, serial=denied.serial)
            who = validation.printable(denied.silo_id or f"unidentified peer {context.peer()}", 140)
            # Counted every time, logged once a minute per peer and reason: a revoked silo that keeps calling
            # cannot fill the log.
            reason, text = denied.reason, validation.printable(denied.message, 300)
            self.hub.registry.count_refusal(reason, denied.silo_id)
            self.hub.registry.burst.warn((who, reason), lambda n: (
                f"refused {reason} from {who}: {text}" + (f" ({n} such calls since the last line)" if n > 1 else "")))
            await context.abort(getattr(grpc.StatusCode, denied.code), denied.message)
        if peer.not_after is not None:
            self.hub.registry.cert_not_after[peer.silo_id] = peer.not_after
        return peer

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
        await context.abort(getattr(grpc.StatusCode, refusal.code), refusal.message)

    # ------------------------------------------------------------------ calls
    async def Join(self, request, context):
        async with _Slot(self, context, "Join", check_session=False) as peer:
            silo_id = peer.silo_id
            try:
                # The fields the hub core does not see are checked here; the rest in Hub.join.
                self.hub.registry.validate(silo_id, lambda: validation.check_client_info(
                    request.client_version, [*request.capabilities, *request.features]))
                desc = await self._run(lambda: self.hub.join(
                    silo_id, int(request.num_unlabeled), int(request.num_labeled), request.device,
                    int(request.skipped_images), preparing=bool(request.preparing), serial=peer.serial,
                    protocol_version=int(request.protocol_version), features=list(request.features),
                    connection=context.peer()))
            except Refusal as r:
                await self._abort(context, r)
            if self.on_join is not None:
                self.on_join(silo_id, peer_certificate(context))
            if self._run_message[0] is not desc:  # the same run for every silo: built once (a thousand joins)
                self._run_message = (desc, run_description_message(desc))
            return silo_pb2.JoinReply(silo_id=silo_id, run=self._run_message[1])

    async def NextTask(self, request, context):
        """Held until there is something for this silo (or the long-poll cap): an idle silo costs the hub one call
        per long_poll_s and no thread while it waits."""
        async with _Slot(self, context, "NextTask") as peer:
            silo_id = peer.silo_id
            wait = self.long_poll_s
            remaining = context.time_remaining()
            if remaining is not None:
                wait = max(0.0, min(wait, remaining - 1.0))
            try:
                self.hub.start_poll(silo_id, request.run_id)
            except Refusal as r:
                await self._abort(context, r)
            loop = asyncio.get_running_loop()
            end = loop.time() + wait
            try:
                while True:
                    changed = self._changed
                    view = self.hub.poll_task(silo_id)
                    left = end - loop.time()
                    if view.kind != "WAIT" or left <= 0 or self.hub.stop_event.is_set() or changed is None:
                        break
                    try:
                        await asyncio.wait_for(asyncio.shield(changed), left)
                    except TimeoutError:
                        pass
            finally:
                self.hub.end_poll(silo_id)
            return silo_pb2.Task(
                kind=_KINDS[view.kind],
                run_id=self.hub.run_id,
                round=view.round,
                task_id=view.task_id,
                bundle_bytes=view.bundle_bytes,
                bundle_sha256=view.bundle_sha256,
                hyperparameters_json=view.hyperparameters_json,
                class_thresholds=view.class_thresholds,
                expected=[silo_pb2.TensorSpec(name=n, shape=list(s.shape), dtype=s.dtype)
                          for n, s in view.expected.items()],
                retry_after_s=view.retry_after_s,
                message=view.message,
                privacy=view.privacy,
                secagg_stage=view.secagg_stage,
                secagg_payload=view.secagg_payload,
                upload_within_s=view.upload_within_s,
            )

    async def Download(self, request, context) -> AsyncIterator[silo_pb2.Chunk]:
        async with _Slot(self, context, "Download") as peer:
            silo_id = peer.silo_id
            try:
                bundle = await self._run(self.hub.download, silo_id, request.run_id, request.task_id)
            except Refusal as r:
                await self._abort(context, r)
            for offset, data in iter_chunks(bundle, self.chunk_bytes):
                yield silo_pb2.Chunk(offset=offset, data=data)

    async def Upload(self, request_iterator, context):
        async with _Slot(self, context, "Upload") as peer:
            silo_id = peer.silo_id
            messages = request_iterator.__aiter__()

            async def next_message():
                try:
                    return await messages.__anext__()
                except StopAsyncIteration:
                    return None

            try:
                first = await asyncio.wait_for(next_message(), self.header_timeout_s)
            except TimeoutError:
                r = self.hub.registry.refuse(silo_id, "DEADLINE_EXCEEDED", "stream_idle",
                                    f"no upload header within {self.header_timeout_s:g} s of opening the upload")
                await self._abort(context, r)
            if first is None or first.WhichOneof("part") != "header":
                r = self.hub.registry.refuse(silo_id, "INVALID_ARGUMENT", "no_header",
                                             "upload must start with an UploadHeader")
                await self._abort(context, r)
            h = first.header
            header = {
                "run_id": h.run_id, "task_id": h.task_id, "round": h.round, "total_bytes": h.total_bytes,
                "sha256": h.sha256, "skipped": h.skipped, "metrics": dict(h.metrics), "secagg_stage": h.secagg_stage,
            }
            chunks = _ChunkStream(next_message, asyncio.get_running_loop(), self.stream_idle_s)

            def upload() -> None:
                try:
                    self.hub.upload(silo_id, header, chunks)
                except validation.Invalid as e:  # from the chunk stream, outside the hub's own checks
                    raise self.hub.registry.refuse(silo_id, e.code, e.reason, e.message) from None

            try:
                await self._run(upload)
            except Refusal as r:
                await self._abort(context, r)
            return silo_pb2.UploadReply(accepted=True, message="accepted")


    async def Leave(self, request, context):
        async with _Slot(self, context, "Leave") as peer:
            try:
                await self._run(self.hub.leave, peer.silo_id, request.run_id, departure_of(request.refusal))
            except Refusal as r:
                await self._abort(context, r)
            return silo_pb2.LeaveReply(accepted=True)


class GatedHealth(HealthServicer):
    """grpc.health.v1 behind the same gate as the federation: only a valid, unrevoked silo certificate learns
    whether the hub serves (and it costs that silo one of its call slots while it asks)."""

    def __init__(self, servicer: FederationServicer):
        super().__init__()
        self.servicer = servicer

    async def Check(self, request, context):
        async with _Slot(self.servicer, context, "Health", check_session=False):
            return await super().Check(request, context)

    async def Watch(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; poll Check")


class FederationServer:
    """A grpc.aio server on an event loop in a thread of its own, driven from blocking code (the hub app, tests):
    build, add ports, start, stop. The health service is served behind the federation's gate."""

    def __init__(self, servicer: FederationServicer, options: list[tuple[str, Any]] | None = None):
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

        async def build() -> tuple[grpc.aio.Server, GatedHealth]:
            servicer.attach(asyncio.get_running_loop())
            server = grpc.aio.server(options=options or [])
            silo_pb2_grpc.add_FederationServicer_to_server(servicer, server)
            health = GatedHealth(servicer)
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            return server, health

        self.server, self.health = self._call(build())

    def _call(self, coro: Any, timeout: float | None = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add_port(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        """The port bound (0 when the address cannot be bound)."""
        async def add() -> int:
            if credentials is None:
                return self.server.add_insecure_port(address)
            return self.server.add_secure_port(address, credentials)

        try:
            return self._call(add())
        except RuntimeError:
            return 0

    def start(self) -> None:
        async def start() -> None:
            await self.server.start()
            for service in ("", "silo.v1.Federation"):
                await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

        self._call(start())

    def stop(self, grace: float = 1.0) -> None:
        if not self.loop.is_running():
            return
        try:
            self._call(self.server.stop(grace), timeout=grace + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
