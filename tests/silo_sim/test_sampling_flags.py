"""silo-sim --silos-per-round is a fraction and --silos-per-round-count a number: a value is never read both ways,
and the staged hub.yaml carries whichever was given (and takes the other key from --hub-set)."""

import pytest

from silo_server.config import load_config
from silo_sim.cli import apply_hub_settings, build_parser, rounds_sampling
from silo_sim.inprocess import run_inprocess
from silo_sim.stage import stage_federation


def _rounds(*argv: str) -> dict:
    return rounds_sampling(build_parser().parse_args(list(argv)))


def test_the_fraction_and_the_count_go_to_their_own_keys():
    assert _rounds() == {}  # the hub's default: every silo
    assert _rounds("--silos-per-round", "0.5") == {"silos_per_round": 0.5}
    assert _rounds("--silos-per-round", "1") == {"silos_per_round": 1.0}
    assert _rounds("--silos-per-round-count", "2") == {"silos_per_round_count": 2}


def test_a_count_given_as_a_fraction_says_which_flag_to_use():
    with pytest.raises(ValueError, match="fraction in \\(0, 1\\], got 3; for a number of silos use "
                                         "--silos-per-round-count"):
        _rounds("--silos-per-round", "3")
    with pytest.raises(ValueError, match="at least 1"):
        _rounds("--silos-per-round-count", "0")
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        build_parser().parse_args(["--silos-per-round", "0.5", "--silos-per-round-count", "2"])


def test_the_staged_hub_yaml_takes_the_count_keys(tmp_path):
    rounds = {"total": 2, "min_silos": 3, **_rounds("--silos-per-round-count", "2")}
    config = apply_hub_settings({"rounds": rounds}, ["rounds.quorum_silos=1"])
    staged = stage_federation(tmp_path, num_silos=3, labels_per_class=1, unlabeled_limit=30, test_per_class=1,
                              hub_config=config)
    r = load_config(staged.hub_config).rounds
    assert (r.silos_per_round_count, r.quorum_silos, r.min_silos) == (2, 1, 3)


def test_the_in_process_loop_refuses_a_count_as_a_fraction():
    with pytest.raises(ValueError, match="silos_per_round_count"):
        run_inprocess(None, None, [], rounds=1, silos_per_round=3)
