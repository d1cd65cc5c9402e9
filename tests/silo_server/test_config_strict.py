"""hub.yaml is read strictly: a value means one thing or is refused with its key named and what to write instead.

Every bad value below passed validation before (a YAML `true` or `'10'` as a count, `.inf` as a learning rate,
`quorum: 2` as a count of silos in a key that also took fractions)."""

from __future__ import annotations

import pytest

from silo_server.config import ConfigError, load_config, parse_config

BASE = {"data": {"labeled": {"kind": "demo"}}}


@pytest.mark.parametrize("raw, words", [
    ({"rounds": {"total": True}}, ["'rounds.total'", "valid integer, got True", "whole number without quotes"]),
    ({"rounds": {"total": "10"}}, ["'rounds.total'", "got '10'", "without quotes"]),
    ({"algorithm": {"name": "semifl", "options": {"lr": float("inf")}}},
     ["'algorithm.options.lr'", "finite number", ".inf and .nan are not settings"]),
    ({"algorithm": {"name": "fedseal", "options": {"lr": float("nan")}}}, ["'algorithm.options.lr'", "finite"]),
    ({"algorithm": {"name": "hassle", "options": {"local_epochs": 5.0}}},
     ["'algorithm.options.local_epochs'", "whole number"]),
    ({"algorithm": {"name": "semifl", "options": {"flip": "no"}}}, ["'algorithm.options.flip'", "true or false"]),
    ({"server": {"max_workers": 10_000_000}}, ["'server.max_workers'", "less than or equal to 10000"]),
    ({"rounds": {"deadline_s": 1e9}}, ["'rounds.deadline_s'", "less than or equal to 86400"]),
    ({"wire": {"max_upload_bytes": 1 << 50}}, ["'wire.max_upload_bytes'", "less than or equal"]),
    ({"rounds": {"quorum": 2}}, ["'rounds.quorum'", "fraction of the sampled silos", "use rounds.quorum_silos: 2"]),
    ({"rounds": {"quorum": 2.0}}, ["'rounds.quorum'", "use rounds.quorum_silos: 2"]),
    ({"rounds": {"quorum": 1}}, ["'rounds.quorum'", "1.0 for all", "use rounds.quorum_silos: 1"]),
    ({"rounds": {"silos_per_round": 3}}, ["'rounds.silos_per_round'", "use rounds.silos_per_round_count: 3"]),
    ({"rounds": {"quorum": 0.5, "quorum_silos": 2}}, ["rounds.quorum (a fraction) or rounds.quorum_silos", "not both"]),
    ({"rounds": {"silos_per_round": 0.5, "silos_per_round_count": 2}}, ["silos_per_round_count", "not both"]),
    ({"rounds": {"silos_per_round_count": 2, "quorum_silos": 3}}, ["no round could reach it"]),
    ({"rounds": {"quorum_silos": True}}, ["'rounds.quorum_silos'", "whole number"]),
    ({"model": {"in_channels": True}}, ["'model.in_channels'", "whole number"]),
    ({"model": {"name": "wrn28_2", "options": {"scale": float("inf")}}}, ["options.scale", "finite"]),
    ({"model": {"options": {"width": 100_000}}}, ["options.width must be at most 4096"]),
    ({"model": {"std": [0.0]}}, ["std values must be positive"]),
    ({"privacy": {"secure_aggregation": {"enabled": "yes"}}},
     ["'privacy.secure_aggregation.enabled'", "true or false"]),
    ({"privacy": {"dp": {"noise_multiplier": float("nan")}}}, ["'privacy.dp.noise_multiplier'", "finite"]),
    ({"privacy": {"sample_dp": {"clip_norm": float("inf")}}}, ["'privacy.sample_dp.clip_norm'", "finite"]),
    ({"privacy": {"secure_aggregation": {"quantization": [{"pattern": "*", "clip": float("inf"), "bits": 20}]}}},
     ["'privacy.secure_aggregation.quantization.0.clip'", "finite"]),
    ({"data": {"labeled": {"kind": "demo", "labels_per_class": "5"}}}, ["'data.labeled.labels_per_class'"]),
])
def test_a_value_that_could_be_read_two_ways_is_refused_with_its_key_and_what_to_write(raw, words):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **raw}, "hub.yaml")
    message = str(info.value)
    assert message.startswith("hub.yaml: bad value for ")
    for w in words:
        assert w in message, (w, message)


def test_yaml_written_the_natural_way_still_loads(tmp_path):
    """Strict types, yet the file an operator writes loads: paths as strings, `lr: 1` for a float, lists for
    mean/std and the secure-aggregation rules, the count keys of sampling and quorum."""
    cfg = tmp_path / "hub.yaml"
    cfg.write_text(
        "run: {state_dir: state, seed: 3}\n"
        "server: {port: 0, certs: pki/hub, long_poll_s: 5}\n"
        "data:\n  labeled: {kind: imagefolder, path: labeled, labels_per_class: 5}\n"
        "  test: {kind: torchvision, name: FashionMNIST, root: data, split: test}\n"
        "model: {in_channels: 3, image_size: 32, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}\n"
        "algorithm: {name: fedseal, options: {lr: 1, local_epochs: 2, theta: 0.1, flip: false}}\n"
        "rounds: {total: 3, silos_per_round_count: 5, quorum_silos: 2, deadline_s: 60}\n"
        "security: {crl: pki/crl.pem, allowed_silos: [a, b], max_update_norm: 10}\n"
        "privacy:\n  secure_aggregation: {enabled: true, quantization: [{pattern: '*', clip: 1, bits: 16}]}\n"
        "  dp: {enabled: true, noise_multiplier: 1, clip_tensors: [delta/]}\n"
    )
    config = load_config(cfg)
    assert config.run.state_dir == (tmp_path / "state").resolve()
    assert config.data.test.root == (tmp_path / "data").resolve()
    assert config.security.crl == (tmp_path / "pki" / "crl.pem").resolve()
    assert config.algorithm.parsed_options().lr == 1.0
    assert config.privacy.secure_aggregation.quantization[0].clip == 1.0
    r = config.rounds
    assert (r.silos_per_round_count, r.quorum_silos, r.silos_per_round, r.quorum) == (5, 2, 1.0, 0.5)
