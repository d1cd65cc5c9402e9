"""Drive a hub session and its silo sessions in one process: the tests' and the benchmark's harness.

The bytes that pass between them are exactly what the wire carries; only transport is skipped. A silo listed in
`drop` goes silent from the named stage on (it sends nothing for that stage or later), which is how a dropout
looks to the hub. A silo whose session aborts (SecAggError) is treated the same way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from security.secagg.hub import HubSession, SecAggResult
from security.secagg.params import SecAggParams
from security.secagg.silo import SecAggError, SiloSession

STAGE_ORDER = ("advertise_keys", "share_keys", "masked_input", "unmask")


@dataclass
class Costs:
    silo_seconds: dict[str, float] = field(default_factory=dict)
    silo_bytes_up: dict[str, int] = field(default_factory=dict)
    silo_bytes_down: dict[str, int] = field(default_factory=dict)
    hub_seconds: float = 0.0
    aborted: dict[str, str] = field(default_factory=dict)
    silos: dict[str, SiloSession] = field(default_factory=dict)  # each silo's session, for inspection
    hub: HubSession | None = None


def aggregate(
    inputs: Mapping[str, Mapping[str, torch.Tensor]],
    params: SecAggParams,
    *,
    drop: Mapping[str, str] | None = None,
    session: str = "session-1",
    seed: int = 0,
    tamper: Callable[[str, str, bytes], bytes] | None = None,
    costs: Costs | None = None,
    keep_levels: bool = True,
) -> SecAggResult:
    """Securely sum `inputs` (silo id -> named tensors); `tamper(stage, recipient, payload)` may alter hub->silo
    messages in flight. Raises RoundAbandoned when the threshold cannot be met."""
    drop = dict(drop or {})
    costs = costs if costs is not None else Costs()
    ids = sorted(inputs)
    shapes = {n: tuple(t.shape) for n, t in next(iter(inputs.values())).items()}
    started = time.perf_counter()
    hub = HubSession(session, ids, params, shapes, rng=random.Random(seed))
    costs.hub_seconds += time.perf_counter() - started
    silos = {i: SiloSession(session, i, rounding_seed=seed * 7919 + k, keep_levels=keep_levels) for k, i in enumerate(ids)}
    costs.silos, costs.hub = silos, hub
    for i in ids:
        costs.silo_seconds[i], costs.silo_bytes_up[i], costs.silo_bytes_down[i] = 0.0, 0, 0

    def active(stage: str) -> list[str]:
        cut = STAGE_ORDER.index(stage)
        return [i for i in ids if i not in costs.aborted
                and (i not in drop or STAGE_ORDER.index(drop[i]) > cut)]

    def silo_step(i: str, fn: Callable[[], bytes]) -> bytes | None:
        t0 = time.perf_counter()
        try:
            out = fn()
        except SecAggError as err:
            costs.aborted[i] = str(err)
            out = None
        costs.silo_seconds[i] += time.perf_counter() - t0
        if out is not None:
            costs.silo_bytes_up[i] += len(out)
        return out

    def hub_step(fn: Callable[[], object]):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            costs.hub_seconds += time.perf_counter() - t0

    def deliver(stage: str, messages: dict[str, bytes]) -> dict[str, bytes]:
        out = {}
        for i, payload in messages.items():
            if tamper is not None:
                payload = tamper(stage, i, payload)
            costs.silo_bytes_down[i] += len(payload)
            out[i] = payload
        return out

    for i in active("advertise_keys"):
        payload = silo_step(i, silos[i].advertise_keys)
        if payload is not None:
            hub_step(lambda i=i, p=payload: hub.receive_keys(i, p))
    rosters = deliver("share_keys", hub_step(hub.close_advertise))

    for i in active("share_keys"):
        if i in rosters:
            payload = silo_step(i, lambda i=i: silos[i].share_keys(rosters[i]))
            if payload is not None:
                hub_step(lambda i=i, p=payload: hub.receive_shares(i, p))
    inboxes = deliver("masked_input", hub_step(hub.close_share_keys))

    for i in active("masked_input"):
        if i in inboxes:
            payload = silo_step(i, lambda i=i: silos[i].masked_input(inboxes[i], inputs[i]))
            if payload is not None:
                hub_step(lambda i=i, p=payload: hub.receive_masked_input(i, p))
    requests = deliver("unmask", hub_step(hub.close_masked_input))

    for i in active("unmask"):
        if i in requests:
            payload = silo_step(i, lambda i=i: silos[i].unmask(requests[i]))
            if payload is not None:
                hub_step(lambda i=i, p=payload: hub.receive_unmask(i, p))
    return hub_step(hub.finish)
