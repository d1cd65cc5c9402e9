"""The branch's privacy ledger (silo_client/ledger.py): its own count of client-level and sample-level epsilon per
run and over the silo's lifetime, on disk and restart-safe."""

from __future__ import annotations

import json
import math

import pytest

from security.dp import PrivacyAccountant
from silo_client.ledger import LEDGER_FILE, BranchLedger, LedgerError, RunEpsilon

FP = "ab" * 32
TERMS = "cd" * 32


def begin(ledger: BranchLedger, run: str, *, noise: float | None = 1.1, sample_dp: bool = False) -> None:
    ledger.begin_run(run, hub_serial="1a2b", hub_fingerprint=FP, terms_sha256=TERMS, client_dp_noise=noise,
                     sample_dp=sample_dp)


def q1_epsilon(noise: float, rounds: int, delta: float = 1e-5) -> float:
    acc = PrivacyAccountant("rdp", delta)
    acc.step(noise, 1.0, rounds)
    return acc.epsilon()


def test_a_new_ledger_is_written_at_its_first_round_and_spends_nothing_before(tmp_path):
    ledger = BranchLedger(tmp_path / "state")
    begin(ledger, "run-1")
    assert not (tmp_path / "state" / LEDGER_FILE).exists()  # nothing spent yet: nothing written
    assert ledger.run_epsilon("run-1") == RunEpsilon(None, None, 0.0)
    ledger.record_round("run-1", 1, client_dp_noise=None, sample_epsilon=None, task="t1")
    data = json.loads((tmp_path / "state" / LEDGER_FILE).read_text())
    assert (list(data["runs"]), data["delta"]) == (["run-1"], 1e-5)
    assert "holds against any hub" in data["guarantees"]["sample_dp"]["holds"]
    assert "minimum number of cohort silos add their noise honestly" in data["guarantees"]["client_dp"]["holds"]
    assert data["runs"]["run-1"]["begun"] and data["runs"]["run-1"]["hub"]["serial"]


def test_client_level_epsilon_is_the_gaussian_mechanism_at_q_1_per_contributed_round(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    for k in range(1, 6):
        ahead = ledger.client_epsilon_after("run-1", 1.1)
        got = ledger.record_round("run-1", k, client_dp_noise=1.1, sample_epsilon=None)
        assert got.client == pytest.approx(q1_epsilon(1.1, k), rel=1e-12)
        assert ahead == got.client and got == RunEpsilon(got.client, None, got.client)
    # no amplification by subsampling is claimed: sampling half the silos would have given a smaller figure
    sampled = PrivacyAccountant("rdp", 1e-5)
    sampled.step(1.1, 0.5, 5)
    assert ledger.run_epsilon("run-1").client > sampled.epsilon() * 1.5
    assert ledger.runs()["run-1"]["client_accountant"]["history"] == [[1.1, 1.0, 5]]


def test_a_task_released_twice_is_charged_twice(tmp_path):
    """A silo that trains the same task again (restarted before the hub took its upload) sends a new noised
    update: the ledger charges it as a second release, so a hub that reports uploads lost gains no free samples."""
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    first = ledger.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=None, task="t1")
    again = ledger.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=None, task="t1")
    assert first.client == pytest.approx(q1_epsilon(1.1, 1))
    assert again.client == pytest.approx(q1_epsilon(1.1, 2), rel=1e-12) and again.client > first.client
    run = ledger.runs()["run-1"]
    assert [(e["round"], e["task"], e["release"]) for e in run["rounds"]] == [(1, "t1", 1), (1, "t1", 2)]
    assert run["client_accountant"]["history"] == [[1.1, 1.0, 2]] and ledger.releases("run-1", 1, "t1") == 2


def test_the_ledger_survives_a_restart(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    for k in (1, 2, 3):
        ledger.record_round("run-1", k, client_dp_noise=1.1, sample_epsilon=None)
    before = ledger.run_epsilon("run-1")

    restarted = BranchLedger(tmp_path)
    begin(restarted, "run-1")  # the restarted silo begins the same run again: nothing is reset
    assert restarted.run_epsilon("run-1") == before
    fourth = restarted.record_round("run-1", 4, client_dp_noise=1.1, sample_epsilon=None)
    assert fourth.client == pytest.approx(q1_epsilon(1.1, 4), rel=1e-12) and fourth.client > before.client
    assert [r["round"] for r in BranchLedger(tmp_path).runs()["run-1"]["rounds"]] == [1, 2, 3, 4]


def test_image_level_is_the_smaller_guarantee_and_lifetime_the_sum_of_runs(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1", sample_dp=True)
    ledger.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=0.4)
    a = ledger.record_round("run-1", 2, client_dp_noise=1.1, sample_epsilon=0.7)
    assert a == RunEpsilon(pytest.approx(q1_epsilon(1.1, 2)), 0.7, 0.7)  # DP-SGD's 0.7 < client-level ~7

    begin(ledger, "run-2", noise=3.0, sample_dp=True)
    b = ledger.record_round("run-2", 1, client_dp_noise=3.0, sample_epsilon=50.0)
    assert b.image == b.client == pytest.approx(q1_epsilon(3.0, 1)) and b.sample == 50.0

    assert ledger.lifetime_epsilon() == pytest.approx(0.7 + b.client)
    assert ledger.lifetime_epsilon(exclude_run="run-2") == pytest.approx(0.7)
    assert ledger.lifetime_delta() == pytest.approx(2e-5)
    last = ledger.runs()["run-2"]["rounds"][-1]
    assert last["lifetime"] == pytest.approx(0.7 + b.client) and last["lifetime_delta"] == pytest.approx(2e-5)
    assert {k: last[k] for k in ("round", "client", "sample", "image")} == {
        "round": 1, "client": b.client, "sample": 50.0, "image": b.image}


def test_a_sample_total_that_goes_down_never_lowers_what_was_spent(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1", noise=None, sample_dp=True)
    ledger.record_round("run-1", 1, client_dp_noise=None, sample_epsilon=0.9)
    assert ledger.record_round("run-1", 2, client_dp_noise=None, sample_epsilon=0.3) == RunEpsilon(None, 0.9, 0.9)


def test_a_round_without_either_guarantee_makes_the_run_unbounded(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    ledger.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=None)
    got = ledger.record_round("run-1", 2, client_dp_noise=None, sample_epsilon=None)
    assert got == RunEpsilon(math.inf, None, math.inf)
    assert ledger.client_epsilon_after("run-1", 1.1) == math.inf
    begin(ledger, "run-2", noise=None)
    assert ledger.record_round("run-2", 1, client_dp_noise=None, sample_epsilon=None) == RunEpsilon(None, None,
                                                                                                     math.inf)
    assert ledger.lifetime_epsilon() == math.inf
    # standard JSON on disk (no Infinity), and read back as inf
    text = (tmp_path / LEDGER_FILE).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c} in the ledger"))
    assert BranchLedger(tmp_path).run_epsilon("run-1") == RunEpsilon(math.inf, None, math.inf)


@pytest.mark.parametrize("content, why", [
    ("{", "not JSON"),
    ("", "not JSON"),
    ('{"format": "silokit branch privacy ledger v1", "delta": 1e-05, "runs": {"r": {"delta": 1e-05}}}', "lacks"),
    ("[]", "format"),
])
def test_a_damaged_ledger_is_refused_by_name_and_left_alone(tmp_path, content, why):
    path = tmp_path / LEDGER_FILE
    path.write_text(content)
    with pytest.raises(LedgerError) as err:
        BranchLedger(tmp_path)
    assert str(path) in str(err.value) and why in str(err.value)
    assert "Never delete it" in str(err.value)
    assert path.read_text() == content


def test_a_tampered_round_is_refused(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    ledger.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=None)
    data = json.loads((tmp_path / LEDGER_FILE).read_text())
    data["runs"]["run-1"]["rounds"][0]["image"] = -1
    (tmp_path / LEDGER_FILE).write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="run 'run-1' round 1: image is -1"):
        BranchLedger(tmp_path)


def test_begin_run_keeps_the_first_settings_and_records_changes(tmp_path):
    ledger = BranchLedger(tmp_path)
    begin(ledger, "run-1")
    first = ledger.runs()["run-1"]
    begin(ledger, "run-1")
    assert ledger.runs()["run-1"] == first  # idempotent
    ledger.begin_run("run-1", hub_serial="9f", hub_fingerprint=FP, terms_sha256=TERMS, client_dp_noise=1.1,
                     sample_dp=False)
    ledger.record_leave("run-1", "refused", "terms", "the settings are written with the run's first record")
    run = BranchLedger(tmp_path).runs()["run-1"]
    assert run["hub"] == {"serial": "1a2b", "fingerprint": FP}
    assert [{k: v for k, v in c.items() if k != "time"} for c in run["changes"]] == [
        {"hub": {"serial": "9f", "fingerprint": FP}}]


def test_leaving_before_a_run_began_and_unknown_runs(tmp_path):
    ledger = BranchLedger(tmp_path)
    ledger.record_leave("run-x", "refused", "dp.noise_multiplier", "the hub offered 0.3, the policy needs 1.0")
    with pytest.raises(LedgerError, match=r"no run 'run-y'; call begin_run"):
        ledger.record_round("run-y", 1, client_dp_noise=1.1, sample_epsilon=None)
    begin(ledger, "run-x")
    run = ledger.runs()["run-x"]
    assert run["hub"]["serial"] == "1a2b" and run["changes"] == [] and run["rounds"] == []
    assert [(x["kind"], x["clause"]) for x in run["leaves"]] == [("refused", "dp.noise_multiplier")]
    with pytest.raises(LedgerError, match="client_dp_noise must be a positive number"):
        ledger.record_round("run-x", 1, client_dp_noise=0.0, sample_epsilon=None)
    with pytest.raises(LedgerError, match="sample_epsilon must be >= 0"):
        ledger.record_round("run-x", 1, client_dp_noise=None, sample_epsilon=math.nan)
    assert BranchLedger(tmp_path).runs()["run-x"]["rounds"] == []


def test_another_delta_leaves_old_runs_at_theirs_and_sums_the_deltas(tmp_path):
    old = BranchLedger(tmp_path, delta=1e-5)
    begin(old, "run-1")
    old.record_round("run-1", 1, client_dp_noise=1.1, sample_epsilon=None)
    new = BranchLedger(tmp_path, delta=1e-6)
    begin(new, "run-2")
    eps = new.record_round("run-2", 1, client_dp_noise=1.1, sample_epsilon=None)
    runs = new.runs()
    assert (runs["run-1"]["delta"], runs["run-2"]["delta"]) == (1e-5, 1e-6)
    assert eps.client == pytest.approx(q1_epsilon(1.1, 1, delta=1e-6))
    assert new.run_epsilon("run-1").client == pytest.approx(q1_epsilon(1.1, 1, delta=1e-5))
    assert new.lifetime_delta() == pytest.approx(1.1e-5)
    assert runs["run-2"]["rounds"][0]["lifetime_delta"] == pytest.approx(1.1e-5)
    assert json.loads((tmp_path / LEDGER_FILE).read_text())["delta"] == 1e-6
    assert (new.run_delta("run-1"), new.run_delta("run-2"), new.run_delta("not-begun")) == (1e-5, 1e-6, 1e-6)


def test_a_retried_round_is_charged_again(tmp_path):
    """The hub retried round 1 (a new task): the silo trained and released again, so it pays again."""
    ledger = BranchLedger(tmp_path)
    ledger.begin_run("r", hub_serial="1", hub_fingerprint="ab" * 32, terms_sha256="cd" * 32, client_dp_noise=1.0,
                     sample_dp=False)
    first = ledger.record_round("r", 1, client_dp_noise=1.0, sample_epsilon=None, task="r-r1-a1")
    retried = ledger.record_round("r", 1, client_dp_noise=1.0, sample_epsilon=None, task="r-r1-a2")
    two = PrivacyAccountant("rdp", 1e-5)
    two.step(1.0, 1.0, 2)
    assert retried.client == pytest.approx(two.epsilon()) and retried.client > first.client
    assert [r["task"] for r in BranchLedger(tmp_path).runs()["r"]["rounds"]] == ["r-r1-a1", "r-r1-a2"]
