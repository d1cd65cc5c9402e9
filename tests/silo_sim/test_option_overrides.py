"""silo-sim says which --option values replace the demo's per-algorithm tuning (DEMO_OPTIONS)."""

from silo_sim.cli import DEMO_OPTIONS, main, option_overrides


def test_each_option_that_replaces_a_demo_value_is_named_with_both_values(tmp_path, capsys) -> None:
    assert DEMO_OPTIONS["semifl"]["tau"] == 0.8 and DEMO_OPTIONS["semifl"]["lr"] == 0.03
    rc = main(["--export-demo", str(tmp_path / "demo"), "--silos", "2", "--unlabeled", "40", "--test-per-class", "2",
               "--option", "tau=0.9", "--option", "lr=0.03", "--option", "mix_alpha=0.5"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if "overrides the demo's" in line]
    # lr equals the demo's value and mix_alpha is not one the demo sets: neither is an override.
    assert lines == ["--option tau=0.9 overrides the demo's tau=0.8 for semifl"]


def test_algorithms_without_demo_tuning_report_nothing() -> None:
    assert option_overrides("no-such-demo", {"tau": 0.5}) == []
    assert option_overrides("hassle", {"local_epochs": 3, "gamma": 0.1}) == [
        "--option local_epochs=3 overrides the demo's local_epochs=2 for hassle"]
