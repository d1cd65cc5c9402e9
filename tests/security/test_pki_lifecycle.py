"""The certificate lifecycle after issuing: revoke, renew, refresh the CRL, list; and validity in the past."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509

from security import pki
from security.cli import main

REPO = Path(__file__).resolve().parents[2]


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _serial(bundle: Path) -> int:
    return _cert(bundle / "cert.pem").serial_number


def _hex(bundle: Path) -> str:
    return format(_serial(bundle), "x")


def _crl_serials(crl_pem: Path, ca: Path) -> set[int]:
    """The serials a CRL file lists, read with `cryptography` after checking the CA signed it."""
    crl = x509.load_pem_x509_crl(crl_pem.read_bytes())
    assert crl.is_signature_valid(_cert(ca / "ca.pem").public_key())  # type: ignore[arg-type]
    return {r.serial_number for r in crl}


def _snapshot(*dirs: Path) -> dict[str, bytes]:
    """Every file under ``dirs`` (the lock file aside) with its bytes: to show that a refusal wrote nothing."""
    return {
        str(f): f.read_bytes()
        for d in dirs
        for f in sorted(d.rglob("*"))
        if f.is_file() and f.name != pki.LOCK
    }


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    return pki.init_ca(tmp_path / "ca")


def test_every_bundle_carries_a_copy_of_the_signed_crl(ca: Path, tmp_path: Path) -> None:
    # the hub checks its callers against it, a silo the hub
    for bundle in (pki.issue_hub(ca, tmp_path / "hub"), pki.issue_silo(ca, "s1", tmp_path / "s1")):
        assert (bundle / "crl.pem").read_bytes() == (ca / "crl.pem").read_bytes()
        crl = pki.parse_crl((bundle / "crl.pem").read_bytes(), (bundle / "ca.pem").read_bytes())
        assert len(list(crl)) == 0


def test_hub_is_a_reserved_silo_name(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(pki.PkiError, match="reserved for the hub"):
        pki.issue_silo(ca, "hub", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_not_before_in_the_past_makes_an_already_expired_certificate(ca: Path, tmp_path: Path) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=40)
    out = pki.issue_silo(ca, "old", tmp_path / "old", days=30, not_before=start)
    cert = _cert(out / "cert.pem")
    assert cert.not_valid_before_utc == start.replace(microsecond=0)
    assert cert.not_valid_after_utc == (start + dt.timedelta(days=30)).replace(microsecond=0)
    assert pki.cert_days_left((out / "cert.pem").read_bytes()) == pytest.approx(-10.0, abs=0.01)
    entry = pki.load_inventory(ca)[-1]
    assert pki.display_status(entry, [entry]) == "expired"


def test_revoke_by_name_revokes_every_certificate_of_that_identity(ca: Path, tmp_path: Path) -> None:
    first = pki.issue_silo(ca, "s1", tmp_path / "s1a")
    second = pki.renew(ca, "s1", out_dir=tmp_path / "s1b")  # two live certificates of one name, on purpose
    other = pki.issue_silo(ca, "s2", tmp_path / "s2")
    revoked = pki.revoke(ca, "s1")
    assert sorted(int(e.serial, 16) for e in revoked) == sorted([_serial(first), _serial(second)])
    crl = pki.load_crl(ca)
    assert {r.serial_number for r in crl} == {_serial(first), _serial(second)}
    assert crl.get_revoked_certificate_by_serial_number(_serial(other)) is None
    statuses = {(e.name, e.serial): e.status for e in pki.load_inventory(ca)}
    assert sorted(statuses.values()) == ["revoked", "revoked", "valid"]
    assert all(e.revoked_at for e in pki.load_inventory(ca) if e.status == "revoked")
    with pytest.raises(pki.PkiError, match="already revoked"):
        pki.revoke(ca, "s1")


def test_revoke_by_serial_colon_form_or_prefix_touches_only_that_one(ca: Path, tmp_path: Path) -> None:
    a = pki.issue_silo(ca, "s1", tmp_path / "a")
    b = pki.renew(ca, "s1", out_dir=tmp_path / "b")
    hex_b = format(_serial(b), "x")
    colon = ":".join(hex_b[i : i + 2] for i in range(0, len(hex_b), 2)).upper()  # as openssl prints it
    assert [e.serial for e in pki.revoke(ca, colon)] == [hex_b]
    assert {r.serial_number for r in pki.load_crl(ca)} == {_serial(b)}
    hex_a = format(_serial(a), "x")
    assert [e.serial for e in pki.revoke(ca, "0x" + hex_a[:10])] == [hex_a]
    assert {r.serial_number for r in pki.load_crl(ca)} == {_serial(a), _serial(b)}


def test_revoke_unknown_target_or_wrong_passphrase_changes_nothing(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca", passphrase=b"pw")
    pki.issue_silo(ca, "s1", tmp_path / "s1", passphrase=b"pw")
    inventory, crl = (ca / "issued.json").read_bytes(), (ca / "crl.pem").read_bytes()
    with pytest.raises(pki.PkiError, match="no certificate named 'nobody'.*silo-certs list"):
        pki.revoke(ca, "nobody", passphrase=b"pw")
    with pytest.raises(pki.PkiError, match="wrong passphrase"):
        pki.revoke(ca, "s1", passphrase=b"nope")
    assert (ca / "issued.json").read_bytes() == inventory and (ca / "crl.pem").read_bytes() == crl


def test_parse_crl_refuses_a_crl_from_another_ca_or_garbage(ca: Path, tmp_path: Path) -> None:
    foreign = pki.init_ca(tmp_path / "foreign")
    with pytest.raises(pki.PkiError, match="not signed by the federation CA"):
        pki.parse_crl((foreign / "crl.pem").read_bytes(), (ca / "ca.pem").read_bytes(), "hub/crl.pem")
    with pytest.raises(pki.PkiError, match="hub/crl.pem is not a PEM certificate revocation list"):
        pki.parse_crl(b"garbage", (ca / "ca.pem").read_bytes(), "hub/crl.pem")


def test_renew_silo_issues_a_new_key_for_the_same_identity_next_to_the_old_bundle(ca: Path) -> None:
    old = pki.issue_silo(ca, "branch-07", ca.parent / "silos" / "branch-07", days=10)
    new = pki.renew(ca, "branch-07", days=60)
    assert new == ca.parent / "silos" / f"branch-07.renewed-{dt.datetime.now(dt.UTC):%Y-%m-%d}"
    assert pki.cert_common_name((new / "cert.pem").read_bytes()) == "branch-07"
    assert (new / "key.pem").read_bytes() != (old / "key.pem").read_bytes()
    assert pki.cert_days_left((new / "cert.pem").read_bytes()) == pytest.approx(60, abs=0.01)
    entries = pki.load_inventory(ca)
    assert [pki.display_status(e, entries) for e in entries] == ["superseded", "valid"]
    with pytest.raises(pki.PkiError, match="already exists.*--out"):
        pki.renew(ca, "branch-07")  # same day, same default directory: never overwritten
    assert len(pki.load_inventory(ca)) == 2


def test_renew_hub_keeps_its_names_and_revoke_old_revokes_the_previous(ca: Path, tmp_path: Path) -> None:
    old = pki.issue_hub(ca, tmp_path / "hub", dns=["hub.lan"], ips=["10.0.0.5"])
    new = pki.renew(ca, "hub", out_dir=tmp_path / "hub-2", revoke_old=True)
    san = _cert(new / "cert.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hub.lan"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert {r.serial_number for r in pki.load_crl(ca)} == {_serial(old)}
    entries = pki.load_inventory(ca)
    assert [(e.kind, pki.display_status(e, entries)) for e in entries] == [("hub", "revoked"), ("hub", "valid")]
    # The new hub bundle carries the CRL that already lists the old hub certificate.
    assert (new / "crl.pem").read_bytes() == (ca / "crl.pem").read_bytes()
    pki.issue_silo(ca, "s1", tmp_path / "s1")
    with pytest.raises(pki.PkiError, match="hub's certificate only"):
        pki.renew(ca, "s1", dns=["x"])


def test_renew_of_an_unknown_name_says_how_to_issue(ca: Path) -> None:
    with pytest.raises(pki.PkiError, match="no certificate named 'ghost'.*issue-silo ghost"):
        pki.renew(ca, "ghost")
    # "hub" is no silo name (issue-silo refuses it): a CA without a hub certificate is told to issue one
    with pytest.raises(pki.PkiError, match=r"no certificate named 'hub'.*`silo-certs issue-hub --ca .* --out HUB_DIR`"):
        pki.renew(ca, "hub")


# --------------------------------------------------------------------------------------------------------- CLI


def test_cli_revoke_renew_crl_print_what_they_wrote_and_where_to_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "pki" / "ca"
    assert main(["init", "--dir", str(ca)]) == 0
    assert main(["issue-hub", "--ca", str(ca), "--out", str(tmp_path / "pki" / "hub")]) == 0
    assert "crl.pem" in capsys.readouterr().out
    assert main(["issue-silo", "branch-01", "--ca", str(ca)]) == 0
    capsys.readouterr()

    assert main(["renew", "branch-01", "--ca", str(ca), "--days", "30"]) == 0
    out = capsys.readouterr().out
    renewed = next((tmp_path / "pki" / "silos").glob("branch-01.renewed-*"))
    assert f"{renewed / 'key.pem'}" in out and f"copy {renewed} to the branch 'branch-01'" in out
    assert "old certificate stays valid" in out

    old_serial = pki.load_inventory(ca)[1].serial
    assert main(["revoke", old_serial, "--ca", str(ca)]) == 0
    out = capsys.readouterr().out
    assert f"revoked silo certificate 'branch-01' (serial {old_serial}" in out
    assert f"wrote {ca / 'crl.pem'}: 1 revoked certificate(s)" in out
    assert "over crl.pem in its certificate bundle (server.certs)" in out and "no restart" in out

    assert main(["list", "--ca", str(ca)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], r[-1]) for r in rows] == [("hub", "valid"), ("branch-01", "revoked"), ("branch-01", "valid")]

    before = pki.load_crl(ca).last_update_utc
    assert main(["crl", "--ca", str(ca)]) == 0
    assert "1 revoked certificate(s), valid until" in capsys.readouterr().out
    assert pki.load_crl(ca).last_update_utc >= before

    assert main(["revoke", "branch-01", "--ca", str(ca)]) == 0  # the renewed one
    assert "2 revoked certificate(s)" in capsys.readouterr().out
    assert main(["revoke", "branch-01", "--ca", str(ca)]) == 2
    assert capsys.readouterr().err.startswith("error: 'branch-01' is already revoked")
    assert json.loads((ca / "issued.json").read_text())[2]["status"] == "revoked"


# ------------------------------------------------------------------------------- one live certificate per name


def test_issuing_a_live_silo_name_again_is_refused_and_writes_nothing(ca: Path, tmp_path: Path) -> None:
    first = pki.issue_silo(ca, "silo-001", tmp_path / "first")
    before = _snapshot(ca, tmp_path / "first")
    with pytest.raises(pki.PkiError) as refused:
        pki.issue_silo(ca, "silo-001", tmp_path / "second")
    message = str(refused.value)
    assert f"silo 'silo-001' already holds a live certificate (serial {_hex(first)}," in message
    assert f"`silo-certs renew silo-001 --ca {ca}`" in message
    assert f"`silo-certs issue-silo silo-001 --ca {ca} --out {tmp_path / 'second'} --replace`" in message
    assert not (tmp_path / "second").exists()
    assert _snapshot(ca, tmp_path / "first") == before
    assert [e.serial for e in pki.live_certificates(ca, "silo-001")] == [_hex(first)]
    # Asked for the live bundle's own folder, the way out names a new one: the suggested command works as given.
    with pytest.raises(pki.PkiError) as again:
        pki.issue_silo(ca, "silo-001", tmp_path / "first")
    command = str(again.value).rsplit("`", 2)[-2]
    assert command == f"silo-certs issue-silo silo-001 --ca {ca} --out {tmp_path / 'first'}.new --replace"
    assert main(command.split()[1:]) == 0
    assert [e.serial for e in pki.live_certificates(ca, "silo-001")] != [_hex(first)]


def test_cli_refuses_a_live_name_with_one_line_naming_serial_and_both_ways_out(
    ca: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["issue-silo", "silo-001", "--ca", str(ca)]) == 0
    capsys.readouterr()
    bundle = ca.parent / "silos" / "silo-001"
    before = _snapshot(ca, ca.parent / "silos")
    assert main(["issue-silo", "silo-001", "--ca", str(ca)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: silo 'silo-001' already holds a live certificate (serial {_hex(bundle)},")
    assert "silo-certs renew silo-001" in captured.err and "issue-silo silo-001" in captured.err
    assert "--replace" in captured.err
    assert _snapshot(ca, ca.parent / "silos") == before  # inventory, CRL and the existing bundle untouched
    assert len(pki.load_inventory(ca)) == 1


def test_replace_revokes_every_live_certificate_re_signs_the_crl_and_issues(
    ca: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expired = pki.issue_silo(ca, "s1", tmp_path / "expired", days=1,
                             not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=5))
    a = pki.issue_silo(ca, "s1", tmp_path / "a")
    b = pki.renew(ca, "s1", out_dir=tmp_path / "b")  # two live ones: --replace must catch both
    other = pki.issue_silo(ca, "s2", tmp_path / "s2")
    new = tmp_path / "new"
    assert main(["issue-silo", "s1", "--ca", str(ca), "--out", str(new), "--replace"]) == 0
    out = capsys.readouterr().out
    for bundle in (a, b):
        assert f"revoked the replaced silo certificate 's1' (serial {_hex(bundle)}, bundle {bundle})" in out
    assert f"wrote {ca / 'crl.pem'}: 2 revoked certificate(s)" in out
    assert f"copy {ca / 'crl.pem'} to the hub" in out

    # The re-signed CRL lists exactly the two replaced certificates; the new bundle already carries it.
    assert _crl_serials(ca / "crl.pem", ca) == {_serial(a), _serial(b)}
    assert (new / "crl.pem").read_bytes() == (ca / "crl.pem").read_bytes()
    assert pki.cert_common_name((new / "cert.pem").read_bytes()) == "s1"
    entries = pki.load_inventory(ca)
    assert [(e.serial, e.status) for e in entries] == [
        (_hex(expired), "valid"),  # expired already: refused by every peer, nothing to revoke
        (_hex(a), "revoked"),
        (_hex(b), "revoked"),
        (_hex(other), "valid"),
        (_hex(new), "valid"),
    ]
    assert [e.serial for e in pki.live_certificates(ca, "s1")] == [_hex(new)]
    assert [e.serial for e in pki.live_certificates(ca, "s2")] == [_hex(other)]


def test_replace_with_a_wrong_passphrase_revokes_nothing(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca", passphrase=b"pw")
    pki.issue_silo(ca, "s1", tmp_path / "s1", passphrase=b"pw")
    before = _snapshot(ca)
    with pytest.raises(pki.PkiError, match="wrong passphrase"):
        pki.issue_silo(ca, "s1", tmp_path / "s1-new", passphrase=b"nope", replace=True)
    assert _snapshot(ca) == before and not (tmp_path / "s1-new").exists()


def test_a_name_whose_certificates_are_all_revoked_or_expired_needs_no_replace(
    ca: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=40)
    pki.issue_silo(ca, "s1", tmp_path / "old", days=30, not_before=past)  # expired
    live = pki.issue_silo(ca, "s1", tmp_path / "live")
    # A certificate born expired (tests of expiry handling) is no second live identity: not refused.
    pki.issue_silo(ca, "s1", tmp_path / "born-expired", days=30, not_before=past)
    assert [e.serial for e in pki.live_certificates(ca, "s1")] == [_hex(live)]
    pki.revoke(ca, "s1")
    crl = (ca / "crl.pem").read_bytes()
    assert main(["issue-silo", "s1", "--ca", str(ca), "--out", str(tmp_path / "again"), "--replace"]) == 0
    assert "--replace: there was no live certificate to revoke" in capsys.readouterr().out
    assert (ca / "crl.pem").read_bytes() == crl  # nothing newly revoked: the CRL is not re-signed
    pki.revoke(ca, "s1")
    assert main(["issue-silo", "s1", "--ca", str(ca), "--out", str(tmp_path / "third")]) == 0
    assert [e.serial for e in pki.live_certificates(ca, "s1")] == [_hex(tmp_path / "third")]
    assert len(pki.load_inventory(ca)) == 5


def test_the_hub_follows_the_same_rule_and_renew_still_keeps_its_identity(
    ca: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = pki.issue_hub(ca, tmp_path / "hub", dns=["hub.lan"])
    before = _snapshot(ca)
    assert main(["issue-hub", "--ca", str(ca), "--out", str(tmp_path / "hub-2")]) == 2
    err = capsys.readouterr().err
    assert f"error: the hub already holds a live certificate (serial {_hex(old)}," in err
    assert f"`silo-certs renew hub --ca {ca}`" in err
    assert f"`silo-certs issue-hub --ca {ca} --out {tmp_path / 'hub-2'} --replace`" in err
    assert _snapshot(ca) == before and not (tmp_path / "hub-2").exists()

    renewed = pki.renew(ca, "hub", out_dir=tmp_path / "hub-renewed")  # the rollover overlap: both stay valid
    assert {e.serial for e in pki.live_certificates(ca, "hub")} == {_hex(old), _hex(renewed)}

    assert main(["issue-hub", "--ca", str(ca), "--out", str(tmp_path / "hub-3"), "--replace"]) == 0
    out = capsys.readouterr().out
    assert f"revoked the replaced hub certificate 'hub' (serial {_hex(old)}" in out
    assert "every silo's bundle" in out  # silos must learn that the old hub certificate is revoked
    assert _crl_serials(ca / "crl.pem", ca) == {_serial(old), _serial(renewed)}
    assert _crl_serials(tmp_path / "hub-3" / "crl.pem", ca) == {_serial(old), _serial(renewed)}
    assert [e.serial for e in pki.live_certificates(ca, "hub")] == [_hex(tmp_path / "hub-3")]


# ------------------------------------------------------------------------------------ concurrent silo-certs runs

# Each child reports ready, then waits for the go file, so all of them run their command at the same moment.
_AT_ONCE = """
import os, sys, time
from security.cli import main
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.002)
sys.exit(main(sys.argv[3:]))
"""


def _silo_certs_at_once(argvs: list[list[str]], tmp_path: Path) -> list[tuple[int, str, str]]:
    """Run `silo-certs ARGV` in one process per argv, released together; (exit status, stdout, stderr) each."""
    go, ready = tmp_path / "go", [tmp_path / f"ready-{i}" for i in range(len(argvs))]
    procs = [
        subprocess.Popen([sys.executable, "-c", _AT_ONCE, str(r), str(go), *argv], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r, argv in zip(ready, argvs, strict=True)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "the silo-certs processes did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, results, strict=True)]


def test_concurrent_issues_and_revokes_lose_no_entry_and_no_revocation(ca: Path, tmp_path: Path) -> None:
    victims = [pki.issue_silo(ca, f"old-{i}", tmp_path / f"old-{i}") for i in range(3)]
    names = [f"branch-{i:02d}" for i in range(8)]
    argvs = [["issue-silo", n, "--ca", str(ca)] for n in names]
    argvs += [["revoke", f"old-{i}", "--ca", str(ca)] for i in range(3)]
    results = _silo_certs_at_once(argvs, tmp_path)
    assert [rc for rc, _, _ in results] == [0] * len(argvs), [err for _, _, err in results]

    entries = pki.load_inventory(ca)
    issued = {e.name: e for e in entries if e.name.startswith("branch-")}
    assert sorted(issued) == names
    assert len({e.serial for e in entries}) == len(entries) == 11
    for name, e in issued.items():  # each entry is the certificate in its bundle
        assert e.serial == _hex(ca.parent / "silos" / name) and e.status == "valid"
    assert {e.name for e in entries if e.status == "revoked"} == {"old-0", "old-1", "old-2"}
    assert _crl_serials(ca / "crl.pem", ca) == {_serial(v) for v in victims}


def test_two_concurrent_issues_of_the_same_name_one_wins_one_is_refused(ca: Path, tmp_path: Path) -> None:
    outs = [tmp_path / "first", tmp_path / "second"]
    results = _silo_certs_at_once([["issue-silo", "silo-001", "--ca", str(ca), "--out", str(o)] for o in outs],
                                  tmp_path)
    assert sorted(rc for rc, _, _ in results) == [0, 2]
    winner = next(o for o, (rc, _, _) in zip(outs, results, strict=True) if rc == 0)
    loser = next(o for o, (rc, _, _) in zip(outs, results, strict=True) if rc == 2)
    err = next(err for rc, _, err in results if rc == 2)
    assert err.startswith(f"error: silo 'silo-001' already holds a live certificate (serial {_hex(winner)},")
    assert err.count("\n") == 1 and "--replace" in err
    assert not loser.exists()
    assert [(e.name, e.serial) for e in pki.load_inventory(ca)] == [("silo-001", _hex(winner))]


def test_issuing_many_silos_at_once_reads_and_writes_the_inventory_once(tmp_path, monkeypatch) -> None:
    from security import pki
    from security.pki import store

    ca = tmp_path / "ca"
    pki.init_ca(ca)
    saves = []
    real_save = store.save_inventory
    monkeypatch.setattr(store, "save_inventory", lambda d, e: (saves.append(len(e)), real_save(d, e))[1])
    bundles = [(f"branch-{i:02d}", tmp_path / "silos" / f"branch-{i:02d}") for i in range(12)]
    assert pki.issue_silos(ca, bundles) == [out for _, out in bundles]
    assert saves == [12]  # one write for all twelve (one each made staging 1,000 silos quadratic)
    inventory = pki.load_inventory(ca)
    assert [e.name for e in inventory] == [name for name, _ in bundles]
    assert len({e.serial for e in inventory}) == 12
    ca_cert = x509.load_pem_x509_certificate((ca / pki.CA_CERT).read_bytes())
    for name, out in bundles:  # each bundle holds its own identity, signed by the CA, as issue_silo writes it
        cert = x509.load_pem_x509_certificate((out / pki.BUNDLE_CERT).read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == name
        cert.verify_directly_issued_by(ca_cert)
        assert (out / pki.BUNDLE_KEY).stat().st_mode & 0o777 == 0o600
    # A name already live is refused like issue_silo refuses it; what was issued before it stays inventoried.
    with pytest.raises(pki.PkiError, match="already holds a live certificate"):
        pki.issue_silos(ca, [("branch-new", tmp_path / "silos" / "branch-new"), bundles[0]])
    assert [e.name for e in pki.load_inventory(ca)][-1] == "branch-new"
