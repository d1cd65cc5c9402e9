"""The revocation list the hub enforces, re-read from disk whenever the file changes.

gRPC Python has no hook to check a CRL during the TLS handshake, so the hub checks the serial of the caller's
verified certificate against this list on every call instead (security.gate). That is also stronger than a
handshake check: HTTP/2 connections live for hours, and a certificate revoked after its connection was opened is
refused from its very next call.

The file is stat()ed on every lookup (microseconds) and parsed again only when its mtime, size or inode change,
so "copy the new crl.pem over the old one" is all an operator does. A replacement that does not parse or is not
signed by the federation CA is ignored with an error in the log: the hub keeps enforcing the last good list
(corrupting the file must never un-revoke anyone).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from security.pki import PkiError, parse_crl

log = logging.getLogger("security")

# A stale CRL is still enforced (refusing everyone would stop the federation) but the operator is told, this often.
_STALE_WARNING_EVERY_S = 3600.0
_CHECKED_KEPT = 16  # distinct (CRL, CA) pairs whose checked contents are kept per process


class _CheckedLists:
    """What a CRL signed by a CA says (its revoked serials, next and last update), by the exact bytes of both files. A
    silo-sim host's hundreds of silos each read their own copy of one CA's list; the same bytes always give the
    same answer, so its signature is checked once per process instead of once per silo."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[bytes, bytes], Checked] = {}

    def check(self, crl_pem: bytes, ca_pem: bytes, where: str) -> Checked:
        with self._lock:
            known = self._kept.get((crl_pem, ca_pem))
        if known is not None:
            return known
        crl = parse_crl(crl_pem, ca_pem, where)  # PkiError naming `where` when it does not parse or verify
        known = Checked(frozenset(r.serial_number for r in crl), crl.next_update_utc, crl.last_update_utc, ca_pem)
        with self._lock:
            if len(self._kept) >= _CHECKED_KEPT:
                self._kept.clear()
            self._kept[(crl_pem, ca_pem)] = known
        return known


_CHECKED = _CheckedLists()


@dataclass(frozen=True)
class Checked:
    revoked: frozenset[int]
    next_update: dt.datetime | None
    last_update: dt.datetime
    ca_pem: bytes

    def rolls_back(self, enforced: Checked) -> str | None:
        """Why this list may not replace `enforced` (None: it may). Under one CA a revocation is for good: a list
        signed earlier, or one that leaves out a serial the enforced list holds (an old bundle's crl.pem copied
        back), would un-revoke a certificate."""
        if self.ca_pem != enforced.ca_pem:
            return None  # another CA: its serials are another numbering
        if self.last_update < enforced.last_update:
            return (f"it was signed {self.last_update:%Y-%m-%d %H:%M} UTC, before the enforced list "
                    f"({enforced.last_update:%Y-%m-%d %H:%M} UTC)")
        dropped = enforced.revoked - self.revoked
        if dropped:
            shown = ", ".join(f"{s:x}" for s in sorted(dropped)[:3])
            return f"it leaves out {len(dropped)} revoked certificate(s) ({shown})"
        return None


class CrlError(ValueError):
    """The CRL cannot be used at start; the message names the file and what to do."""


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class RevocationList:
    """Serials revoked by the federation CA, from ``crl_path``, verified against the CA certificate ``ca_path``."""

    def __init__(self, crl_path: Path, ca_path: Path, where_set: str = "point security.crl at it"):
        self.crl_path, self.ca_path = Path(crl_path), Path(ca_path)
        self._lock = threading.Lock()
        self._seen: tuple | None = None  # file signatures of the last load attempt, good or bad
        self._revoked: frozenset[int] = frozenset()
        self._enforced: Checked | None = None
        self.next_update: dt.datetime | None = None
        self.loaded_at = 0.0
        self.reloads = 0
        self.reload_failures = 0
        self._stale_warned_at = 0.0
        seen = self._signatures()
        try:
            self._load(seen)
        except (OSError, PkiError) as e:
            raise CrlError(
                f"cannot use the revocation list {self.crl_path}: {e}. Copy crl.pem from the CA directory "
                f"(`silo-certs crl --ca CA_DIR` re-signs it) or {where_set}"
            ) from None

    @property
    def revoked_serials(self) -> frozenset[int]:
        return self._revoked

    def _signatures(self) -> tuple:
        return (_signature(self.crl_path), _signature(self.ca_path))

    def _load(self, seen: tuple) -> None:
        # Stat before reading (the caller did): if the file changes after the read, the next stat differs and
        # the next lookup loads it again, so a copy that was half-written when we read it is picked up later.
        self._seen = seen
        checked = _CHECKED.check(self.crl_path.read_bytes(), self.ca_path.read_bytes(), str(self.crl_path))
        why = checked.rolls_back(self._enforced) if self._enforced is not None else None
        if why is not None:
            raise PkiError(f"it would lift revocations: {why}; copy the newest crl.pem from the CA directory "
                           "(`silo-certs crl --ca CA_DIR` re-signs it)")
        self._enforced, self._revoked, self.next_update = checked, checked.revoked, checked.next_update
        self.loaded_at = time.time()

    def refresh(self) -> None:
        """Reload the file if it changed since the last attempt; keep the last good list if it is unusable."""
        seen = self._signatures()
        if seen == self._seen:
            return
        with self._lock:
            if seen == self._seen:  # another thread got here first
                return
            before = len(self._revoked)
            try:
                self._load(seen)
            except (OSError, PkiError) as e:
                self.reload_failures += 1
                log.error("revocation list %s changed but cannot be used (%s); still enforcing the previous list "
                          "of %d revoked certificates", self.crl_path, " ".join(str(e).split()), before)
                return
            self.reloads += 1
            log.warning("revocation list %s reloaded: %d revoked certificates (was %d)", self.crl_path,
                        len(self._revoked), before)

    def is_revoked(self, serial: int) -> bool:
        self.refresh()
        self._warn_if_stale()
        return serial in self._revoked

    def _warn_if_stale(self) -> None:
        if self.next_update is None or dt.datetime.now(dt.UTC) < self.next_update:
            return
        now = time.monotonic()
        if now - self._stale_warned_at < _STALE_WARNING_EVERY_S and self._stale_warned_at:
            return
        self._stale_warned_at = now
        log.warning("revocation list %s is past its next update (%s): re-sign it with `silo-certs crl --ca CA_DIR` "
                    "and copy it here; still enforcing its %d revocations", self.crl_path,
                    f"{self.next_update:%Y-%m-%d}", len(self._revoked))
