"""The security section of hub.yaml: defaults, and bad values named by their key."""

import pytest

from silo_server.config import ConfigError, parse_config

DATA = {"labeled": {"kind": "demo"}}


def test_defaults_enforce_nothing_extra_and_take_the_crl_from_the_bundle(tmp_path) -> None:
    sec = parse_config({"data": DATA}, base=tmp_path).security
    assert (sec.crl, sec.allowed_silos, sec.max_update_norm) == (None, None, None)
    sec = parse_config({"data": DATA, "security": {"crl": "ca/crl.pem", "allowed_silos": ["branch-01", "b.2"],
                                                   "max_update_norm": 25}}, base=tmp_path).security
    assert sec.crl == (tmp_path / "ca" / "crl.pem").resolve() and sec.allowed_silos == ["branch-01", "b.2"]
    assert sec.max_update_norm == 25.0


@pytest.mark.parametrize("security, words", [
    ({"allowed_silos": ["ok", "not ok"]}, "'security.allowed_silos': Value error, invalid silo name 'not ok'"),
    ({"allowed_silos": ["hub"]}, "reserved for the hub"),
    ({"allowed_silos": ["a", "a"]}, "lists a silo twice"),
    ({"max_update_norm": 0}, "'security.max_update_norm'"),
    ({"allow_plaintext": True}, "unknown key 'security.allow_plaintext'"),
])
def test_bad_security_values_name_the_key(tmp_path, security, words) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"data": DATA, "security": security}, "hub.yaml", base=tmp_path)
    assert words in str(info.value)
