"""A silo that breaks the securely aggregated sum is found by group testing and quarantined; the run goes on.
Under count weighting (not only uniform averaging) an inflated or a negative summed weight is refused."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import yaml

from security.dp import DPConfig
from security.secagg import SecAggParams
from silo_core.algorithms.base import SiloResult
from silo_server.cli import main as server_main
from silo_server.rounds.breaker import BreakerHunt, BreakerSearch, QuarantineList
from silo_server.rounds.privacy import PrivacySection
from tests.silo_server.test_hostile_silo import HostileSecAggSilo, _wait
from tests.silo_server.test_privacy import D, Silo, make, round_until_stopped


def test_group_testing_finds_one_breaker_in_about_log2_attempts():
    for breaker in [f"s{i}" for i in range(7)]:
        hunt, live, attempts = BreakerHunt(), [f"s{i}" for i in range(7)], 0
        found = hunt.failed(live)  # the first sum with everyone failed
        attempts += 1
        rng = random.Random(3)
        while found is None:
            cohort = hunt.cohort(live, 4, rng)
            assert cohort is not None and len(cohort) == 4 and len(set(cohort) & hunt.suspects) < len(hunt.suspects)
            found = hunt.failed(cohort) if breaker in cohort else hunt.passed(cohort)
            attempts += 1
        assert found == breaker and attempts <= 6 and not hunt.active


def test_a_breaker_that_behaves_once_cannot_get_an_honest_silo_quarantined():
    # The breaker a behaves in one cohort that tests it: before, that cleared it for good, and the next failure
    # (its own, in a cohort filled with cleared silos first) left an honest suspect alone and quarantined it.
    hunt, live, rng = BreakerHunt(), ["a", "b", "c", "d", "x", "y"], random.Random(0)
    assert hunt.failed(["a", "b", "c", "d"]) is None
    assert hunt.passed(["a", "b", "x", "y"]) is None  # a behaves
    for _ in range(50):  # from now on a breaks every sum it is in, and behaves whenever that would single it out
        cohort = hunt.cohort(live, 4, rng)
        assert cohort is not None
        if "a" in cohort and hunt.suspects & set(cohort) != {"a"}:
            found = hunt.failed(cohort)
            assert found in (None, "a")
            if found == "a":
                break
        else:
            hunt.passed(cohort)
            if not hunt.active:  # every suspect behaved: the search ended, naming no one
                assert hunt.failed(["a", "b", "c", "d"]) is None
    assert "a" in hunt.suspects or not hunt.active  # never narrowed away from the breaker


def test_without_spare_silos_no_cohort_can_leave_a_suspect_out():
    hunt = BreakerHunt()
    hunt.failed(["a", "b", "c", "d"])
    assert hunt.cohort(["a", "b", "c", "d"], 4, random.Random(0)) is None  # every live silo is needed
    assert hunt.cohort(["a", "b", "c", "d", "e"], 4, random.Random(0)) is not None


def test_a_search_that_every_suspect_passed_ends_and_a_later_failure_starts_afresh():
    # No spare silos: the failed cohort of four is sampled again and passes (the breaker behaved once). A silo
    # that connects afterwards must not become the only suspect of the next failure and be quarantined for it.
    hunt = BreakerHunt()
    assert hunt.failed(["a", "b", "c", "d"]) is None
    assert hunt.passed(["a", "b", "c", "d"]) is None and not hunt.active
    assert hunt.failed(["a", "b", "c", "d", "e"]) is None
    assert hunt.suspects == {"a", "b", "c", "d", "e"}


def test_a_search_whose_remaining_suspects_left_ends_instead_of_lasting_for_ever():
    # A suspect gone for good (revoked, as the log advises) is in no passing sum: the search stayed active, every
    # cohort came back None ("no spare silos") and charged q = 1, and a later failure with another breaker
    # intersected with the old suspects and named an honest silo that had passed.
    search = BreakerSearch(quarantine=lambda q: None, seed=0)
    search.sum_refused(1, 1, ["s0", "s1", "s2", "s3"])
    search.sum_passed(1, ["s0", "s1", "s2", "x"])
    live = ["s0", "s1", "s2", "x", "s4", "s5", "d"]  # s3 is not live ...
    assert not search.hunt.exhausted(gone=())  # ... and only offline (or dropped): the search waits for it
    assert search.cohort(live, 4, 2, 1) is None and search.hunt.active  # the usual sample meanwhile
    assert search.hunt.exhausted(gone={"s3"})  # revoked: nothing more to learn
    assert search.cohort(live, 4, 2, 1, gone={"s3"}) is None
    assert not search.hunt.active
    assert search.hunt.failed(["s0", "s4", "s5", "d"]) is None  # a new search, from this cohort alone
    assert search.hunt.suspects == {"s0", "s4", "s5", "d"}
    # No suspect live at all (the search waits for them): the usual sample, and the search goes on
    search.hunt.passed(["s4"])
    assert search.cohort(["a", "b", "c", "e", "f"], 4, 3, 1) is None and search.hunt.active


def test_the_silos_gone_for_good_are_those_revoked_departed_or_quarantined_not_those_offline(tmp_path):
    from silo_server.rounds.breaker import Quarantine
    from silo_server.state.registry import Departure
    from tests.silo_server.test_hub import make_hub

    hub = make_hub(tmp_path)
    for s in ("a", "b", "c", "d", "e"):
        hub.join(s, 10, 0, "cpu", serial=ord(s))
    hub.registry.revoke("a", in_round=False)
    hub.leave("b", hub.run_id, Departure("budget", "lifetime_epsilon", "1", "1.1", "budget spent", 0))
    hub.registry.quarantine.add(Quarantine("c", 1, 2, "breaks the sum", "2026-11-30T00:00:00"))
    hub.registry.silos["d"].last_seen = 1.0  # offline for a long while: may come back by itself
    assert hub.registry.gone_for_good() == {"a", "b", "c"}
    hub.join("a", 10, 0, "cpu", serial=0x999)  # a new certificate
    assert hub.registry.gone_for_good() == {"b", "c"}


class CountWeightedBreaker(HostileSecAggSilo):
    pass


def until_the_first_attempt_fails(hub, weight: float) -> None:
    """Four honest silos and s4, a breaker sending `weight`, take part in secure rounds until an attempt fails;
    then the hub is stopped."""
    silos = [Silo(hub, f"s{i}", 0.01) for i in range(4)] + [CountWeightedBreaker(hub, "s4", 0.0, weight=weight)]
    for s in silos:
        s.start()
    runner, _ = round_until_stopped(hub)
    _wait(lambda: hub.registry.counters.get("rounds_failed", 0) >= 1)
    hub.stop()
    runner.join(10)


@pytest.mark.parametrize("weight, words", [(5000.0, "is 1028, outside [0, 50]"), (-30.0, "outside [0, 50]")])
def test_under_count_weighting_an_inflated_or_negative_summed_weight_is_refused(tmp_path, caplog, weight, words):
    params = SecAggParams(enabled=True, threshold=0.5, stage_deadline_s=2.0)
    hub = make(tmp_path, PrivacySection(secure_aggregation=params), min_silos=5, quorum=0.6)  # count weighted
    until_the_first_attempt_fails(hub, weight)
    assert hub.records.history == [] and hub.registry.refusals.get("bad_aggregate") == 1
    # No one silo is known to have sent it: the per-silo refusal counter gets no label that is not a silo.
    assert all(silo in hub.registry.silos for silo, _ in hub.registry.refusals_by_silo)
    failure = next(r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage())
    assert "securely aggregated sum of 5 silos was refused" in failure and words in failure, failure
    # The search this failure began outlives a restart before the round is applied (no checkpoint since round 0):
    # a restarted hub does not draw the cohort that already failed as if nothing were known.
    assert hub.rounds.hunt.suspects == {f"s{i}" for i in range(5)} and hub.rounds.hunt.failed_attempts == 1
    again = make(tmp_path, PrivacySection(secure_aggregation=params), min_silos=5, quorum=0.6)
    assert again.rounds.resume_or_init().round == 0
    assert again.rounds.hunt.to_json() == hub.rounds.hunt.to_json()


def test_under_dp_a_refused_sum_is_charged_because_it_was_unmasked_and_the_charge_survives_a_restart(tmp_path):
    # The silos' ledgers charge the masked input they sent; the hub unmasked the sum before refusing it, so the
    # released sum counts at the hub too. Before, the hub's accountant skipped it and fell below the silos'.
    params = SecAggParams(enabled=True, threshold=0.5, stage_deadline_s=2.0)
    section = PrivacySection(secure_aggregation=params, dp=DPConfig(enabled=True, noise_multiplier=1.0,
                                                                    clip_norm=200.0))
    hub = make(tmp_path, section, min_silos=5, quorum=0.6)
    until_the_first_attempt_fails(hub, -30.0)
    assert hub.records.history == [] and hub.registry.refusals.get("bad_aggregate", 0) >= 1
    charged = hub.privacy.dp.rounds
    assert charged == hub.registry.refusals["bad_aggregate"] and hub.privacy.dp.epsilon() > 0
    # No checkpoint since round 0: a restarted hub reads the charge from the refused attempt's file.
    again = make(tmp_path, section, min_silos=5, quorum=0.6)
    assert again.rounds.resume_or_init().round == 0
    assert again.privacy.dp.rounds == charged
    assert again.privacy.dp.epsilon() == pytest.approx(hub.privacy.dp.epsilon())


def test_a_secure_aggregation_breaker_among_six_honest_silos_is_quarantined_and_the_run_finishes(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    params = SecAggParams(enabled=True, threshold=0.5, dropouts=0, stage_deadline_s=2.0)  # rounds of >= 3 silos
    hub = make(tmp_path, PrivacySection(secure_aggregation=params), rounds=3, min_silos=6, quorum=1.0)
    honest = [Silo(hub, f"s{i}", 0.01) for i in range(6)]
    breaker = CountWeightedBreaker(hub, "s6", 0.0, weight=-30.0)
    for s in [*honest, breaker]:
        s.start()
    state = hub.run()
    assert state.round == 3  # the run went on
    assert hub.registry.quarantine.names() == {"s6"}
    entry = hub.registry.quarantine.entries()["s6"]
    assert 1 <= entry.attempts <= 5 and entry.round <= 3
    assert hub.registry.counters["rounds_failed"] <= 5
    assert any(r.levelno == logging.WARNING and "silo s6 is quarantined" in r.getMessage() for r in caplog.records)
    assert "s6" not in hub.registry.live_silos()
    applied = [r for r in hub.records.history if r.secagg is not None]
    assert all(r.secagg.contributors >= 3 for r in applied)
    assert hub.records.history[-1].silos_sampled == 6  # s6 left out
    # Every applied round's model moved by the honest silos' delta alone: no round took the breaker's input.
    assert torch.allclose(state.tensors["model/x"], torch.full((D,), 0.03), atol=0.01)

    # The operator lifts it; a lift of a silo that is not quarantined is an error naming it.
    config = tmp_path / "hub.yaml"
    config.write_text(yaml.safe_dump({"run": {"state_dir": str(tmp_path)}, "data": {"labeled": {"kind": "demo"}}}))
    assert server_main(["--config", str(config), "--lift-quarantine", "s6"]) == 0
    assert QuarantineList(tmp_path).names() == set()
    assert server_main(["--config", str(config), "--lift-quarantine", "s6"]) == 2


def test_the_quarantine_list_survives_a_restart_and_is_reread_when_the_file_changes(tmp_path):
    from silo_server.rounds.breaker import Quarantine

    first = QuarantineList(tmp_path)
    first.add(Quarantine("x", 2, 3, "broke the sum", "2026-11-27T00:00:00+00:00"))
    second = QuarantineList(tmp_path)  # another process (the CLI), or the hub after a restart
    assert second.names() == {"x"} and second.entries()["x"].attempts == 3
    assert second.lift("x") and first.names() == set()
    (tmp_path / "quarantine.json").write_text("not json")
    with pytest.raises(ValueError, match="quarantine.json is not a quarantine list"):
        QuarantineList(tmp_path).names()
    assert SiloResult  # noqa: B018 (imported for the hostile silo's result type)
