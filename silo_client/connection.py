"""The silo's connection to the hub as an explicit state machine: what the silo does next, decided in one place.

    JOINING --joined--> WAITING --task--> (the task runs) --> WAITING --done--> DONE
       ^                   |
       +--- the hub restarted, our task went stale (FAILED_PRECONDITION), the hub went away (UNAVAILABLE)
    any --transient failure--> BACKING_OFF (a jittered, doubling wait, then the phase it left) --too long--> REFUSED
    any --refused for good (certificate, protocol, TLS past its grace)--> REFUSED
    any --this branch's policy refused the run, a task breached it, a budget is spent--> LEFT

`Connection.after(outcome)` takes what the last attempt gave (joined, a task, an error) and returns a `Step`: the
phase to go to, how long to wait first, a line for the log, or the error that ends the silo. It holds no network
and no clock of its own (the caller passes the time), so every transition is tested without a hub
(tests/silo_client/test_connection.py); silo_client/client.py's run_forever only carries the steps out.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 60.0  # a hub asking for a longer wait is asked again after a minute
WAIT_TASK_CAP_S = 5.0  # a WAIT answer's retry_after, at most

# gRPC status names, as outcomes carry them (no grpc import here).
TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED")


class Phase(enum.Enum):
    JOINING = "joining"  # check the hub's certificate, join (and load the images) before anything else
    WAITING = "waiting"  # long-poll the hub for the next task (running a task returns here)
    BACKING_OFF = "backing_off"  # the hub is away or busy: wait, then try the phase left again
    DONE = "done"  # the run is over
    REFUSED = "refused"  # the hub, or TLS, refused this silo for good: the silo stops with an error
    LEFT = "left"  # this branch's policy refused the run or left it (told to the hub): the silo stops


@dataclass(frozen=True)
class Outcome:
    """What one attempt gave. kind: "joined", "task" (task_kind WAIT/TRAIN/RECEIVE/SECAGG, retry_after: its WAIT
    pause), "done", "rpc_error" (code: the gRPC status name, retry_after: a rate refusal's retry-after),
    "tls_refused", "hub_unchecked", "bad_bundle" (the hub's bundle failed its check), "bad_update" (this silo's own
    update failed its check: nothing was sent) or "left"."""

    kind: str
    code: str = ""
    message: str = ""
    task_kind: str = ""
    retry_after: float | None = None


@dataclass(frozen=True)
class Step:
    phase: Phase  # where the silo goes next (BACKING_OFF: it waits wait_s, then resumes `then`)
    wait_s: float = 0.0
    then: Phase | None = None  # after BACKING_OFF: the phase to try again
    log: str = ""  # a WARNING to log about why
    error: str | None = None  # REFUSED: the error the silo stops with


@dataclass
class Connection:
    connect_timeout_s: float = 300.0  # give up when the hub has been away this long (0: never)
    tls_refused_grace_s: float = 30.0  # ...or when TLS has refused this silo for certain this long
    rng: random.Random = field(default_factory=random.Random)
    phase: Phase = Phase.JOINING
    backoff_s: float = 1.0
    unreachable_since: float | None = None
    tls_refused_since: float | None = None

    def after(self, outcome: Outcome, now: float) -> Step:
        """The one place that decides what the silo does next."""
        step = self._decide(outcome, now)
        self.phase = step.phase if step.phase is not Phase.BACKING_OFF else (step.then or self.phase)
        return step

    def _decide(self, o: Outcome, now: float) -> Step:
        if o.kind == "left":
            return Step(Phase.LEFT)
        if o.kind in ("joined", "task", "done"):
            self.backoff_s, self.unreachable_since, self.tls_refused_since = 1.0, None, None
            if o.kind == "done":
                return Step(Phase.DONE)
            if o.kind == "task" and o.task_kind == "WAIT":
                return Step(Phase.WAITING, wait_s=min(o.retry_after or 0.0, WAIT_TASK_CAP_S))
            return Step(Phase.WAITING)
        if o.kind == "bad_bundle":
            return Step(Phase.WAITING, wait_s=1.0, log=f"bad bundle from the hub ({o.message}); asking again")
        if o.kind == "bad_update":  # the hub answered; the silo's own update failed: the task is waited out
            self.backoff_s, self.unreachable_since, self.tls_refused_since = 1.0, None, None
            return Step(Phase.WAITING, wait_s=1.0, log=o.message)
        if o.kind == "tls_refused":
            # Another CA, a wrong host name, an expired certificate: retrying for connect_timeout_s would not help;
            # a short grace covers a certificate being swapped on the hub just now.
            if self.tls_refused_since is None:
                self.tls_refused_since = now
            if now - self.tls_refused_since >= self.tls_refused_grace_s:
                return Step(Phase.REFUSED, error=o.message)
            return self._back_off(o.message, now, Phase.JOINING)
        if o.kind == "hub_unchecked":
            self.tls_refused_since = None
            return self._back_off(o.message, now, self.phase)
        if o.kind != "rpc_error":
            raise ValueError(f"unknown outcome {o.kind!r}")
        if o.code == "FAILED_PRECONDITION":  # the hub restarted, or our task went stale: join again, carry on
            return Step(Phase.JOINING, log=f"hub says: {o.message}; joining again")
        if o.code == "RESOURCE_EXHAUSTED" and o.retry_after is not None:  # faster than the hub allows: its wait
            return Step(Phase.BACKING_OFF, wait_s=min(o.retry_after, MAX_RETRY_AFTER_S), then=self.phase,
                        log=f"the hub asks this silo to slow down ({o.message}); retrying in {o.retry_after:.2f} s")
        if o.code == "UNAUTHENTICATED":
            return Step(Phase.REFUSED, error=f"the hub refused this silo: {o.message}; check --certs")
        if o.code == "PERMISSION_DENIED":
            return Step(Phase.REFUSED, error=f"the hub refused this silo: {o.message}")
        if o.code == "ALREADY_EXISTS" and self.phase is Phase.JOINING:
            # Another certificate of this silo holds a live session (a renewed one started beside the old process):
            # it may end (liveness_s), so wait, doubling, rather than join once a second for ever.
            return self._back_off(f"the hub refused the join: {o.message}", now, Phase.JOINING)
        if o.code in TRANSIENT:
            return self._back_off(o.message, now, Phase.JOINING if o.code == "UNAVAILABLE" else self.phase)
        return Step(self.phase, wait_s=1.0, log=f"hub refused a request: {o.code}: {o.message}")

    def _back_off(self, message: str, now: float, then: Phase) -> Step:
        """A jittered, doubling wait; REFUSED once the hub has been away for connect_timeout_s."""
        if self.unreachable_since is None:
            self.unreachable_since = now
        if self.connect_timeout_s and now - self.unreachable_since > self.connect_timeout_s:
            return Step(Phase.REFUSED, error=f"{message}; gave up after {self.connect_timeout_s:.0f}s")
        wait = self.backoff_s * (0.75 + 0.5 * self.rng.random())
        step = Step(Phase.BACKING_OFF, wait_s=wait, then=then, log=f"{message}; retrying in {self.backoff_s:.0f}s")
        self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
        return step
