"""security.crl: the hub's view of the CRL follows the file on disk, and a bad file never un-revokes anyone."""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from pathlib import Path

import pytest
from cryptography import x509

from security import pki
from security.crl import CrlError, RevocationList
from security.pki import store


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    ca = pki.init_ca(tmp_path / "ca")
    hub = pki.issue_hub(ca, tmp_path / "hub")
    return ca, hub


def _serial(bundle: Path) -> int:
    return x509.load_pem_x509_certificate((bundle / "cert.pem").read_bytes()).serial_number


def test_a_revocation_copied_over_the_file_counts_from_the_next_lookup(setup, tmp_path: Path) -> None:
    ca, hub = setup
    s1, s2 = pki.issue_silo(ca, "s1", tmp_path / "s1"), pki.issue_silo(ca, "s2", tmp_path / "s2")
    crl = RevocationList(hub / "crl.pem", hub / "ca.pem")
    assert not crl.is_revoked(_serial(s1)) and crl.revoked_serials == frozenset()
    pki.revoke(ca, "s1")
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")  # in place: same inode, new content
    assert crl.is_revoked(_serial(s1)) and not crl.is_revoked(_serial(s2))
    assert crl.reloads == 1
    assert crl.is_revoked(_serial(s1)) and crl.reloads == 1  # unchanged file: not parsed again


def test_an_unusable_replacement_keeps_the_last_good_list(setup, tmp_path: Path, caplog) -> None:
    ca, hub = setup
    s1 = pki.issue_silo(ca, "s1", tmp_path / "s1")
    pki.revoke(ca, "s1")
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")
    crl = RevocationList(hub / "crl.pem", hub / "ca.pem")
    assert crl.is_revoked(_serial(s1))

    foreign = pki.init_ca(tmp_path / "foreign")  # a CRL signed by someone else: empty, and not ours
    with caplog.at_level(logging.ERROR, logger="security"):
        for replacement in (b"-----BEGIN X509 CRL-----\ngarbage\n", (foreign / "crl.pem").read_bytes()):
            (hub / "crl.pem").write_bytes(replacement)
            assert crl.is_revoked(_serial(s1))  # still refused
    assert crl.reload_failures == 2
    assert sum("still enforcing the previous list of 1 revoked" in r.message for r in caplog.records) == 2
    assert crl.is_revoked(_serial(s1)) and crl.reload_failures == 2  # logged once per bad file, not per call

    (hub / "crl.pem").unlink()  # even a deleted file does not lift the revocation
    assert crl.is_revoked(_serial(s1))
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")
    assert crl.is_revoked(_serial(s1)) and crl.reloads == 1


def test_an_older_list_signed_by_the_ca_never_lifts_a_revocation(setup, tmp_path: Path, caplog) -> None:
    # A renewed silo bundle carries the crl.pem of its issue; copied back over a newer one (or an old backup
    # restored), a genuine CA-signed list would once have un-revoked whatever was revoked since.
    ca, hub = setup
    s1 = pki.issue_silo(ca, "s1", tmp_path / "s1")
    before = (ca / "crl.pem").read_bytes()  # signed while s1 was good
    pki.revoke(ca, "s1")
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")
    crl = RevocationList(hub / "crl.pem", hub / "ca.pem")
    assert crl.is_revoked(_serial(s1))
    with caplog.at_level(logging.ERROR, logger="security"):
        (hub / "crl.pem").write_bytes(before)
        assert crl.is_revoked(_serial(s1))
    assert crl.reload_failures == 1 and crl.reloads == 0
    assert any("it would lift revocations" in r.message and "still enforcing the previous list of 1" in r.message
               for r in caplog.records)
    pki.issue_silo(ca, "s2", tmp_path / "s2")
    pki.revoke(ca, "s2")  # a newer list holding both goes in as usual
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")
    assert crl.is_revoked(_serial(s1)) and crl.reloads == 1 and len(crl.revoked_serials) == 2


def test_a_missing_or_foreign_crl_stops_the_hub_at_start_with_what_to_do(setup, tmp_path: Path) -> None:
    ca, hub = setup
    with pytest.raises(CrlError, match=r"nowhere\.pem.*silo-certs crl --ca CA_DIR.*security\.crl"):
        RevocationList(tmp_path / "nowhere.pem", hub / "ca.pem")
    foreign = pki.init_ca(tmp_path / "foreign")
    with pytest.raises(CrlError, match="not signed by the federation CA"):
        RevocationList(foreign / "crl.pem", hub / "ca.pem")


def test_a_stale_crl_is_still_enforced_and_the_operator_is_told(setup, tmp_path, monkeypatch, caplog) -> None:
    ca, hub = setup
    s1 = pki.issue_silo(ca, "s1", tmp_path / "s1")
    pki.revoke(ca, "s1")
    # Sign the CRL 40 days ago: its 30-day validity ended 10 days ago.
    monkeypatch.setattr(store, "utc_now", lambda: dt.datetime.now(dt.UTC) - dt.timedelta(days=40))
    pki.write_crl(ca)
    monkeypatch.undo()
    shutil.copyfile(ca / "crl.pem", hub / "crl.pem")
    crl = RevocationList(hub / "crl.pem", hub / "ca.pem")
    with caplog.at_level(logging.WARNING, logger="security"):
        assert crl.is_revoked(_serial(s1))
        assert crl.is_revoked(_serial(s1))
    stale = [r for r in caplog.records if "past its next update" in r.message]
    assert len(stale) == 1 and "silo-certs crl" in stale[0].message  # warned once, not on every call


def test_copies_of_one_list_share_its_check_and_another_ca_never_does(setup, tmp_path: Path) -> None:
    """A silo-sim host's silos each read their own copy of the CA's list; its signature is checked once per
    process, by the exact bytes of the list and of the CA it is checked against, so the same list judged against
    another CA is checked (and refused) on its own."""
    ca, hub = setup
    s1 = pki.issue_silo(ca, "s1", tmp_path / "s1")
    pki.revoke(ca, "s1")
    copies = []
    for i in range(3):
        folder = tmp_path / f"copy{i}"
        folder.mkdir()
        shutil.copyfile(ca / "crl.pem", folder / "crl.pem")
        shutil.copyfile(ca / "ca.pem", folder / "ca.pem")
        copies.append(RevocationList(folder / "crl.pem", folder / "ca.pem"))
    assert all(c.is_revoked(_serial(s1)) and c.revoked_serials == {_serial(s1)} for c in copies)
    assert len({c.next_update for c in copies}) == 1

    foreign = pki.init_ca(tmp_path / "foreign")
    shutil.copyfile(foreign / "ca.pem", tmp_path / "copy0" / "ca.pem")  # the same list, another CA beside it
    with pytest.raises(CrlError, match="not signed by the federation CA"):
        RevocationList(tmp_path / "copy0" / "crl.pem", tmp_path / "copy0" / "ca.pem")
