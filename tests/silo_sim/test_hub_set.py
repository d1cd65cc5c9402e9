"""silo-sim --hub-set: any hub.yaml key from the command line, checked like a hub.yaml."""

import pytest

from silo_core.rounds import DPRound, RoundRecord, Scores
from silo_sim.cli import apply_hub_settings
from silo_sim.report import baseline_options


def test_dotted_keys_set_yaml_values_in_nested_sections():
    config = {"algorithm": {"name": "semifl", "options": {}}, "model": {"name": "small_cnn"}}
    apply_hub_settings(config, ["privacy.secure_aggregation.enabled=true", "model.options.norm=group",
                                "privacy.sample_dp.enabled=yes", "privacy.sample_dp.noise_multiplier=0.8",
                                "privacy.dp.clip_tensors=[delta/]"])
    assert config["privacy"]["secure_aggregation"] == {"enabled": True}
    assert config["privacy"]["sample_dp"] == {"enabled": True, "noise_multiplier": 0.8}
    assert config["model"] == {"name": "small_cnn", "options": {"norm": "group"}}
    assert config["privacy"]["dp"]["clip_tensors"] == ["delta/"]


@pytest.mark.parametrize("pair, message", [
    ("privacy.dp.enabeld=true", "unknown key 'privacy.dp.enabeld'"),
    ("privacy=true", "must look like SECTION.KEY=VALUE"),
    ("rounds.total", "must look like SECTION.KEY=VALUE"),
    ("wire.half_precision.x=1", "half_precision is a value, not a section"),
    # Keys silo-sim sets from its own flags and reads back: the hub alone would follow a --hub-set on them.
    ("run.state_dir=elsewhere", r"silo-sim sets this key itself; use --workdir"),
    ("rounds.total=3", "use --rounds"),
    ("run.seed=7", "use --seed"),
    ("algorithm.name=fedseal", "use --algorithm"),
    ("data.labeled.kind=demo", "use the staging flags"),
    ("privacy.sample_dp.enabled=true", "model.options.norm: group"),
])
def test_bad_settings_fail_before_anything_starts_with_the_key_named(pair, message):
    with pytest.raises(ValueError, match=message):
        apply_hub_settings({"algorithm": {"name": "semifl", "options": {}}, "wire": {"half_precision": False}}, [pair])


def test_the_summary_marks_the_round_the_hub_kept_as_its_best_model():
    from rich.console import Console

    from silo_sim.report import summary_table

    history = [RoundRecord(round=r, scores=Scores(test_accuracy=t, validation_accuracy=v))
               for r, t, v in ((1, 0.61, 0.70), (2, 0.66, 0.78), (3, 0.64, 0.75))]
    console = Console(width=160, record=True)
    console.print(summary_table(history, None, "semifl"))
    text = console.export_text()
    assert "0.7800*" in text and "0.7500*" not in text and "0.7000*" not in text
    assert "best round on the hub's validation split: 2" in text
    console = Console(width=160, record=True)
    console.print(summary_table([RoundRecord(round=1, scores=Scores(test_accuracy=0.5))], None, "semifl"))
    text = console.export_text()
    assert "val acc" not in text and "epsilon" not in text  # no validation split, no DP: no such columns


def test_the_summary_marks_the_initial_model_when_no_round_beat_it():
    from rich.console import Console

    from silo_sim.report import summary_table

    initial = Scores(test_accuracy=0.65, validation_accuracy=0.80)  # the hub's labels alone
    history = [RoundRecord(round=r, scores=Scores(test_accuracy=t, validation_accuracy=v))
               for r, t, v in ((1, 0.61, 0.70), (2, 0.66, 0.79))]
    console = Console(width=160, record=True)
    console.print(summary_table(history, {"test_accuracy": 0.64, "seconds": 1.0}, "fedavg_fixmatch", initial))
    text = console.export_text()
    assert "0.8000*" in text and "0.7900*" not in text  # the model best_model.safetensors holds: round 0's
    # The server-only baseline's row has a cell in the validation column too, so its cells stay in their columns.
    cells = [c.strip() for c in next(line for line in text.splitlines() if "server-only" in line).split("│")]
    assert cells[1:4] == ["server-only", "0.6400", "-"] and cells[7] == "1.0s"  # its time under "round time"
    assert "the initial model (no round beat the hub's labels alone" in text
    assert "best round on the hub's validation split" not in text


def test_the_summary_shows_the_privacy_spent_against_the_budget():
    from rich.console import Console

    from silo_sim.report import summary_table

    dp = DPRound(epsilon=4.7285, delta=1e-5, epsilon_budget=7.5, noise_multiplier=1.0, sample_rate=1.0, clip_norm=0.05)
    console = Console(width=160, record=True)
    console.print(summary_table([RoundRecord(round=1, scores=Scores(test_accuracy=0.5), dp=dp)], None, "semifl"))
    text = console.export_text()
    assert "epsilon" in text and "4.73 / 7.5" in text


def test_silo_sim_refuses_a_secure_federation_too_small_for_its_dropout_tolerance():
    from silo_sim.cli import check_secure_aggregation_fits

    secure = {"privacy": {"secure_aggregation": {"enabled": True}}}
    with pytest.raises(ValueError, match="needs at least 4 silos in a round to survive 1 dropout"):
        check_secure_aggregation_fits(secure, 3)
    check_secure_aggregation_fits(secure, 4)
    check_secure_aggregation_fits({"privacy": {"secure_aggregation": {"enabled": True, "dropouts": 0}}}, 3)
    check_secure_aggregation_fits({}, 1)
    # The cohort the hub pins counts too: the hub would wait for a fifth silo that never comes.
    with pytest.raises(ValueError, match="needs at least 5 silos in a round to survive 1 dropout.* min_cohort 5"):
        check_secure_aggregation_fits({"privacy": {"secure_aggregation": {"enabled": True, "min_cohort": 5}}}, 4)


def test_the_summary_counts_the_silos_handed_the_model_outside_the_sample():
    """FedSEAL's ensemble_every_round: the silos left out of a round still receive its model; the table says how
    many and how many bytes, and a run without that option has no such column."""
    from rich.console import Console

    from silo_sim.report import summary_table

    record = RoundRecord(round=1, scores=Scores(test_accuracy=0.5), silos_sampled=3, silos_reported=3,
                         silos_received=7, bytes_down_received=957_656)
    console = Console(width=160, record=True)
    console.print(summary_table([record], {"test_accuracy": 0.4, "seconds": 1.0}, "fedseal"))
    text = console.export_text()
    assert "received" in text and "7 (957.7KB)" in text and "3/3" in text
    console = Console(width=160, record=True)
    console.print(summary_table([RoundRecord(round=1, scores=Scores(test_accuracy=0.5))], None, "fedseal"))
    assert "received" not in console.export_text()


def test_the_baseline_keeps_the_shared_options_server_only_can_take_and_names_the_rest():
    # FedSEAL's exponential schedule is no server-only schedule: once the baseline failed on it after every round
    # had trained, and the run ended without its summary.
    opts, left_out = baseline_options({"lr_schedule": "exponential", "hub_epochs": 2, "lr": 0.01, "tau": 0.9})
    assert (opts.hub_epochs, opts.lr, opts.lr_schedule, left_out) == (2, 0.01, "cosine", ["lr_schedule"])
    assert baseline_options({"hub_epochs": 3})[1] == []


def test_the_baseline_starts_from_the_runs_own_starting_weights(tmp_path, monkeypatch):
    # A run started from model.init_weights (a backbone) was compared with a server-only baseline from random weights,
    # overstating the silos' lift; the baseline (and replay) now read the same starting model as the hub.
    import yaml
    from safetensors.torch import save_file

    from silo_core.algorithms.server_only import ServerOnlyHub
    from silo_core.models import ModelSpec
    from silo_server.config import load_config
    from silo_sim.report import server_only_baseline
    from silo_sim.stage import stage_federation

    staged = stage_federation(tmp_path / "fed", num_silos=2, labels_per_class=1, unlabeled_limit=20, test_per_class=1)
    start = ModelSpec.from_config(load_config(staged.hub_config).model, 10).build().state_dict()
    save_file({k: v.contiguous() for k, v in start.items()}, str(tmp_path / "start.safetensors"))
    config = yaml.safe_load(staged.hub_config.read_text())
    config["model"]["init_weights"] = str(tmp_path / "start.safetensors")
    staged.hub_config.write_text(yaml.safe_dump(config))
    seen, init_state = [], ServerOnlyHub.init_state
    monkeypatch.setattr(ServerOnlyHub, "init_state", lambda self: seen.append(self.initial_weights) or init_state(self))
    server_only_baseline(staged, {"hub_epochs": 1, "init_epochs": 1}, 1, 0, "cpu")
    assert len(seen) == 1 and seen[0] is not None and set(seen[0]) == set(start)


def test_a_run_that_ended_early_is_compared_with_a_baseline_after_as_many_rounds_on_the_same_schedule(tmp_path,
                                                                                                      monkeypatch):
    # A run whose privacy budget ended it after round 2 of 5 was compared with a server-only baseline trained all
    # 5 rounds: more hub epochs than the run had, understating the silos' lift.
    from silo_core.algorithms.server_only import ServerOnlyHub
    from silo_sim.report import server_only_baseline
    from silo_sim.stage import stage_federation

    staged = stage_federation(tmp_path / "fed", num_silos=2, labels_per_class=1, unlabeled_limit=20, test_per_class=1)
    finished, real = [], ServerOnlyHub.finish_round
    monkeypatch.setattr(ServerOnlyHub, "finish_round",
                        lambda self, state, *a: finished.append((state.round + 1, self.total_rounds))
                        or real(self, state, *a))
    early = server_only_baseline(staged, {"hub_epochs": 1, "init_epochs": 1}, 5, 0, "cpu", rounds_run=2)
    assert early["rounds"] == 2 and finished == [(1, 5), (2, 5)]  # round 2 of a 5-round schedule, as the hub ran it
    finished.clear()
    full = server_only_baseline(staged, {"hub_epochs": 1, "init_epochs": 1}, 5, 0, "cpu")
    assert full["rounds"] == 5 and len(finished) == 5
