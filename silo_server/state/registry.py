"""The hub's silo registry: who joined, under which certificate, how many images each declared, who is live, and
the refusals and events counted so far. Plain Python; every method takes the shared lock (ChangeCondition) itself
or says that its caller must hold it."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from security import validation
from security.audit import AuditLog
from silo_server.rounds.breaker import Quarantine, QuarantineList

log = logging.getLogger("silo_server")

CERT_WARN_DAYS = 14.0  # certificates closer to expiry than this are logged as warnings


class BurstLog:
    """One WARNING per key (a silo and a refusal reason) per `every_s` at most, saying how many events it stands
    for: a peer that repeats a refused call cannot fill the hub's log. Every refusal path of the hub logs through
    one of these: the gate's, the call limits', the hub core's."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._last: dict[Any, float] = {}
        self._unreported: dict[Any, int] = {}
        self._lock = threading.Lock()

    def warn(self, key: Any, message: Callable[[int], str]) -> None:
        """Count one event; log `message(n)` (n: events since the key's last line, this one included) when due."""
        with self._lock:
            self._unreported[key] = self._unreported.get(key, 0) + 1
            now = time.monotonic()
            if now - self._last.get(key, -1e18) < self.every_s:
                return
            self._last[key] = now
            count = self._unreported.pop(key)
        log.warning("%s", message(count))


class Refusal(Exception):
    """A request the hub will not act on. `code` is a gRPC status name; `reason` a low-cardinality label."""

    def __init__(self, code: str, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class ChangeCondition(threading.Condition):
    """The hub's lock and condition variable. notify_all also calls `listeners` (under the lock: they must only
    schedule work), so the gRPC servicer's long-polls learn of a change without a thread waiting for each silo.

    A listener call wakes every waiting long-poll to ask again, so changes that cannot alter any waiting silo's
    answer (a silo joined, a result was accepted) pass `wake_polls=False`: they wake only the hub's own waits
    (the round loop). At 1,000 silos each wake-all cost a thousand polls, and joins and uploads made them
    quadratic in the number of silos."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.listeners: list[Callable[[], None]] = []

    def notify_all(self, wake_polls: bool = True) -> None:
        super().notify_all()
        if wake_polls:
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
    ready: bool = True  # False while the silo loads its images (JoinRequest.preparing): not sampled yet
    # The images the silo declared when it first joined ready: fixed for the run, it bounds the silo's weight (a
    # re-join may lower it, never raise it).
    declared_images: int | None = None
    serial: int | None = None  # the certificate serial of the silo's live session (None: --insecure-dev-only)
    polling: int = 0  # NextTask calls held open right now: a silo waiting in a long-poll is live
    # Left a round without reporting (dropped out, aborted, was refused): not sampled again until it polls again.
    dropped: bool = False
    told_done: bool = False  # has heard that the run is over
    # Left the run for a reason of its own (Leave: its policy refused the run, a task breached the pinned terms, its
    # privacy budget is spent): never sampled again in this run unless it joins again.
    left: Departure | None = None
    protocol_version: int = 0  # the wire protocol it joined with (0: older than protocol 2)
    connection: str = ""  # the gRPC peer address of its last Join: another one is a new process, news worth a line


@dataclass(frozen=True)
class Departure:
    """Why a silo left the run, as it said in its typed refusal (silo.v1.PolicyRefusal): checked and bounded text,
    and a clause from security.terms.CLAUSES (anything else is "other"), so the metrics' labels stay few."""

    kind: str  # "refused", "breach" or "budget"
    clause: str
    required: str
    offered: str
    message: str
    round: int
    at: float = field(default_factory=time.time)


class SiloRegistry:
    def __init__(self, cond: ChangeCondition, liveness_s: float = 60.0, audit: AuditLog | None = None,
                 quarantine: QuarantineList | None = None):
        self.cond = cond
        # Silos that broke a securely aggregated sum (silo_server/rounds/breaker.py): never sampled until lifted.
        self.quarantine = quarantine
        self.liveness_s = liveness_s
        self.audit = audit  # the hub's hash-chained record of joins, departures and refusals (None: not kept)
        self.silos: dict[str, SiloRecord] = {}
        self.refusals: dict[str, int] = {}
        self.refusals_by_silo: dict[tuple[str, str], int] = {}  # (silo, reason) -> count: who is refused, and why
        self.burst = BurstLog(60.0)
        # Silos' own refusals of the run, by (kind, clause): silokit_hub_silo_departures_total in /metrics.
        self.departures: dict[tuple[str, str], int] = {}
        self._audited_refusals: dict[tuple[str, str], tuple[float, int]] = {}
        # Monotonic event counts since this process started, read by silo_server/metrics.py at scrape time.
        self.counters: dict[str, int] = {}
        # Expiry of the hub's own certificate ("hub") and of each silo's (by silo id), as seen on the wire.
        self.cert_not_after: dict[str, dt.datetime] = {}
        self.declared_before: dict[str, int] = {}  # images each silo declared, from the checkpoint
        # Given a certificate serial, whether the CRL lists it now (HubApp sets it from the gate's CRL).
        self.is_revoked: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ refusals and counts
    def refuse(self, silo_id: str | None, code: str, reason: str, message: str) -> Refusal:
        # Messages may quote what a silo sent: escaped and cut, so no peer can write a line of its own into the log
        # or into the status it gets back.
        message = validation.printable(message, 300)
        self.count_refusal(reason, silo_id)
        who = validation.printable(silo_id or "?", 140)
        self.burst.warn((who, reason), lambda n: f"refused {reason} from {who}: {message}" + (
            f" ({n} such refusals since the last line; the next minute's are counted, not logged)" if n > 1 else ""))
        self.audit_refusal(silo_id, reason, message)
        return Refusal(code, reason, message)

    def audit_refusal(self, silo_id: str | None, reason: str, message: str, every_s: float = 60.0) -> None:
        """Into the hub's audit, once per silo and reason a minute with the count since the last record: a silo
        that repeats a refused call cannot fill the hub's disk through its audit."""
        if self.audit is None:
            return
        key, now = (silo_id or "?", reason), time.monotonic()
        with self.cond:
            last, count = self._audited_refusals.get(key, (-math.inf, 0))
            count += 1
            if now - last < every_s:
                self._audited_refusals[key] = (last, count)
                return
            self._audited_refusals[key] = (now, 0)
        self.audit.append("refusal", silo=validation.printable(silo_id or "?", 140), reason=reason, count=count,
                          message=message)
    def count_refusal(self, reason: str, silo_id: str | None = None) -> None:
        """Count a refusal whose logging the caller does itself (through `burst`), by reason and by silo."""
        with self.cond:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            if silo_id is not None:  # a name from a certificate the CA issued: a label set the CA bounds
                key = (silo_id, reason)
                self.refusals_by_silo[key] = self.refusals_by_silo.get(key, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        with self.cond:
            self.counters[name] = self.counters.get(name, 0) + n

    def validate(self, silo_id: str | None, check: Callable[[], Any]) -> Any:
        """Run a security.validation check; its failure becomes a counted, logged Refusal."""
        try:
            return check()
        except validation.Invalid as e:
            raise self.refuse(silo_id, e.code, e.reason, e.message) from None

    # ------------------------------------------------------------------ sessions
    @property
    def cert_days_left(self) -> dict[str, float]:
        """Days until each known certificate expires: "hub" for the hub's own, silo ids for the silos'."""
        return {name: days for name in list(self.cert_not_after) if (days := self.days_left(name)) is not None}

    def days_left(self, name: str) -> float | None:
        """Days until one certificate expires (None: not known); a join asks for its own, not for every silo's."""
        not_after = self.cert_not_after.get(name)
        return None if not_after is None else (not_after - dt.datetime.now(dt.UTC)).total_seconds() / 86400.0

    def touch(self, silo_id: str) -> SiloRecord:
        record = self.silos.get(silo_id)
        if record is None:
            raise self.refuse(silo_id, "FAILED_PRECONDITION", "not_joined", "silo has not joined this run; call Join")
        record.last_seen = time.time()
        return record

    def check_session(self, silo_id: str, serial: int | None) -> None:
        """One live session per identity: a call made with another certificate for the same name than the one the
        silo's session joined with is refused (see join)."""
        record = self.silos.get(silo_id)
        if serial is None or record is None or record.serial is None or record.serial == serial:
            return
        raise self.refuse(silo_id, "PERMISSION_DENIED", "second_certificate",
                          f"silo {silo_id} has a live session under another certificate (serial {record.serial:x}); "
                          f"one session per silo")

    def join(self, silo_id: str, num_unlabeled: int, num_labeled: int, device: str, skipped_images: int = 0,
             preparing: bool = False, serial: int | None = None, protocol_version: int = 0,
             connection: str = "") -> None:
        """Register a silo. A silo that is still `preparing` (loading its images, which needs the run's image size)
        is known but not sampled until it joins again ready.

        The images a silo declares the first time it joins ready are fixed for the run: they bound its weight, and a
        re-join can lower them but never raise them. A second certificate for the same name (`serial`) is refused
        while the first one's session is live, so it cannot take that silo's place or records. A Join that changes
        nothing the hub knows of the silo (same counts, state and certificate, on the same connection) is neither
        logged nor audited: a silo repeating Join cannot fill the hub's log, while a restarted one is still seen."""
        self.validate(silo_id, lambda: validation.check_join(num_unlabeled, num_labeled, device, skipped_images))
        with self.cond:
            known = self.silos.get(silo_id)
            record = known or SiloRecord(silo_id)
            before = (record.num_unlabeled, record.num_labeled, record.device, record.skipped_images, record.serial,
                      record.ready, record.left, record.protocol_version, record.connection, self.is_live(record))
            if serial is not None and record.serial is not None and record.serial != serial:
                if self.is_live(record):
                    old = record.serial
                    self.burst.warn((silo_id, "second_certificate_join"), lambda n: (
                        f"a second certificate for silo {silo_id} (serial {serial:x}) tried to join while the session "
                        f"of serial {old:x} is live: refused ({n} such tries since the last line); if both are "
                        f"yours, revoke the one you retire (`silo-certs revoke {old:x} --ca CA_DIR` revokes the "
                        f"live session's; `silo-certs revoke {serial:x} --ca CA_DIR` the newcomer's)"))
                    self.count("second_certificate")
                    raise self.refuse(silo_id, "ALREADY_EXISTS", "second_certificate",
                                      f"silo {silo_id} already has a live session under another certificate; "
                                      "one session per silo")
                log.info("silo %s now joins with certificate serial %x (was %x)", silo_id, serial, record.serial)
            if record.left is not None:
                log.info("silo %s joins again after leaving the run (%s: %s)", silo_id, record.left.kind,
                         record.left.clause)
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
            record.left = None
            record.protocol_version, record.connection = protocol_version, connection
            self.silos[silo_id] = record
            changed = known is None or before != (
                record.num_unlabeled, record.num_labeled, record.device, record.skipped_images, record.serial,
                record.ready, record.left, record.protocol_version, record.connection, True)
            self.cond.notify_all(wake_polls=False)  # the round loop may be waiting for silos; no poll's answer changes
        if not changed:
            return
        if self.audit is not None:
            self.audit.append("join", silo=silo_id, serial=f"{serial:x}" if serial is not None else None,
                              preparing=preparing, num_unlabeled=num_unlabeled, num_labeled=num_labeled,
                              protocol_version=protocol_version)
        if preparing:
            log.info("silo %s connected and is loading its images (%d unlabeled, %d labeled files); it is sampled "
                     "once it reports ready", silo_id, num_unlabeled, num_labeled)
            return
        days = self.days_left(silo_id)
        log.info("silo %s joined (%d unlabeled, %d labeled images, device %s%s)", silo_id, num_unlabeled,
                 num_labeled, device, "" if days is None else f", certificate expires in {days:.0f} days")
        if days is not None and days < CERT_WARN_DAYS:
            log.warning("the certificate of silo %s expires in %.1f days: renew it (`silo-certs renew %s`)",
                        silo_id, days, silo_id)

    def leave(self, silo_id: str, departure: Departure) -> bool:
        """A silo leaves the run for a reason of its own: not sampled again in this run (unless it joins again),
        logged once, counted by kind and clause. False when it had already left for the same reason (a
        repeated Leave is neither logged nor counted again)."""
        with self.cond:
            record = self.touch(silo_id)
            same = record.left is not None and (record.left.kind, record.left.clause) == (departure.kind,
                                                                                          departure.clause)
            record.left = departure
            if same:
                return False
            key = (departure.kind, departure.clause)
            self.departures[key] = self.departures.get(key, 0) + 1
            self.cond.notify_all(wake_polls=False)
        words = {"refused": "refuses the run's terms", "breach": "left the run after a task breached the pinned terms",
                 "budget": "left the run: its privacy budget is spent"}.get(departure.kind, "left the run")
        log.warning("silo %s %s (%s): %s", silo_id, words, departure.clause, departure.message)
        return True

    def quarantine_silo(self, entry: Quarantine) -> None:
        """Keep a silo that broke a securely aggregated sum out of the run until the operator lifts it."""
        if self.quarantine is None:
            return
        self.quarantine.add(entry)
        self.count("quarantined")
        log.warning("silo %s is quarantined: %s (round %d). It is not sampled again until you lift it: `silo-server "
                    "--config hub.yaml --lift-quarantine %s`; revoke its certificate if it is hostile", entry.silo,
                    entry.reason, entry.round, entry.silo)
        if self.audit is not None:
            self.audit.append("quarantine", silo=entry.silo, round=entry.round, attempts=entry.attempts,
                              reason=entry.reason)
        with self.cond:
            self.cond.notify_all(wake_polls=False)

    def departed(self) -> dict[str, Departure]:
        """The silos that left the run and why (for --check, the model card and the metrics)."""
        with self.cond:
            return {s: r.left for s, r in self.silos.items() if r.left is not None}

    def revoke(self, silo_id: str, in_round: bool) -> bool:
        """A silo whose certificate was revoked is never live again (its record stays for the model card). Call
        under the lock; `in_round` only words the log line. False when there was nothing left to revoke."""
        record = self.silos.get(silo_id)
        if record is None or (not record.last_seen and record.serial is None):
            return False
        if record.last_seen:
            log.warning("silo %s is revoked: it leaves the run%s", silo_id, " and its round" if in_round else "")
        record.last_seen = 0.0
        record.serial = None
        return True

    def revoked(self, silo_id: str) -> bool:
        """Whether the CRL now lists the certificate of the silo's live session."""
        record = self.silos.get(silo_id)
        return (self.is_revoked is not None and record is not None and record.serial is not None
                and self.is_revoked(record.serial))

    def start_poll(self, silo_id: str) -> None:
        """A silo begins a long-poll: it is live while it waits, and a silo that dropped out of a round may be
        sampled again now that it asks for work."""
        with self.cond:
            record = self.touch(silo_id)
            record.polling += 1
            if record.dropped:
                record.dropped = False
                self.cond.notify_all(wake_polls=False)  # may be sampled again: the round loop's concern only

    def end_poll(self, silo_id: str) -> None:
        with self.cond:
            record = self.silos.get(silo_id)
            if record is not None:
                record.polling = max(0, record.polling - 1)
                if record.last_seen:  # a revoked silo stays unheard of
                    record.last_seen = time.time()

    def tell_done(self, silo_id: str) -> None:
        record = self.silos.get(silo_id)
        if record is not None:
            record.told_done = True

    # ------------------------------------------------------------------ liveness
    def gone_for_good(self) -> set[str]:
        """Silos that will not be sampled again unless their operator acts: left by their policy, quarantined, or
        revoked (revoke leaves no last_seen and no serial; a new certificate's join sets both again). A silo that
        dropped out of a round, or is offline for a while, may come back by itself: not these."""
        kept_out = self.quarantine.names() if self.quarantine is not None else set()
        with self.cond:
            return {s for s, r in self.silos.items()
                    if r.left is not None or s in kept_out or (not r.last_seen and r.serial is None)}

    def live_silos(self) -> list[str]:
        """Silos that can be sampled: heard from within liveness_s and done preparing."""
        return self._heard_from(ready=True)

    def preparing_silos(self) -> list[str]:
        """Silos heard from within liveness_s that are still loading their images."""
        return self._heard_from(ready=False)

    def dropped_silos(self) -> int:
        """Live silos that left the last round and have not asked for work since."""
        return sum(1 for r in self.silos.values() if r.dropped and self.is_live(r))

    def _heard_from(self, ready: bool) -> list[str]:
        kept_out = self.quarantine.names() if self.quarantine is not None else set()
        return sorted(s for s, r in self.silos.items()
                      if r.ready == ready and not r.dropped and r.left is None and s not in kept_out
                      and self.is_live(r))

    def is_live(self, record: SiloRecord) -> bool:
        """Waiting in a long-poll right now, or heard from within liveness_s (a revoked silo never is)."""
        if not record.last_seen:
            return False
        return record.polling > 0 or time.time() - record.last_seen <= self.liveness_s

    def silos_not_told_done(self) -> list[str]:
        """Silos still live that have not heard the run is over (the app waits for them, up to server.linger_s)."""
        with self.cond:
            return sorted(s for s, r in self.silos.items()
                          if not r.told_done and r.left is None and self.is_live(r))

    # ------------------------------------------------------------------ what rounds record
    def declared_images(self) -> dict[str, int]:
        """Images each silo declared: fixed for the run, so the checkpoint keeps them for a restarted hub."""
        with self.cond:
            declared = dict(self.declared_before)
            declared.update({s: r.declared_images for s, r in self.silos.items() if r.declared_images is not None})
            return declared

    def weights(self, silo_ids: Iterable[str]) -> dict[str, int]:
        """The images each of these silos declared (1 when it declared none), for the round's weight caps."""
        with self.cond:
            return {s: self.silos[s].declared_images or 1 for s in silo_ids}

    def mark_dropped(self, silo_ids: Iterable[str]) -> None:
        """These silos left a round without reporting: not sampled again until they poll again."""
        with self.cond:
            for silo_id in silo_ids:
                record = self.silos.get(silo_id)
                if record is not None:
                    record.dropped = True

    def log_security(self) -> None:
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
