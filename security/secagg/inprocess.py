"""Drive a hub session and its silo sessions in one process: the tests' and the benchmark's harness.

The bytes that pass between them are exactly what the wire carries; only transport is skipped. A silo listed in
`drop` goes silent from the named stage on (it sends nothing for that stage or later), which is how a dropout
looks to the hub. A silo whose session aborts (SecAggError) is treated the same way.

Given `identities` (silo id -> SiloIdentity) and a `verifier`, the round is signed: every silo signs its keys and
the survivor set, and the hub and every silo verify (see silo.py). Without them it runs unsigned, the same five
stages with empty signatures.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from security.secagg.hub import HubSession, SecAggResult
from security.secagg.identity import PeerVerifier, SiloIdentity
from security.secagg.messages import ProtocolError
from security.secagg.params import SecAggParams
from security.secagg.silo import SecAggError, SiloSession

STAGE_ORDER = ("advertise_keys", "share_keys", "masked_input", "consistency", "unmask")


@dataclass
class Costs:
    silo_seconds: dict[str, float] = field(default_factory=dict)
    silo_bytes_up: dict[str, int] = field(default_factory=dict)
    silo_bytes_down: dict[str, int] = field(default_factory=dict)
    hub_seconds: float = 0.0
    # per stage (STAGE_ORDER, and the hub's "setup" and "finish"), summed over silos: where the cost lands
    silo_stage_seconds: dict[str, float] = field(default_factory=dict)
    silo_stage_bytes_up: dict[str, int] = field(default_factory=dict)
    silo_stage_bytes_down: dict[str, int] = field(default_factory=dict)
    hub_stage_seconds: dict[str, float] = field(default_factory=dict)
    aborted: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # silos whose message the hub refused (ProtocolError)
    silos: dict[str, SiloSession] = field(default_factory=dict)  # each silo's session, for inspection
    hub: HubSession | None = None


def _add(counter: dict, key: str, value: float) -> None:
    counter[key] = counter.get(key, 0) + value


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
    identities: Mapping[str, SiloIdentity] | None = None,
    verifier: PeerVerifier | None = None,
    run_id: str = "run",
    min_cohort: int = 0,
    hub_min_survivors: int | None = None,
    silo_verifiers: Mapping[str, PeerVerifier] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SecAggResult:
    """Securely sum `inputs` (silo id -> named tensors); `tamper(stage, recipient, payload)` may alter hub->silo
    messages in flight (stages share_keys: rosters, masked_input: inboxes, consistency: survivor sets, unmask:
    unmask requests). Signed when `identities` are given: `verifier` then checks certificates for the hub and,
    unless `silo_verifiers` gives a silo its own (a silo's own cache, as on separate machines), for every silo.
    `min_cohort` is every silo's policy minimum, which the hub holds its rounds to unless `hub_min_survivors`
    says otherwise (a hub that deviates); `clock` times each party's steps (time.process_time: CPU seconds). Raises RoundAbandoned when the threshold cannot be met."""
    drop = dict(drop or {})
    costs = costs if costs is not None else Costs()
    ids = sorted(inputs)
    shapes = {n: tuple(t.shape) for n, t in next(iter(inputs.values())).items()}
    signed = identities is not None
    if signed and verifier is None:
        raise ValueError("a signed round needs a verifier")
    started = clock()
    # An honest hub promises the cohort the silos require (silo_server/rounds/privacy.py: min_survivors holds the run's
    # pinned min_cohort, which no accepting silo's policy exceeds); a hub that does not is a test's deviating one.
    hub = HubSession(session, ids, params, shapes, rng=random.Random(seed), verifier=verifier, run_id=run_id,
                     signed=signed, min_survivors=min_cohort if hub_min_survivors is None else hub_min_survivors)
    elapsed = clock() - started
    costs.hub_seconds += elapsed
    _add(costs.hub_stage_seconds, "setup", elapsed)
    silo_verifiers = silo_verifiers or {}
    silos = {i: SiloSession(session, i, rounding_seed=seed * 7919 + k, keep_levels=keep_levels,
                            identity=identities[i] if signed else None, verifier=silo_verifiers.get(i, verifier),
                            run_id=run_id, min_cohort=min_cohort)
             for k, i in enumerate(ids)}
    costs.silos, costs.hub = silos, hub
    for i in ids:
        costs.silo_seconds[i], costs.silo_bytes_up[i], costs.silo_bytes_down[i] = 0.0, 0, 0

    def active(stage: str) -> list[str]:
        cut = STAGE_ORDER.index(stage)
        return [i for i in ids if i not in costs.aborted and i not in costs.refused
                and (i not in drop or STAGE_ORDER.index(drop[i]) > cut)]

    def silo_step(stage: str, i: str, fn: Callable[[], bytes]) -> bytes | None:
        t0 = clock()
        try:
            out = fn()
        except SecAggError as err:
            costs.aborted[i] = str(err)
            out = None
        elapsed = clock() - t0
        costs.silo_seconds[i] += elapsed
        _add(costs.silo_stage_seconds, stage, elapsed)
        if out is not None:
            costs.silo_bytes_up[i] += len(out)
            _add(costs.silo_stage_bytes_up, stage, len(out))
        return out

    def hub_step(stage: str, fn: Callable[[], object]):
        t0 = clock()
        try:
            return fn()
        finally:
            elapsed = clock() - t0
            costs.hub_seconds += elapsed
            _add(costs.hub_stage_seconds, stage, elapsed)

    def hub_receive(stage: str, i: str, fn: Callable[[], None]) -> None:
        """A message the hub refuses drops its sender, as the wire layer does."""
        try:
            hub_step(stage, fn)
        except ProtocolError as err:
            costs.refused[i] = str(err)
            hub.drop(i)

    def deliver(stage: str, messages: dict[str, bytes]) -> dict[str, bytes]:
        out = {}
        for i, payload in messages.items():
            if tamper is not None:
                payload = tamper(stage, i, payload)
            costs.silo_bytes_down[i] += len(payload)
            _add(costs.silo_stage_bytes_down, stage, len(payload))
            out[i] = payload
        return out

    for i in active("advertise_keys"):
        payload = silo_step("advertise_keys", i, silos[i].advertise_keys)
        if payload is not None:
            hub_receive("advertise_keys", i, lambda i=i, p=payload: hub.receive_keys(i, p))
    rosters = deliver("share_keys", hub_step("advertise_keys", hub.close_advertise))

    for i in active("share_keys"):
        if i in rosters:
            payload = silo_step("share_keys", i, lambda i=i: silos[i].share_keys(rosters[i]))
            if payload is not None:
                hub_receive("share_keys", i, lambda i=i, p=payload: hub.receive_shares(i, p))
    inboxes = deliver("masked_input", hub_step("share_keys", hub.close_share_keys))

    for i in active("masked_input"):
        if i in inboxes:
            payload = silo_step("masked_input", i, lambda i=i: silos[i].masked_input(inboxes[i], inputs[i]))
            if payload is not None:
                hub_receive("masked_input", i, lambda i=i, p=payload: hub.receive_masked_input(i, p))
    requests = deliver("consistency", hub_step("masked_input", hub.close_masked_input))

    for i in active("consistency"):
        if i in requests:
            payload = silo_step("consistency", i, lambda i=i: silos[i].consistency(requests[i]))
            if payload is not None:
                hub_receive("consistency", i, lambda i=i, p=payload: hub.receive_consistency(i, p))
    requests = deliver("unmask", hub_step("consistency", hub.close_consistency))

    for i in active("unmask"):
        if i in requests:
            payload = silo_step("unmask", i, lambda i=i: silos[i].unmask(requests[i]))
            if payload is not None:
                hub_receive("unmask", i, lambda i=i, p=payload: hub.receive_unmask(i, p))
    return hub_step("finish", hub.finish)
