"""An append-only, hash-chained audit log (JSON lines), kept by a silo and by the hub in their state folders.

A silo must be able to prove afterwards what left it: every message is recorded here BEFORE it is sent, so a
message without a record cannot have been sent by this code. Each line is one record

    {"seq": n, "time": "2024-05-01T12:00:00.123Z", "kind": ..., **fields, "prev": <hash of record n-1>, "hash": ...}

where `hash` is the sha256 of the record's canonical JSON without `hash` (record_hash) and `prev` is the hash of
the record before it (GENESIS for the first). Editing, removing, inserting or reordering any record therefore
breaks either its own hash or the link from the record after it; verify_chain names every such place. Each line
must also be byte for byte the JSON this module writes for its content, so an edit that leaves the parsed content
alone (an escape's hex digit in upper case, an exponent's `e` as `E`, a space after the record) is found too.

What the chain cannot show by itself: records cut off at the end (a truncated file is a valid shorter chain).
Keep the head hash elsewhere (`silo-audit report` prints it) to detect that later.

Writers: `AuditLog.append` takes an exclusive flock on the file, reads the current last record (another process
may have appended since), writes one line and fsyncs it before returning, so concurrent writers keep one chain
and a record that `append` returned is on disk. No gRPC or torch here: the hub and the tools import it freely.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

AUDIT_FILE = "audit.jsonl"
GENESIS = "0" * 64
RESERVED = ("seq", "time", "kind", "prev", "hash")  # the chain's own fields; a caller's field may not take them
_TAIL_CHUNK = 64 * 1024
_HEX = frozenset("0123456789abcdef")


class AuditError(ValueError):
    """The audit log cannot be written or read as a chain; the message names the file (and line) and what to do."""


# ---------------------------------------------------------------------------------------------- encoding
def _canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _line(record: Mapping[str, Any]) -> bytes:
    """A record as written: its own key order, compact, ASCII only (so a stray byte is easy to spot)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def record_hash(record: Mapping[str, Any]) -> str:
    """sha256 hex of the record's canonical JSON (sorted keys, no spaces, ASCII) without its `hash` field."""
    return hashlib.sha256(_canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: non-finite floats become null (an epsilon of inf is written as null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _is_hash(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------- reading
def _iter_file_lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """The file's lines, streamed (an audit of months of polls does not have to fit in memory)."""
    number, pending = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                number += 1
                yield number, raw, True
    if pending:
        yield number + 1, pending, False


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is out of range")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number this log writes")


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) or (None, why the line is not a record). NaN, Infinity and numbers beyond a float's range
    make a line no record: this log never writes them, and its hash (canonical JSON) could not be computed."""
    try:
        record = json.loads(raw.decode("ascii"), parse_float=_finite_number, parse_constant=_no_constant)
    except UnicodeDecodeError:
        return None, "it holds a byte that is not ASCII (this log writes ASCII only)"
    except ValueError as err:
        return None, f"it is not JSON ({err})"
    if not isinstance(record, dict):
        return None, f"it is JSON but not a record (a {type(record).__name__})"
    return record, None


def _describe(number: int, record: Mapping[str, Any]) -> str:
    return f"line {number} (seq {record.get('seq')}, kind {record.get('kind')})"


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every line. Checks nothing of the chain (verify_chain does); a line that is not
    a JSON record raises AuditError naming it."""
    path = Path(path)
    if not path.is_file():
        raise AuditError(f"audit log {path} does not exist; check the state folder")
    for number, raw, _ in _iter_file_lines(path):
        record, why = _parse(raw)
        if record is None:
            raise AuditError(f"audit log {path} line {number} is not a record: {why}; run `silo-audit verify "
                             f"{path.parent}` to list every problem")
        yield number, record


# ---------------------------------------------------------------------------------------------- verifying
@dataclass
class ChainReport:
    """What verify_chain found: records read, the last record's hash, every problem, records per kind."""

    records: int
    head: str
    problems: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_chain(path: Path, visit: Callable[[int, dict[str, Any]], None] | None = None) -> ChainReport:
    """Check every line of an audit log and name every problem: a line that is not a record, a record not as
    this module writes it, a hash that does not match the content, a broken link, a gap or repeat in seq, a cut
    last line. Reading goes on after a problem so that all of them are listed. `visit(line, record)` is called
    for every parsed record (the caller's own checks, without holding the whole file in memory).

    After an unreadable line, the next record's link and seq cannot be checked against it and are taken as
    they are. A link is accepted when `prev` equals either the stored or the recomputed hash of the record
    before, so an edit is reported once, at the edited line, not again at the line after it."""
    path = Path(path)
    report = ChainReport(records=0, head=GENESIS)
    if not path.is_file():
        report.problems.append(f"{path} does not exist: no audit log in this folder")
        return report
    prev_hashes: tuple[str, ...] = (GENESIS,)
    prev_seq: int | None = 0
    prev_where = "the start of the log"
    for number, raw, terminated in _iter_file_lines(path):
        record, why = _parse(raw)
        if record is None:
            report.problems.append(f"line {number}: not a record: {why}")
            prev_hashes, prev_seq = (), None  # unknown: resynchronise on the next readable record
            prev_where = f"line {number}"
            continue
        report.records += 1
        where = _describe(number, record)
        kind = record.get("kind")
        report.kinds[str(kind)] = report.kinds.get(str(kind), 0) + 1
        if visit is not None:
            visit(number, record)
        if not terminated:
            report.problems.append(f"{where}: the last line has no newline: its write was cut short, or the file "
                                   "was edited")
        seq, stored, prev = record.get("seq"), record.get("hash"), record.get("prev")
        missing = [k for k in RESERVED if k not in record]
        malformed = (not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(kind, str)
                     or not isinstance(record.get("time"), str) or not _is_hash(stored) or not _is_hash(prev))
        if missing or malformed:
            what = f"lacks {', '.join(missing)}" if missing else "has a malformed seq, time, kind, prev or hash"
            report.problems.append(f"{where}: {what}: not a record of this log, or edited after it was written")
            prev_hashes, prev_seq, prev_where = ((stored,) if isinstance(stored, str) else ()), None, where
            report.head = stored if isinstance(stored, str) else report.head
            continue
        actual = record_hash(record)
        try:
            canonical_line = _line(record)
        except ValueError:  # NaN or Infinity in the line: this log never writes them
            canonical_line = b""
        if actual != stored:
            report.problems.append(f"{where}: its content does not match its hash: edited after it was written")
        elif canonical_line != raw:
            report.problems.append(f"{where}: its bytes differ from how this log writes its content: edited after "
                                   "it was written")
        if prev_hashes and prev not in prev_hashes:
            report.problems.append(f"{where}: its prev does not match the hash of the record before it "
                                   f"({prev_where}): a record was removed, inserted, reordered or rewritten "
                                   "before it")
        if prev_seq is not None and seq != prev_seq + 1:
            if seq > prev_seq + 1:
                report.problems.append(f"{where}: seq jumps from {prev_seq} to {seq}: {seq - prev_seq - 1} "
                                       "record(s) missing before it")
            else:
                report.problems.append(f"{where}: seq {seq} repeats or goes back (the record before it has seq "
                                       f"{prev_seq}): a record was copied or reordered")
        prev_hashes, prev_seq, prev_where = tuple(dict.fromkeys((stored, actual))), seq, where
        report.head = stored
    return report


# ---------------------------------------------------------------------------------------------- writing
class AuditLog:
    """Appends records to one audit file. Opening reads only the last line, so it costs the same for a log of
    ten records or ten million; the chain as a whole is checked by verify_chain (`silo-audit verify`)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._size = -1  # file size when the head was last read or written; another size means re-read it
        self._head: tuple[int, str] = (0, GENESIS)
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.fsync(fd)
            os.close(fd)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:  # the new file's name must survive a crash too
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._reread()

    def _damaged(self, why: str) -> AuditError:
        return AuditError(f"audit log {self.path} cannot be continued: its last line {why}. Nothing more is "
                          f"recorded (or sent) until it is repaired; run `silo-audit verify {self.path.parent}` "
                          "to see every problem, and keep the file as it is for the investigation")

    def _refresh(self, f: Any) -> None:
        """Read the head from the file's last line unless the file is as this object last left it."""
        size = os.fstat(f.fileno()).st_size
        if size == self._size:
            return
        if size == 0:
            self._head, self._size = (0, GENESIS), 0
            return
        start, tail = size, b""
        while start > 0 and b"\n" not in tail[:-1]:
            start = max(0, start - _TAIL_CHUNK)
            f.seek(start)
            tail = f.read(size - start)
        if not tail.endswith(b"\n"):
            raise self._damaged("has no newline at its end (a write was cut short, or the file was edited)")
        last = tail[:-1].rsplit(b"\n", 1)[-1]
        record, why = _parse(last)
        if record is None:
            raise self._damaged(f"is not a record: {why}")
        seq, stored = record.get("seq"), record.get("hash")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1 or not _is_hash(stored):
            raise self._damaged("has no valid seq and hash")
        if record_hash(record) != stored:
            raise self._damaged(f"(seq {seq}) does not match its hash: it was edited after it was written")
        self._head, self._size = (seq, stored), size

    @property
    def head(self) -> tuple[int, str]:
        """(seq of the last record, its hash); (0, GENESIS) for an empty log. Re-read when another process has
        appended since."""
        self._reread()
        return self._head

    def _reread(self) -> None:
        with open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            try:
                self._refresh(f)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def append(self, kind: str, /, **fields: Any) -> dict[str, Any]:
        """Write one record and return it once it is on disk (flushed and fsynced). Fields must be
        JSON-serialisable; non-finite floats are written as null (JSON has no inf or NaN)."""
        if not isinstance(kind, str) or not kind:
            raise AuditError(f"audit log {self.path}: a record's kind must be a non-empty string, got {kind!r}")
        reserved = [k for k in fields if k in RESERVED]
        if reserved:
            raise AuditError(f"audit log {self.path}: field {reserved[0]!r} of a {kind} record is the chain's own "
                             f"({', '.join(RESERVED)}); rename it")
        body = _finite(fields)
        try:  # round trip once so the record hashed is exactly what a reader will parse
            body = json.loads(json.dumps(body, allow_nan=False))
        except (TypeError, ValueError) as err:
            bad = next((k for k, v in fields.items() if not _serialisable(v)), "?")
            raise AuditError(f"audit log {self.path}: field {bad!r} of a {kind} record is not JSON-serialisable "
                             f"({err}); pass numbers, strings, lists or dicts") from None
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                self._refresh(f)
                seq, prev = self._head
                record: dict[str, Any] = {"seq": seq + 1, "time": _now(), "kind": kind, **body, "prev": prev}
                record["hash"] = record_hash(record)
                f.write(_line(record) + b"\n")
                f.flush()
                os.fsync(f.fileno())
                self._head, self._size = (record["seq"], record["hash"]), os.fstat(f.fileno()).st_size
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return record


def _serialisable(value: Any) -> bool:
    try:
        json.dumps(_finite(value), allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
