"""The hash-chained audit log (security/audit.py): the chain continues across processes and reopenings, and
verify_chain names every edited, removed or repeated record down to a single byte."""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import re

import pytest

from security.audit import (
    AUDIT_FILE,
    GENESIS,
    AuditError,
    AuditLog,
    read_records,
    record_hash,
    verify_chain,
)

HUB = {"serial": "1a2b", "fingerprint": "ab" * 32}


def silo_log(path, uploads: int = 3) -> AuditLog:
    """A small silo audit in the client's format: terms, join, a poll and `uploads` uploads."""
    log = AuditLog(path)
    log.append("terms", run="run-1", terms={"dp": {"noise": 1.1}, "note": "café ☃"}, terms_sha256="cd" * 32)
    log.append("join", hub=HUB, run="run-1", terms_sha256="cd" * 32)
    log.append("poll", hub=HUB, run="run-1")
    for r in range(1, uploads + 1):
        log.append("upload", hub=HUB, run="run-1", round=r, task="train",
                   tensors=[["delta/conv.weight", [8, 1, 3, 3], "float32"]], bytes=288 + r, sha256="ef" * 32,
                   terms_sha256="cd" * 32,
                   epsilon={"client": 0.5 * r, "sample": None, "image": 0.5 * r, "lifetime": 1e-05 * r})
    return log


def lines_of(path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def names_line(problems: list[str], n: int) -> bool:
    return any(p.startswith((f"line {n} ", f"line {n}:")) for p in problems)


# ---------------------------------------------------------------------------------------------- writing
def test_records_are_chained_and_hashed_over_canonical_json(tmp_path):
    path = tmp_path / "state" / AUDIT_FILE
    log = AuditLog(path)  # creates the folder and the file
    assert path.is_file() and path.read_bytes() == b"" and log.head == (0, GENESIS)
    first = log.append("join", hub=HUB, run="run-1")
    second = log.append("poll", hub=HUB, run="run-1", round=1)

    assert list(first) == ["seq", "time", "kind", "hub", "run", "prev", "hash"]
    assert (first["seq"], first["prev"], second["seq"], second["prev"]) == (1, GENESIS, 2, first["hash"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["time"])
    body = {k: v for k, v in second.items() if k != "hash"}
    expected = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=True).encode()).hexdigest()
    assert second["hash"] == record_hash(second) == expected
    assert [r for _, r in read_records(path)] == [first, second]
    assert log.head == (2, second["hash"])


def test_the_chain_continues_in_a_new_log_object_on_the_same_file(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=2)
    reopened = AuditLog(path)
    *_, last = read_records(path)
    assert reopened.head == (5, last[1]["hash"])
    rec = reopened.append("leave", run="run-1", clause="budget", message="done")
    assert (rec["seq"], rec["prev"]) == (6, last[1]["hash"])
    report = verify_chain(path)
    assert report.ok, report.problems
    assert (report.records, report.head) == (6, rec["hash"])
    assert report.kinds == {"terms": 1, "join": 1, "poll": 1, "upload": 2, "leave": 1}


def test_head_follows_appends_by_another_log_object(tmp_path):
    path = tmp_path / AUDIT_FILE
    a, b = AuditLog(path), AuditLog(path)
    a.append("poll")
    rec = b.append("poll")
    assert rec["seq"] == 2
    assert a.head == (2, rec["hash"])
    assert a.append("poll")["prev"] == rec["hash"]


def test_non_finite_floats_are_written_as_null(tmp_path):
    path = tmp_path / AUDIT_FILE
    rec = AuditLog(path).append("upload", epsilon={"client": math.inf, "sample": math.nan, "image": 2.5},
                                values=[1.0, -math.inf])
    assert rec["epsilon"] == {"client": None, "sample": None, "image": 2.5} and rec["values"] == [1.0, None]
    assert b"Infinity" not in path.read_bytes() and b"NaN" not in path.read_bytes()
    assert verify_chain(path).ok


@pytest.mark.parametrize("name", ["seq", "time", "kind", "prev", "hash"])
def test_a_field_named_like_the_chain_is_refused(tmp_path, name):
    path = tmp_path / AUDIT_FILE
    log = AuditLog(path)
    with pytest.raises(AuditError, match=f"{name!r}.*rename it"):
        log.append("upload", **{name: 1})
    assert path.read_bytes() == b""


def test_a_field_that_is_not_json_is_refused_by_name(tmp_path):
    path = tmp_path / AUDIT_FILE
    with pytest.raises(AuditError, match=r"field 'blob' of a upload record is not JSON-serialisable"):
        AuditLog(path).append("upload", run="r", blob=object())
    assert path.read_bytes() == b""


@pytest.mark.parametrize("damage, why", [
    (lambda data: data + b'{"seq": 9, "hash"\n', "is not a record"),
    (lambda data: data[:-1], "has no newline at its end"),
    (lambda data: data[:-4] + (b"9" if data[-4:-3] != b"9" else b"8") + data[-3:], "does not match its hash"),
])
def test_a_damaged_last_line_stops_the_log_and_names_the_file(tmp_path, damage, why):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=1)
    data = path.read_bytes()
    # the third case edits a hex digit of the last record's hash (the line ends ...<hash>"}\n)
    path.write_bytes(damage(data))
    with pytest.raises(AuditError) as err:
        AuditLog(path)
    assert str(path) in str(err.value) and why in str(err.value)
    assert f"silo-audit verify {tmp_path}" in str(err.value)


def test_a_log_damaged_behind_a_writers_back_is_not_appended_to(tmp_path):
    path = tmp_path / AUDIT_FILE
    log = silo_log(path, uploads=1)
    with open(path, "ab") as f:
        f.write(b'{"cut short')
    with pytest.raises(AuditError, match="no newline at its end"):
        log.append("poll")


# ---------------------------------------------------------------------------------------------- concurrency
def _append_many(path: str, worker: int, count: int, start) -> None:
    log = AuditLog(path)
    start.wait()
    for i in range(count):
        log.append("poll", worker=worker, i=i)


def test_two_processes_appending_at_once_keep_one_chain(tmp_path):
    path = tmp_path / AUDIT_FILE
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_append_many, args=(str(path), w, 150, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    report = verify_chain(path)
    assert report.ok, report.problems[:5]
    records = [r for _, r in read_records(path)]
    assert [r["seq"] for r in records] == list(range(1, 301))
    for w in range(2):
        assert [r["i"] for r in records if r["worker"] == w] == list(range(150))
    switches = sum(a["worker"] != b["worker"] for a, b in zip(records, records[1:], strict=False))
    assert switches > 2, "the workers did not overlap; the test proves nothing"


# ---------------------------------------------------------------------------------------------- verifying
def test_every_single_byte_edit_is_found_and_its_line_named(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=2)
    original = path.read_bytes()
    assert b"\\u00e9" in original and b"1e-05" in original  # escapes and exponents are there to be altered
    line_of = []
    for n, line in enumerate(lines_of(path), start=1):
        line_of += [n] * (len(line) + 1)
    checked = 0
    for pos in range(len(original)):
        for alter in (lambda b: b ^ 0x01, lambda b: b ^ 0x20, lambda b: ord(" ") if b != ord(" ") else ord("x")):
            edited = bytearray(original)
            edited[pos] = alter(original[pos])
            path.write_bytes(bytes(edited))
            report = verify_chain(path)
            assert not report.ok, f"byte {pos} ({original[pos:pos + 1]!r}) altered went unnoticed"
            assert names_line(report.problems, line_of[pos]), (pos, report.problems)
            checked += 1
    assert checked == 3 * len(original) > 3000


def test_what_each_kind_of_edit_is_called(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=2)
    lines = lines_of(path)

    def verify_with(n: int, line: bytes) -> list[str]:
        path.write_bytes(b"\n".join([*lines[:n - 1], line, *lines[n:]]) + b"\n")
        return verify_chain(path).problems

    # a value (the bytes of upload round 1, line 4)
    assert verify_with(4, lines[3].replace(b'"bytes":289', b'"bytes":389')) == [
        "line 4 (seq 4, kind upload): its content does not match its hash: edited after it was written"]
    # a key
    assert verify_with(4, lines[3].replace(b'"task"', b'"tusk"')) == [
        "line 4 (seq 4, kind upload): its content does not match its hash: edited after it was written"]
    # the hash itself: named once, at its own line, not again at the next line's link
    stored = json.loads(lines[3])["hash"]
    other = stored[:10] + ("0" if stored[10] != "0" else "1") + stored[11:]
    assert verify_with(4, lines[3].replace(stored.encode(), other.encode())) == [
        "line 4 (seq 4, kind upload): its content does not match its hash: edited after it was written"]
    # the same content written differently (an escape in upper case)
    assert verify_with(1, lines[0].replace(b"\\u00e9", b"\\u00E9")) == [
        "line 1 (seq 1, kind terms): its bytes differ from how this log writes its content: edited after it "
        "was written"]
    # a record rewritten with a hash recomputed to match: found at the link from the next record
    rec = json.loads(lines[3])
    rec["bytes"] = 1
    rec["hash"] = record_hash(rec)
    problems = verify_with(4, json.dumps(rec, separators=(",", ":")).encode())
    assert len(problems) == 1 and problems[0].startswith(
        "line 5 (seq 5, kind upload): its prev does not match the hash of the record before it (line 4 (seq 4, "
        "kind upload))")


def test_a_deleted_middle_line_is_found(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=3)
    lines = lines_of(path)
    path.write_bytes(b"\n".join(lines[:2] + lines[3:]) + b"\n")  # line 3 (the poll, seq 3) removed
    report = verify_chain(path)
    assert report.records == 5
    assert report.problems == [
        "line 3 (seq 4, kind upload): its prev does not match the hash of the record before it (line 2 (seq 2, "
        "kind join)): a record was removed, inserted, reordered or rewritten before it",
        "line 3 (seq 4, kind upload): seq jumps from 2 to 4: 1 record(s) missing before it"]


def test_a_repeated_line_and_a_cut_last_line_are_found(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=1)
    lines = lines_of(path)
    path.write_bytes(b"\n".join([*lines[:3], lines[2], *lines[3:]]) + b"\n")
    problems = verify_chain(path).problems
    assert problems == [
        "line 4 (seq 3, kind poll): its prev does not match the hash of the record before it (line 3 (seq 3, kind "
        "poll)): a record was removed, inserted, reordered or rewritten before it",
        "line 4 (seq 3, kind poll): seq 3 repeats or goes back (the record before it has seq 3): a record was "
        "copied or reordered"]  # line 5 (seq 4) links to seq 3's hash, which the copy has too

    path.write_bytes(b"\n".join(lines) + b"\n" + lines[0][:20])
    report = verify_chain(path)
    assert report.records == 4
    assert report.problems[0].startswith("line 5: not a record: it is not JSON")


def test_a_truncated_end_is_a_shorter_valid_chain_with_another_head(tmp_path):
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=3)
    full = verify_chain(path)
    path.write_bytes(b"\n".join(lines_of(path)[:-1]) + b"\n")
    cut = verify_chain(path)
    assert cut.ok and (cut.records, full.records) == (5, 6) and cut.head != full.head


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_a_number_this_log_never_writes_is_named_and_the_rest_still_verified(tmp_path, value):
    # Its canonical hash cannot be taken: the verifier raised a bare ValueError and checked nothing after it.
    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=2)
    lines = lines_of(path)
    upload = [i for i, line in enumerate(lines) if b'"kind":"upload"' in line][0]
    edited = re.sub(rb'"bytes":\d+', b'"bytes":' + value, lines[upload])
    assert edited != lines[upload]
    path.write_bytes(b"\n".join([*lines[:upload], edited, *lines[upload + 1:]]) + b"\n")
    report = verify_chain(path)
    assert report.records == len(lines) - 1 and report.head == json.loads(lines[-1])["hash"]
    assert report.problems[0].startswith(f"line {upload + 1}: not a record: it is not JSON (")
    assert len(report.problems) == 1  # the line after it links to it by its stored hash: not reported again
    last = len(lines) - 1
    path.write_bytes(b"\n".join([*lines[:last], re.sub(rb'"bytes":\d+', b'"bytes":' + value, lines[last])]) + b"\n")
    with pytest.raises(AuditError, match="is not a record"):  # a damaged last line stops a writer, by name
        AuditLog(path)


def test_a_missing_file_and_an_unreadable_line(tmp_path):
    missing = tmp_path / "nowhere" / AUDIT_FILE
    report = verify_chain(missing)
    assert not report.ok and report.records == 0 and str(missing) in report.problems[0]
    with pytest.raises(AuditError, match="does not exist"):
        list(read_records(missing))

    path = tmp_path / AUDIT_FILE
    silo_log(path, uploads=1)
    lines = lines_of(path)
    path.write_bytes(b"\n".join([lines[0], b"[1, 2]", *lines[1:]]) + b"\n")
    with pytest.raises(AuditError, match=rf"{re.escape(str(path))} line 2 is not a record: .*silo-audit verify"):
        list(read_records(path))
    problems = verify_chain(path).problems
    assert problems[0] == "line 2: not a record: it is JSON but not a record (a list)"
