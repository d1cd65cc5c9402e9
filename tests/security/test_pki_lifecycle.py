"""The certificate lifecycle after issuing: revoke, renew, refresh the CRL, list; and validity in the past."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509

from security import pki
from security.cli import main


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _serial(bundle: Path) -> int:
    return _cert(bundle / "cert.pem").serial_number


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
    second = pki.issue_silo(ca, "s1", tmp_path / "s1b")
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
    b = pki.issue_silo(ca, "s1", tmp_path / "b")
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
