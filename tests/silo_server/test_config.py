from pathlib import Path

import pytest

from silo_server.config import ConfigError, load_config, parse_config

BASE = {"data": {"labeled": {"kind": "demo"}}}


def test_defaults_are_the_papers_and_paths_resolve_next_to_the_file(tmp_path):
    cfg_file = tmp_path / "hub.yaml"
    cfg_file.write_text("data:\n  labeled: {kind: imagefolder, path: labeled}\nserver: {certs: pki/hub}\n")
    config = load_config(cfg_file)
    assert config.data.labeled.path == (tmp_path / "labeled").resolve()
    assert config.server.certs == (tmp_path / "pki" / "hub").resolve()
    opts = config.algorithm.parsed_options()
    assert (opts.tau, opts.local_epochs, opts.global_momentum, opts.mix_alpha) == (0.95, 5, 0.5, 0.75)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**BASE, "rounds": {"totl": 5}}, "unknown key 'rounds.totl'"),
        ({**BASE, "rounds": {"total": 0}}, "bad value for 'rounds.total'"),
        ({**BASE, "algorithm": {"name": "semifl", "options": {"tau": 1.5}}}, "algorithm"),
        ({**BASE, "algorithm": {"name": "semifl", "options": {"taux": 0.9}}}, "taux"),
        ({**BASE, "algorithm": {"name": "fedprox"}}, "unknown algorithm 'fedprox'"),
        ({**BASE, "model": {"name": "resnet"}}, "unknown model 'resnet'"),
        ({**BASE, "model": {"in_channels": 3, "mean": [0.5]}}, "mean needs 3 value(s)"),
        ({"data": {"labeled": {"kind": "imagefolder"}}}, "needs 'path'"),
        ({"run": {}}, "missing required key 'data'"),
        ({**BASE, "server": {"port": 70000}}, "bad value for 'server.port'"),
        # "at least 60 s" and "at most 15 s" cannot both hold: said, not quietly cut to 15
        ({**BASE, "server": {"min_linger_s": 60}}, "min_linger_s (60) is above linger_s (15)"),
    ],
)
def test_bad_configs_name_the_key(raw, message):
    with pytest.raises(ConfigError) as info:
        parse_config(raw, "hub.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("hub.yaml:")


def test_missing_file_and_bad_yaml_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(top)


def test_the_shipped_example_is_valid():
    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "hub.yaml")
    assert config.algorithm.name == "semifl"
    assert config.data.labeled.kind == "demo"
