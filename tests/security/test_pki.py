"""security.pki and the silo-certs CLI: what the certificates contain, where files go, and how errors read."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security import pki
from security.cli import main
from security.pki import store
from silo_client.cli import build_parser as silo_client_parser
from silo_server.cli import build_parser as silo_server_parser


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _flags_after(out: str, command: str) -> set[str]:
    """The --flags the printed "next" step passes to `command` (on the same line, after its name)."""
    lines = [line.split(command, 1)[1] for line in out.splitlines() if command in line]
    assert lines, f"{command} is not named in {out!r}"
    return {flag for line in lines for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line)}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    return pki.init_ca(tmp_path / "ca")


# ---------------------------------------------------------------------------------------------------------- CA


def test_ca_certificate_is_a_p256_sha256_ca_with_critical_constraints(ca_dir: Path) -> None:
    cert = _cert(ca_dir / "ca.pem")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "silokit CA"
    assert cert.subject == cert.issuer
    cert.verify_directly_issued_by(cert)  # self-signed
    key = cert.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    assert isinstance(key.curve, ec.SECP256R1)
    assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)

    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
    assert not ku.value.digital_signature
    ski = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(key)

    days = (cert.not_valid_after_utc - dt.datetime.now(dt.UTC)).days
    assert 3648 <= days <= 3650


def test_ca_writes_key_0600_empty_signed_crl_and_empty_inventory(ca_dir: Path) -> None:
    assert _mode(ca_dir / "ca.key") == 0o600
    assert b"ENCRYPTED" not in (ca_dir / "ca.key").read_bytes()
    crl = pki.load_crl(ca_dir)  # also checks the CA signature
    assert len(crl) == 0
    assert crl.next_update_utc is not None and crl.next_update_utc > dt.datetime.now(dt.UTC)
    assert json.loads((ca_dir / "issued.json").read_text()) == []


def test_init_refuses_to_overwrite_and_leaves_the_key_alone(ca_dir: Path) -> None:
    before = (ca_dir / "ca.key").read_bytes()
    with pytest.raises(pki.PkiError, match=r"ca\.key already exists.*delete it first"):
        pki.init_ca(ca_dir)
    assert (ca_dir / "ca.key").read_bytes() == before


def test_init_refuses_a_directory_with_only_a_certificate(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(pki.PkiError, match=r"ca\.pem already exists"):
        pki.init_ca(tmp_path)
    assert not (tmp_path / "ca.key").exists()


# --------------------------------------------------------------------------------------------------------- hub


def test_hub_certificate_defaults_to_localhost_sans_and_server_auth(ca_dir: Path, tmp_path: Path) -> None:
    out = pki.issue_hub(ca_dir, tmp_path / "hub", dns=[], ips=[])
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "cert.pem", "crl.pem", "key.pem"]
    assert _mode(out / "key.pem") == 0o600
    assert (out / "ca.pem").read_bytes() == (ca_dir / "ca.pem").read_bytes()

    cert, ca = _cert(out / "cert.pem"), _cert(ca_dir / "ca.pem")
    cert.verify_directly_issued_by(ca)
    assert pki.cert_common_name((out / "cert.pem").read_bytes()) == "hub"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    assert isinstance(cert.public_key().curve, ec.SECP256R1)  # type: ignore[union-attr]
    assert 89.9 < pki.cert_days_left((out / "cert.pem").read_bytes()) <= 90


def test_hub_certificate_uses_exactly_the_given_sans(ca_dir: Path, tmp_path: Path) -> None:
    out = pki.issue_hub(ca_dir, tmp_path / "hub", dns=["hub.example.org"], ips=["10.0.0.5", "::1"], days=30)
    cert = _cert(out / "cert.pem")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hub.example.org"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "::1"]
    assert 29.9 < pki.cert_days_left((out / "cert.pem").read_bytes()) <= 30


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ips": ["10.0.0.300"]}, "invalid IP address"),
        ({"dns": ["bad name"]}, "invalid DNS name"),
        ({"dns": ["10.0.0.5"]}, "10.0.0.5 is an IP address, not a DNS name: pass it with --ip 10.0.0.5"),
        ({"days": 0}, "at least 1 day"),
        ({"days": 4000}, "outlive the CA"),
    ],
)
def test_hub_rejects_bad_arguments_and_writes_nothing(
    ca_dir: Path, tmp_path: Path, kwargs: dict, message: str
) -> None:
    with pytest.raises(pki.PkiError, match=message):
        pki.issue_hub(ca_dir, tmp_path / "hub", **kwargs)
    assert not (tmp_path / "hub" / "key.pem").exists()
    assert pki.load_inventory(ca_dir) == []


# -------------------------------------------------------------------------------------------------------- silo


def test_silo_certificate_cn_san_and_client_auth(ca_dir: Path, tmp_path: Path) -> None:
    out = pki.issue_silo(ca_dir, "branch-01", tmp_path / "b1")
    assert _mode(out / "key.pem") == 0o600
    pem = (out / "cert.pem").read_bytes()
    assert pki.cert_common_name(pem) == "branch-01"
    cert = _cert(out / "cert.pem")
    cert.verify_directly_issued_by(_cert(ca_dir / "ca.pem"))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["branch-01"]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_silo_refuses_to_overwrite_a_bundle(ca_dir: Path, tmp_path: Path) -> None:
    out = pki.issue_silo(ca_dir, "branch-01", tmp_path / "b1")
    before = (out / "key.pem").read_bytes()
    with pytest.raises(pki.PkiError, match=r"key\.pem already exists.*delete it first"):
        pki.issue_silo(ca_dir, "branch-02", out)
    assert (out / "key.pem").read_bytes() == before
    assert len(pki.load_inventory(ca_dir)) == 1


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "../etc", "a/b", ".hidden", "..", "zürich", "a;rm"])
def test_bad_silo_names_are_rejected(ca_dir: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(pki.PkiError, match="invalid silo name.*1-64 characters"):
        pki.issue_silo(ca_dir, name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["branch-01", "a.b_c", "x" * 64, "Z"])
def test_good_silo_names_are_accepted(ca_dir: Path, tmp_path: Path, name: str) -> None:
    out = pki.issue_silo(ca_dir, name, tmp_path / "out")
    assert pki.cert_common_name((out / "cert.pem").read_bytes()) == name


# --------------------------------------------------------------------------------------------------- inventory


def test_inventory_records_every_issue(ca_dir: Path, tmp_path: Path) -> None:
    hub = pki.issue_hub(ca_dir, tmp_path / "hub", dns=[], ips=[])
    s1 = pki.issue_silo(ca_dir, "s1", tmp_path / "s1", days=10)
    rows = json.loads((ca_dir / "issued.json").read_text())
    assert [(r["kind"], r["name"], r["status"]) for r in rows] == [
        ("hub", "hub", "valid"),
        ("silo", "s1", "valid"),
    ]
    for row, bundle in zip(rows, [hub, s1], strict=True):
        cert = _cert(bundle / "cert.pem")
        assert row["serial"] == format(cert.serial_number, "x")
        assert dt.datetime.fromisoformat(row["not_after"]) == cert.not_valid_after_utc
        assert Path(row["path"]) == bundle.resolve()
    assert rows[0]["serial"] != rows[1]["serial"]


def test_write_crl_lists_revoked_inventory_entries(ca_dir: Path, tmp_path: Path) -> None:
    # The hook revocation will use: mark the entry, re-sign the CRL.
    pki.issue_silo(ca_dir, "s1", tmp_path / "s1")
    pki.issue_silo(ca_dir, "s2", tmp_path / "s2")
    entries = pki.load_inventory(ca_dir)
    entries[0].status = "revoked"
    store.save_inventory(ca_dir, entries)
    pki.write_crl(ca_dir)
    crl = pki.load_crl(ca_dir)
    assert [r.serial_number for r in crl] == [int(entries[0].serial, 16)]
    assert crl.get_revoked_certificate_by_serial_number(int(entries[1].serial, 16)) is None


# -------------------------------------------------------------------------------------------------- passphrase


def test_passphrase_protected_ca(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca", passphrase=b"correct horse")
    assert b"ENCRYPTED" in (ca / "ca.key").read_bytes()
    assert _mode(ca / "ca.key") == 0o600

    out = pki.issue_silo(ca, "s1", tmp_path / "s1", passphrase=b"correct horse")
    _cert(out / "cert.pem").verify_directly_issued_by(_cert(ca / "ca.pem"))
    assert b"ENCRYPTED" not in (out / "key.pem").read_bytes()  # gRPC needs the leaf key in clear

    with pytest.raises(pki.PkiError, match="wrong passphrase"):
        pki.issue_silo(ca, "s2", tmp_path / "s2", passphrase=b"wrong")
    with pytest.raises(pki.PkiError, match="encrypted; give its passphrase"):
        pki.issue_hub(ca, tmp_path / "hub")
    assert not (tmp_path / "s2").exists() and not (tmp_path / "hub").exists()
    assert [e.name for e in pki.load_inventory(ca)] == ["s1"]


def test_passphrase_given_for_a_clear_key(ca_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(pki.PkiError, match="not encrypted"):
        pki.issue_silo(ca_dir, "s1", tmp_path / "s1", passphrase=b"x")


def test_issue_from_a_directory_without_ca(tmp_path: Path) -> None:
    with pytest.raises(pki.PkiError, match=r"ca\.pem not found.*silo-certs init"):
        pki.issue_silo(tmp_path, "s1", tmp_path / "s1")


# ----------------------------------------------------------------------------------------------------- helpers


def test_cert_days_left_counts_from_now(ca_dir: Path, tmp_path: Path) -> None:
    pem = (pki.issue_silo(ca_dir, "s1", tmp_path / "s1", days=20) / "cert.pem").read_bytes()
    not_after = _cert(tmp_path / "s1" / "cert.pem").not_valid_after_utc
    assert pki.cert_days_left(pem, now=not_after - dt.timedelta(days=5)) == pytest.approx(5.0)
    assert pki.cert_days_left(pem, now=not_after + dt.timedelta(hours=12)) == pytest.approx(-0.5)
    naive = (not_after - dt.timedelta(days=1)).replace(tzinfo=None)
    assert pki.cert_days_left(pem, now=naive) == pytest.approx(1.0)


def test_cert_common_name_rejects_garbage() -> None:
    with pytest.raises(pki.PkiError, match="not a PEM certificate"):
        pki.cert_common_name(b"hello")


# --------------------------------------------------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca, hub = tmp_path / "pki" / "ca", tmp_path / "pki" / "hub"

    assert main(["init", "--dir", str(ca)]) == 0
    out = capsys.readouterr().out
    assert str(ca / "ca.key") in out and "issue-hub" in out
    assert _mode(ca / "ca.key") == 0o600

    assert (
        main(["issue-hub", "--ca", str(ca), "--out", str(hub), "--dns", "hub.lan", "--ip", "10.1.2.3"]) == 0
    )
    out = capsys.readouterr().out
    assert "hub.lan, 10.1.2.3" in out and str(hub / "key.pem") in out and f"copy {hub}" in out
    assert f"server.certs: {hub}" in out  # silo-server takes its bundle from hub.yaml: it has no --certs
    assert _flags_after(out, "silo-server") <= _options(silo_server_parser()), out
    san = _cert(hub / "cert.pem").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["hub.lan"]

    # Default silo bundle location: next to the CA directory, in silos/NAME.
    assert main(["issue-silo", "branch-01", "--ca", str(ca), "--days", "30"]) == 0
    out = capsys.readouterr().out
    silo = tmp_path / "pki" / "silos" / "branch-01"
    assert pki.cert_common_name((silo / "cert.pem").read_bytes()) == "branch-01"
    assert _mode(silo / "key.pem") == 0o600
    assert f"silo-client --certs {silo}" in out and _flags_after(out, "silo-client") <= _options(silo_client_parser())

    assert main(["issue-silo", "branch-02", "--ca", str(ca), "--out", str(tmp_path / "b2")]) == 0
    assert (tmp_path / "b2" / "cert.pem").is_file()
    capsys.readouterr()

    assert main(["list", "--ca", str(ca)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "SERIAL", "EXPIRES", "DAYS", "LEFT", "STATUS"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1], r[-2], r[-1]) for r in rows] == [
        ("hub", "hub", "90", "valid"),
        ("silo", "branch-01", "30", "valid"),
        ("silo", "branch-02", "90", "valid"),
    ]
    inventory = pki.load_inventory(ca)
    assert [r[2] for r in rows] == [e.serial for e in inventory]


def test_cli_list_shows_expired(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entries = [pki.IssuedCert("silo", "old", "ab", "2020-01-01T00:00:00+00:00", "/x")]
    store.save_inventory(ca_dir, entries)
    assert main(["list", "--ca", str(ca_dir)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0:4] == ["silo", "old", "ab", "2020-01-01"] and row[-1] == "expired" and int(row[-2]) < 0


def test_cli_passphrase_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "pass", tmp_path / "wrong"
    good.write_bytes(b"s3cret\n")  # as written by `echo`
    bad.write_bytes(b"nope\n")
    ca = tmp_path / "ca"
    assert main(["init", "--dir", str(ca), "--passphrase-file", str(good)]) == 0
    assert b"ENCRYPTED" in (ca / "ca.key").read_bytes()
    pki.load_ca(ca, b"s3cret")  # the newline is not part of the passphrase
    assert main(["issue-silo", "s1", "--ca", str(ca), "--passphrase-file", str(good)]) == 0
    capsys.readouterr()

    assert main(["issue-silo", "s2", "--ca", str(ca), "--passphrase-file", str(bad)]) == 2
    assert capsys.readouterr().err == f"error: cannot decrypt {ca / 'ca.key'}: wrong passphrase?\n"
    assert main(["issue-silo", "s2", "--ca", str(ca)]) == 2
    assert "--passphrase-file" in capsys.readouterr().err
    assert main(["issue-silo", "s2", "--ca", str(ca), "--passphrase-file", str(tmp_path / "missing")]) == 2
    assert "cannot read passphrase file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["issue-silo", "bad name", "--ca", "{ca}"], "invalid silo name 'bad name'"),
        (["init", "--dir", "{ca}"], "already exists; refusing to overwrite"),
        (["issue-hub", "--ca", "{tmp}/nope", "--out", "{tmp}/hub"], "not found"),
        (["issue-hub", "--ca", "{ca}", "--out", "{tmp}/hub", "--ip", "not-an-ip"], "invalid IP address"),
        (["issue-hub", "--ca", "{ca}"], "required: --out"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
        (["list", "--ca", "{tmp}"], "issued.json not found"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    argv = [a.format(ca=ca_dir, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_cli_refuses_to_overwrite_a_silo_bundle(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["issue-silo", "s1", "--ca", str(ca_dir)]) == 0
    capsys.readouterr()
    s1_bundle = str(ca_dir.parent / "silos" / "s1")
    assert main(["issue-silo", "s2", "--ca", str(ca_dir), "--out", s1_bundle]) == 2
    assert "key.pem already exists" in capsys.readouterr().err


def test_cli_verbose_shows_traceback(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--verbose", "init", "--dir", str(ca_dir)], ["init", "--dir", str(ca_dir), "-v"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")


def test_cli_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "issue-silo" in capsys.readouterr().out
