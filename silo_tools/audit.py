"""silo-audit: check and summarise the audit log of a silo's (or the hub's) state folder.

`silo-audit verify STATE_DIR` checks the hash chain of STATE_DIR/audit.jsonl and, in a silo's folder (one with a
privacy-ledger.json), that the audit and the ledger tell the same story: every round the ledger charges has an
audited upload (or secure-aggregation masked input) with the ledger's epsilon figures, and every audited upload
carrying an epsilon has its round in the ledger. A round in the ledger without an audited upload means something
left unaudited (or records were lost); an audited upload without a ledger round means privacy spent but not
counted. Exit 0: intact; 1: problems (each printed); 2: no such folder or file.

`silo-audit report STATE_DIR` writes what a privacy officer files: per run, when, with which hub (certificate
serial and fingerprint), under which terms (sha256), rounds contributed, messages and bytes by kind, the final
epsilons and refusals; and the chain's head hash and record count, so that a later check of the same folder can
tell whether the audit was cut short since (the chain alone cannot show records removed from its end).

Reads only; imports no torch, gRPC or hub code, so it runs anywhere the state folder can be copied to.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from security.audit import AUDIT_FILE, ChainReport, verify_chain
from silo_client.ledger import EPSILON_KEYS, LEDGER_FILE, RELEASE, LedgerError, read_ledger

SENT_WITH_EPSILON = ("upload", "secagg:masked_input")  # the messages that carry a silo's update
NO_RUN = "(no run)"


def error(message: str) -> int:
    """The one-line error of a usage problem (exit status 2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="silo-audit",
        description="Verify or summarise the hash-chained audit log (audit.jsonl) of a silokit state folder: a "
                    "silo's (checked against its privacy ledger too) or the hub's.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{verify,report}")
    v = sub.add_parser("verify", help="check the chain (and, in a silo's folder, agreement with its privacy "
                       "ledger); exit 0 intact, 1 problems, 2 no such folder or file")
    v.add_argument("state_dir", metavar="STATE_DIR", type=Path, help="the silo's or hub's state folder")
    r = sub.add_parser("report", help="per-run summary for the privacy officer: hub, terms, rounds, messages, "
                       "bytes, epsilons, refusals, and the chain head; exit 1 (report still written) when the "
                       "chain has problems or the privacy ledger is unreadable")
    r.add_argument("state_dir", metavar="STATE_DIR", type=Path, help="the silo's or hub's state folder")
    r.add_argument("--format", choices=("markdown", "csv"), default="markdown",
                   help="markdown (default) or csv (one row per run)")
    r.add_argument("--out", type=Path, help="write the report to this file (default: standard output)")
    return p


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Audited:
    """One audited upload or masked input that belongs to a (run, round)."""

    line: int
    seq: Any
    kind: str
    epsilon: Any  # the record's `epsilon` field; MISSING when it has none
    where: str = ""

    def __post_init__(self) -> None:
        self.where = f"line {self.line} (seq {self.seq}, kind {self.kind})"


MISSING = object()


@dataclass
class RunStats:
    """What the audit says about one run, gathered while the chain is read."""

    first: str | None = None
    last: str | None = None
    hubs: dict[tuple[str, str], None] = field(default_factory=dict)  # (serial, fingerprint), in order seen
    terms: dict[str, None] = field(default_factory=dict)
    rounds: set[int] = field(default_factory=set)
    kinds: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    refusals: list[str] = field(default_factory=list)
    epsilon: dict[str, Any] | None = None  # the last audited epsilon figures


class Collector:
    """Visits every record once (verify_chain's `visit`), keeping only what the checks and the report need."""

    def __init__(self) -> None:
        self.sent: dict[tuple[str, int, str, int], list[Audited]] = {}  # (run, round, task, release) -> records
        self.runs: dict[str, RunStats] = {}

    def visit(self, line: int, record: dict[str, Any]) -> None:
        kind = str(record.get("kind"))
        run = record.get("run")
        run_id = NO_RUN if run is None else str(run)
        stats = self.runs.setdefault(run_id, RunStats())
        time = record.get("time")
        if isinstance(time, str):
            stats.first = time if stats.first is None else min(stats.first, time)
            stats.last = time if stats.last is None else max(stats.last, time)
        hub = record.get("hub")
        if isinstance(hub, dict):
            stats.hubs[(str(hub.get("serial", "")), str(hub.get("fingerprint", "")))] = None
        terms = record.get("terms_sha256")
        if isinstance(terms, str):
            stats.terms[terms] = None
        stats.kinds[kind] += 1
        size = record.get("bytes")
        if isinstance(size, int) and not isinstance(size, bool):
            stats.bytes[kind] += size
        if kind == "refusal" or (kind == "leave" and ("clause" in record or "message" in record)):
            stats.refusals.append(f"{kind} {record.get('clause', '-')}: {record.get('message', '')}".strip())
        rnd = record.get("round")
        if kind in SENT_WITH_EPSILON and run is not None and isinstance(rnd, int) and not isinstance(rnd, bool):
            stats.rounds.add(rnd)
            key = (run_id, rnd, str(record.get("task") or ""), _release(record.get("epsilon")))
            self.sent.setdefault(key, []).append(Audited(line, record.get("seq"), kind, record.get("epsilon", MISSING)))
            if isinstance(record.get("epsilon"), dict):
                stats.epsilon = record["epsilon"]


def scan(audit: Path) -> tuple[ChainReport, Collector]:
    collector = Collector()
    return verify_chain(audit, visit=collector.visit), collector


def _release(figures: Any) -> int:
    """Which of its task's charged releases an audited message belongs to (records and ledgers written before
    releases were numbered had one release a task)."""
    release = figures.get(RELEASE, 1) if isinstance(figures, dict) else 1
    return release if isinstance(release, int) and not isinstance(release, bool) else 0


def _same(ledger: float | None, audited: Any) -> bool:
    """The audit writes non-finite floats as null, so null stands for None and for inf alike."""
    if audited is None:
        return ledger is None or math.isinf(ledger)
    if ledger is None or isinstance(audited, bool) or not isinstance(audited, int | float):
        return False
    return math.isclose(ledger, audited, rel_tol=1e-9, abs_tol=1e-12)


def _ledger_value(value: Any) -> float | None:
    return None if value is None else (math.inf if value == "inf" else float(value))


def _show(value: Any) -> str:
    return "null" if value is None else repr(value)


def _charge(key: tuple[str, int, str, int]) -> str:
    run_id, round_number, _, release = key
    return f"run {run_id} round {round_number}" + (f" (release {release} of its task)" if release != 1 else "")


def agreement(ledger: dict[str, Any], collector: Collector) -> tuple[list[str], int]:
    """Where the audit and the ledger disagree, and how many ledger rounds were checked."""
    problems: list[str] = []
    charged: set[tuple[str, int, str, int]] = set()
    for run_id, run in ledger["runs"].items():
        for entry in run["rounds"]:
            key = (run_id, entry["round"], str(entry.get("task") or ""), entry.get(RELEASE, 1))
            charged.add(key)
            sent = collector.sent.get(key)
            if not sent:
                problems.append(f"{_charge(key)}: the ledger charges this round but the audit "
                                f"has no {' or '.join(SENT_WITH_EPSILON)} record for it: it was sent unaudited, or "
                                "the audit lost records")
                continue
            for rec in sent:
                if rec.epsilon is MISSING or rec.epsilon is None:
                    continue
                if not isinstance(rec.epsilon, dict):
                    problems.append(f"{rec.where}: {_charge(key)}: its epsilon is not a record "
                                    f"of {', '.join(EPSILON_KEYS)}")
                    continue
                for k in EPSILON_KEYS:
                    mine, theirs = _ledger_value(entry.get(k)), rec.epsilon.get(k)
                    if not _same(mine, theirs):
                        problems.append(f"{rec.where}: {_charge(key)}: epsilon.{k} is "
                                        f"{_show(theirs)} but the ledger has {_show(mine)}")
    for key, sent in sorted(collector.sent.items()):
        if key in charged:
            continue
        for rec in sent:
            if rec.epsilon is not MISSING and rec.epsilon is not None:
                problems.append(f"{rec.where}: {_charge(key)} carries an epsilon but the ledger has no such round (or "
                                "task, or release of it): privacy spent that the ledger does not count")
    return problems, len(charged)


def _kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"


def _folder(state_dir: Path) -> Path | int:
    if not state_dir.is_dir():
        return error(f"{state_dir} is not a folder; give the state folder of a silo (silo-client --state-dir) or "
                     "of the hub")
    audit = state_dir / AUDIT_FILE
    if not audit.is_file():
        return error(f"{audit} does not exist: {state_dir} holds no audit log; check that this is a state folder "
                     "of silokit with auditing")
    return audit


# ---------------------------------------------------------------------------------------------- verify
def verify(state_dir: Path) -> int:
    audit = _folder(state_dir)
    if isinstance(audit, int):
        return audit
    report, collector = scan(audit)
    problems = list(report.problems)
    ledger_path = state_dir / LEDGER_FILE
    tail = "no privacy ledger here (a hub's folder): the chain alone was checked"
    if ledger_path.is_file():
        try:
            ledger = read_ledger(ledger_path)
        except LedgerError as err:
            problems.append(str(err))
        else:
            found, rounds = agreement(ledger, collector)
            problems += found
            tail = f"agrees with the ledger ({rounds} rounds in {len(ledger['runs'])} runs)"
    if problems:
        for p in problems:
            print(f"error: {p}")
        print(f"audit {audit} NOT intact: {len(problems)} problem(s) in {report.records} records, chain head "
              f"{report.head}")
        return 1
    print(f"audit intact: {report.records} records (by kind {_kinds(report.kinds)}), chain head {report.head}; "
          f"{tail}")
    return 0


# ---------------------------------------------------------------------------------------------- report
def _fmt(value: float | None, digits: int | None = 4) -> str:
    if value is None:
        return "-" if digits is not None else ""
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}" if digits is not None else repr(float(value))


@dataclass
class RunRow:
    run: str
    first: str
    last: str
    hub_serial: str
    hub_fingerprint: str
    terms_sha256: str
    rounds: int
    kinds: dict[str, int]
    bytes: dict[str, int]
    client: float | None
    sample: float | None
    image: float | None
    lifetime: float | None
    delta: float | None
    refusals: list[str]
    leaves: list[str]


def rows(collector: Collector, ledger: dict[str, Any] | None) -> list[RunRow]:
    """One row per run seen in the audit or the ledger. Epsilons and rounds come from the ledger when there is
    one (what the silo was charged), else from the last audited epsilon and the audited rounds."""
    ledger_runs = ledger["runs"] if ledger else {}
    out = []
    for run_id in list(dict.fromkeys([*collector.runs, *ledger_runs])):
        stats = collector.runs.get(run_id, RunStats())
        run = ledger_runs.get(run_id)
        hubs = list(stats.hubs)
        if run and isinstance(run.get("hub"), dict) and not hubs:
            hubs = [(str(run["hub"].get("serial")), str(run["hub"].get("fingerprint")))]
        terms = list(stats.terms) or ([run["terms_sha256"]] if run and run.get("terms_sha256") else [])
        if run is not None:
            last = run["rounds"][-1] if run["rounds"] else {}
            eps = {k: _ledger_value(last.get(k)) for k in EPSILON_KEYS}
            if not run["rounds"]:
                eps["image"] = 0.0
            rounds, delta = len(run["rounds"]), float(run["delta"])
            leaves = [f"{x.get('kind')} {x.get('clause')}: {x.get('message')}" for x in run["leaves"]]
        else:
            audited = stats.epsilon or {}
            eps = {k: (float(v) if isinstance(v, int | float) else None) for k in EPSILON_KEYS
                   for v in [audited.get(k)]}
            rounds, delta, leaves = len(stats.rounds), None, []
        out.append(RunRow(
            run=run_id, first=stats.first or (run or {}).get("started") or "", last=stats.last or "",
            hub_serial=";".join(s for s, _ in hubs), hub_fingerprint=";".join(f for _, f in hubs),
            terms_sha256=";".join(terms), rounds=rounds, kinds=dict(sorted(stats.kinds.items())),
            bytes=dict(sorted(stats.bytes.items())), client=eps["client"], sample=eps["sample"],
            image=eps["image"], lifetime=eps["lifetime"], delta=delta, refusals=stats.refusals, leaves=leaves))
    return out


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(state_dir: Path, report: ChainReport, table: list[RunRow], ledger: dict[str, Any] | None,
             lifetime: tuple[float, float] | None, ledger_error: str | None = None) -> str:
    status = "intact" if report.ok else f"NOT intact, {len(report.problems)} problem(s): run `silo-audit verify`"
    lines = [f"# silo-audit report: {_md(state_dir)}", "",
             f"- generated: {datetime.now(UTC).isoformat(timespec='seconds').replace('+00:00', 'Z')}",
             f"- audit: `{_md(state_dir / AUDIT_FILE)}`, {report.records} records, chain head `{report.head}` "
             f"({status})",
             "- keep the record count and chain head: a later `silo-audit report` of the same folder showing fewer "
             "records or another head means the audit was cut short or rewritten"]
    if ledger is not None and lifetime is not None:
        lines.append(f"- privacy ledger: `{_md(state_dir / LEDGER_FILE)}`; lifetime epsilon {_fmt(lifetime[0])} at "
                     f"delta {lifetime[1]:.3g} (sum over runs, basic composition); epsilons below are the "
                     "ledger's")
    elif ledger_error is not None:
        lines.append(f"- privacy ledger `{_md(state_dir / LEDGER_FILE)}` UNREADABLE ({_md(ledger_error)}): epsilons "
                     "below are the last ones audited")
    else:
        lines.append("- no privacy ledger in this folder (a hub's folder): epsilons below are the last ones audited")
    lines += ["", "## Runs", "",
              "| run | first | last | hub serial | hub fingerprint | terms sha256 | rounds | messages | bytes "
              "| epsilon client | epsilon sample | epsilon image | lifetime epsilon |",
              "|" + "---|" * 13]
    for row in table:
        lines.append("| " + " | ".join(_md(x) for x in (
            row.run, row.first, row.last, row.hub_serial or "-", row.hub_fingerprint or "-", row.terms_sha256 or "-",
            row.rounds, sum(row.kinds.values()), sum(row.bytes.values()), _fmt(row.client), _fmt(row.sample),
            _fmt(row.image), _fmt(row.lifetime))) + " |")
    for row in table:
        lines += ["", f"### Run {_md(row.run)}", "", "| kind | messages | bytes |", "|---|---|---|"]
        lines += [f"| {_md(k)} | {n} | {row.bytes.get(k, 0)} |" for k, n in row.kinds.items()]
        if row.refusals or row.leaves:
            lines += ["", "Refusals and leaves:", ""]
            lines += [f"- audit: {_md(x)}" for x in row.refusals] + [f"- ledger: {_md(x)}" for x in row.leaves]
    return "\n".join(lines) + "\n"


CSV_HEADER = ["run", "first_time", "last_time", "hub_serial", "hub_fingerprint", "terms_sha256", "rounds",
              "messages", "bytes", "messages_by_kind", "bytes_by_kind", "epsilon_client", "epsilon_sample",
              "epsilon_image", "epsilon_lifetime", "delta", "refusals", "leaves", "audit_records", "chain_head",
              "chain_intact"]


def csv_text(report: ChainReport, table: list[RunRow]) -> str:
    """One row per run; infinite epsilons as inf, those that did not apply empty; the chain on every row."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    for row in table:
        writer.writerow([
            row.run, row.first, row.last, row.hub_serial, row.hub_fingerprint, row.terms_sha256, row.rounds,
            sum(row.kinds.values()), sum(row.bytes.values()),
            ";".join(f"{k}={n}" for k, n in row.kinds.items()), ";".join(f"{k}={n}" for k, n in row.bytes.items()),
            _fmt(row.client, None), _fmt(row.sample, None), _fmt(row.image, None), _fmt(row.lifetime, None),
            "" if row.delta is None else repr(row.delta), " | ".join(row.refusals), " | ".join(row.leaves),
            report.records, report.head, "yes" if report.ok else "no"])
    return buf.getvalue()


def report_command(state_dir: Path, fmt: str, out: Path | None) -> int:
    audit = _folder(state_dir)
    if isinstance(audit, int):
        return audit
    if out is not None and not out.parent.is_dir():
        return error(f"cannot write {out}: folder {out.parent} does not exist")
    report, collector = scan(audit)
    ledger, lifetime, ledger_error = None, None, None
    ledger_path = state_dir / LEDGER_FILE
    if ledger_path.is_file():
        try:
            ledger = read_ledger(ledger_path)
        except LedgerError as err:  # a problem of the records, as verify counts it: the report is still written
            ledger_error = str(err)
    if ledger is not None:
        spent = [r for r in ledger["runs"].values() if r["rounds"]]
        lifetime = (sum((_ledger_value(r["rounds"][-1]["image"]) or 0.0 for r in spent), 0.0),
                    sum((float(r["delta"]) for r in spent), 0.0))
    table = rows(collector, ledger)
    text = (markdown(state_dir, report, table, ledger, lifetime, ledger_error) if fmt == "markdown"
            else csv_text(report, table))
    if out is None:
        sys.stdout.write(text)
    else:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
        print(f"wrote {out}: {len(table)} runs, {report.records} audit records, chain head {report.head}",
              file=sys.stderr)
    problems = [*report.problems, *([ledger_error] if ledger_error is not None else [])]
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        return verify(args.state_dir)
    return report_command(args.state_dir, args.format, args.out)


if __name__ == "__main__":
    sys.exit(main())
