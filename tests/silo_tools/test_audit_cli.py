"""silo-audit (silo_tools/audit.py) on state folders written as the silo client and the hub write them: the chain
verified, the audit checked against the branch's privacy ledger, and the privacy officer's report."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from security.audit import AUDIT_FILE, AuditLog, verify_chain
from silo_client.ledger import LEDGER_FILE, BranchLedger
from silo_client.outbox import epsilon_fields
from silo_tools.audit import main

ROOT = Path(__file__).resolve().parents[2]
HUB = {"serial": "1a2b", "fingerprint": "ab" * 32}
TERMS = "cd" * 32


def epsilon_of(ledger: BranchLedger, run: str, release: int = 1) -> dict[str, float | int | None]:
    """What the silo client's Outbox records with a message after the ledger's last charge."""
    return epsilon_fields(ledger.run_epsilon(run), ledger.lifetime_epsilon(), release)


def silo_state(folder: Path) -> Path:
    """run-a: 3 plain uploads under client- and sample-level DP; run-b: 2 rounds of secure aggregation under
    client-level DP, then the silo leaves at its budget; run-c: the terms refused at join."""
    log, ledger = AuditLog(folder / AUDIT_FILE), BranchLedger(folder)
    log.append("terms", run="run-a", terms={"dp": {"noise_multiplier": 1.1}}, terms_sha256=TERMS)
    ledger.begin_run("run-a", hub_serial=HUB["serial"], hub_fingerprint=HUB["fingerprint"], terms_sha256=TERMS,
                     client_dp_noise=1.1, sample_dp=True)
    log.append("join", hub=HUB, run="run-a", terms_sha256=TERMS, bytes=120)
    for r in (1, 2, 3):
        log.append("poll", hub=HUB, run="run-a", bytes=40)
        log.append("download_request", hub=HUB, run="run-a", round=r, task="train", bytes=60)
        ledger.record_round("run-a", r, client_dp_noise=1.1, sample_epsilon=0.25 * r, task="train")  # charged, then sent
        log.append("upload", hub=HUB, run="run-a", round=r, task="train", bytes=1000 + r,
                   tensors=[["delta/fc.weight", [3, 16], "float32"]], sha256="ef" * 32, terms_sha256=TERMS,
                   epsilon=epsilon_of(ledger, "run-a"))
    ledger.begin_run("run-b", hub_serial="3c4d", hub_fingerprint="12" * 32, terms_sha256="34" * 32,
                     client_dp_noise=2.0, sample_dp=False)
    hub_b = {"serial": "3c4d", "fingerprint": "12" * 32}
    for r in (1, 2):
        log.append("secagg:advertise_keys", hub=hub_b, run="run-b", round=r, bytes=64)
        ledger.record_round("run-b", r, client_dp_noise=2.0, sample_epsilon=None)
        log.append("secagg:masked_input", hub=hub_b, run="run-b", round=r, bytes=500,
                   epsilon=epsilon_of(ledger, "run-b"))
    ledger.record_leave("run-b", "budget", "policy.max_epsilon", "one more round would exceed 5.0")
    log.append("leave", hub=hub_b, run="run-b", clause="policy.max_epsilon", message="budget", bytes=30)
    log.append("refusal", run="run-c", clause="dp.noise_multiplier", required=1.0, offered=0.3,
               message="the hub offers noise 0.3; this branch requires at least 1.0")
    ledger.record_leave("run-c", "refused", "dp.noise_multiplier", "noise 0.3 < 1.0")
    return folder


@pytest.fixture
def state(tmp_path) -> Path:
    return silo_state(tmp_path / "silo")


def run_cli(capsys, *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


# ---------------------------------------------------------------------------------------------- verify
def test_verify_a_good_silo_folder(state, capsys):
    head = verify_chain(state / AUDIT_FILE).head
    code, out, err = run_cli(capsys, "verify", state)
    assert (code, err) == (0, "")
    assert out == (f"audit intact: 17 records (by kind download_request 3, join 1, leave 1, poll 3, refusal 1, "
                   f"secagg:advertise_keys 2, secagg:masked_input 2, terms 1, upload 3), chain head {head}; "
                   "agrees with the ledger (5 rounds in 3 runs)\n")


def test_verify_names_the_line_of_one_edited_byte(state, capsys):
    path = state / AUDIT_FILE
    lines = lines_of(path)
    n = next(i for i, line in enumerate(lines, 1) if b'"bytes":1002' in line)
    lines[n - 1] = lines[n - 1].replace(b'"bytes":1002', b'"bytes":1003')
    path.write_bytes(b"\n".join(lines) + b"\n")
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 1
    assert out.splitlines()[0] == (f"error: line {n} (seq {n}, kind upload): its content does not match its hash: "
                                   "edited after it was written")
    assert "NOT intact: 1 problem(s) in 17 records" in out


def test_verify_a_ledger_round_without_an_audited_upload(state, capsys):
    BranchLedger(state).record_round("run-a", 4, client_dp_noise=1.1, sample_epsilon=1.0)  # charged, never audited
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 1
    assert out.splitlines()[0] == ("error: run run-a round 4: the ledger charges this round but the audit has no "
                                   "upload or secagg:masked_input record for it: it was sent unaudited, or the "
                                   "audit lost records")


def test_verify_a_mismatched_epsilon_and_an_upload_the_ledger_never_charged(state, capsys):
    ledger = BranchLedger(state)
    log = AuditLog(state / AUDIT_FILE)
    good = ledger.record_round("run-a", 4, client_dp_noise=1.1, sample_epsilon=1.0)
    wrong = {**epsilon_of(ledger, "run-a"), "image": good.image + 0.5}
    seq4 = log.append("upload", hub=HUB, run="run-a", round=4, bytes=1004, epsilon=wrong)["seq"]
    seq5 = log.append("upload", hub=HUB, run="run-a", round=5, bytes=1005, epsilon=epsilon_of(ledger, "run-a"))["seq"]
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 1
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: line {seq4} (seq {seq4}, kind upload): run run-a round 4: epsilon.image is {good.image + 0.5!r} "
        f"but the ledger has {good.image!r}",
        f"error: line {seq5} (seq {seq5}, kind upload): run run-a round 5 carries an epsilon but the ledger has no "
        "such round (or task, or release of it): privacy spent that the ledger does not count"]


def test_verify_pairs_each_release_of_a_task_with_its_own_upload(state, capsys):
    """A task trained and sent twice (a silo restarted before the hub took its upload) is charged twice; each
    upload carries its release's figures, and a third charge with no upload is named by its release."""
    ledger, log = BranchLedger(state), AuditLog(state / AUDIT_FILE)
    for release in (1, 2):
        ledger.record_round("run-a", 4, client_dp_noise=1.1, sample_epsilon=1.0, task="t4")
        log.append("upload", hub=HUB, run="run-a", round=4, task="t4", bytes=1004,
                   epsilon=epsilon_of(ledger, "run-a", release))
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 0 and out.rstrip().endswith("agrees with the ledger (7 rounds in 3 runs)")
    ledger.record_round("run-a", 4, client_dp_noise=1.1, sample_epsilon=1.0, task="t4")
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 1
    assert out.splitlines()[0] == ("error: run run-a round 4 (release 3 of its task): the ledger charges this round "
                                   "but the audit has no upload or secagg:masked_input record for it: it was sent "
                                   "unaudited, or the audit lost records")


def test_verify_a_hub_folder_checks_the_chain_alone(tmp_path, capsys):
    log = AuditLog(tmp_path / AUDIT_FILE)
    log.append("run_start", run="run-a", config_sha256="aa" * 32)
    log.append("join", silo="silo-1", run="run-a")
    log.append("silo_declined", silo="silo-2", run="run-a", clause="dp.noise_multiplier")
    rec = log.append("model_written", run="run-a", round=1, file="model.safetensors", sha256="bb" * 32)
    code, out, _ = run_cli(capsys, "verify", tmp_path)
    assert code == 0
    assert out.startswith("audit intact: 4 records (by kind join 1, model_written 1, run_start 1, silo_declined 1), "
                          f"chain head {rec['hash']}; no privacy ledger here")


def test_verify_a_damaged_ledger(state, capsys):
    (state / LEDGER_FILE).write_text("{")
    code, out, _ = run_cli(capsys, "verify", state)
    assert code == 1 and f"error: privacy ledger {state / LEDGER_FILE} is damaged" in out
    # report agrees with verify: a problem of the records (exit 1), the report still written from the audit
    code, out, err = run_cli(capsys, "report", state)
    assert code == 1 and f"error: privacy ledger {state / LEDGER_FILE} is damaged" in err
    assert out.startswith("# silo-audit report") and "UNREADABLE" in out and "| run-a |" in out


def test_a_missing_folder_or_audit_is_a_usage_error(tmp_path, capsys):
    code, out, err = run_cli(capsys, "verify", tmp_path / "nope")
    assert (code, out) == (2, "") and err.startswith(f"error: {tmp_path / 'nope'} is not a folder")
    assert len(err.splitlines()) == 1
    code, _, err = run_cli(capsys, "report", tmp_path)
    assert code == 2 and err.startswith(f"error: {tmp_path / AUDIT_FILE} does not exist")


# ---------------------------------------------------------------------------------------------- report
def test_report_markdown(state, capsys):
    ledger = BranchLedger(state)
    a, b = ledger.run_epsilon("run-a"), ledger.run_epsilon("run-b")
    chain = verify_chain(state / AUDIT_FILE)
    code, out, _ = run_cli(capsys, "report", state)
    assert code == 0
    assert out.startswith(f"# silo-audit report: {state}\n")
    assert f"17 records, chain head `{chain.head}` (intact)" in out
    assert f"lifetime epsilon {a.image + b.image:.4f} at delta 2e-05" in out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines() if line.startswith("| run-")}
    assert rows["run-a"].endswith(
        f"| 1a2b | {'ab' * 32} | {TERMS} | 3 | 11 | {120 + 3 * 40 + 3 * 60 + 3006} | {a.client:.4f} | 0.7500 "
        f"| 0.7500 | {a.image:.4f} |")
    assert rows["run-b"].endswith(
        f"| 3c4d | {'12' * 32} | {'34' * 32} | 2 | 5 | {2 * 64 + 2 * 500 + 30} | {b.client:.4f} | - "
        f"| {b.image:.4f} | {a.image + b.image:.4f} |")
    assert "| run-c |" in rows["run-c"] and "| 0 | 1 | 0 | - | - | 0.0000 | - |" in rows["run-c"]
    assert "| upload | 3 | 3006 |" in out
    assert "- audit: refusal dp.noise_multiplier: the hub offers noise 0.3; this branch requires at least 1.0" in out
    assert "- ledger: budget policy.max_epsilon: one more round would exceed 5.0" in out


def test_report_csv_to_a_file(state, capsys, tmp_path):
    ledger = BranchLedger(state)
    chain = verify_chain(state / AUDIT_FILE)
    out_file = tmp_path / "report.csv"
    code, out, err = run_cli(capsys, "report", state, "--format", "csv", "--out", out_file)
    assert (code, out) == (0, "") and f"wrote {out_file}: 3 runs" in err
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(out_file.read_text()))}
    assert list(rows) == ["run-a", "run-b", "run-c"]
    a = rows["run-a"]
    assert (a["hub_serial"], a["hub_fingerprint"], a["terms_sha256"]) == ("1a2b", "ab" * 32, TERMS)
    assert (a["rounds"], a["messages"], a["bytes"]) == ("3", "11", str(120 + 120 + 180 + 3006))
    assert a["messages_by_kind"] == "download_request=3;join=1;poll=3;terms=1;upload=3"
    assert a["bytes_by_kind"] == "download_request=180;join=120;poll=120;upload=3006"
    e = ledger.run_epsilon("run-a")
    assert (float(a["epsilon_client"]), float(a["epsilon_sample"]), float(a["epsilon_image"])) == (
        e.client, e.sample, e.image)
    assert float(rows["run-b"]["epsilon_lifetime"]) == ledger.lifetime_epsilon()
    assert rows["run-b"]["epsilon_sample"] == "" and rows["run-b"]["delta"] == "1e-05"
    assert rows["run-c"]["refusals"].startswith("refusal dp.noise_multiplier: the hub offers noise 0.3")
    assert rows["run-c"]["leaves"] == "refused dp.noise_multiplier: noise 0.3 < 1.0"
    assert {(r["audit_records"], r["chain_head"], r["chain_intact"]) for r in rows.values()} == {
        ("17", chain.head, "yes")}


def test_report_of_a_broken_chain_is_written_and_fails(state, capsys):
    path = state / AUDIT_FILE
    path.write_bytes(b"\n".join(lines_of(path)[:3] + lines_of(path)[4:]) + b"\n")
    code, out, err = run_cli(capsys, "report", state, "--format", "csv")
    assert code == 1 and "error: line 4 (seq 5" in err
    assert {r["chain_intact"] for r in csv.DictReader(io.StringIO(out))} == {"no"}


def test_as_a_real_command(state):
    env_python = sys.executable
    ok = subprocess.run([env_python, "-m", "silo_tools.audit", "verify", str(state)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("audit intact: 17 records"), ok.stderr
    json.loads(json.dumps(ok.stdout))  # one plain line
    ledger = json.loads((state / LEDGER_FILE).read_text())
    ledger["runs"]["run-a"]["rounds"][1]["image"] = 9.5  # the ledger rewritten: the audit disagrees
    (state / LEDGER_FILE).write_text(json.dumps(ledger))
    bad = subprocess.run([env_python, "-m", "silo_tools.audit", "verify", str(state)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "run run-a round 2: epsilon.image is 0.5 but the ledger has 9.5" in bad.stdout
