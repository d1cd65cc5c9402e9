"""The hub's metrics, read from a real registry while a real hub core (no network) runs rounds."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from security.dp import DPConfig, DPController
from security.pki import init_ca, issue_hub, issue_silo, renew
from security.tls import ReloadingServerCredentials
from silo_core.rounds import RoundRecord, Scores, SecAggRound, threshold_metric
from silo_server.hub import Refusal
from silo_server.metrics import REFUSAL_REASONS, SECAGG_STAGES, HubMetrics
from silo_server.rounds.privacy import PrivacySection
from silo_server.state.registry import Departure
from tests.silo_server.test_hub import make_hub, result, start_round, upload, wait_task
from tests.silo_server.test_privacy import SECAGG, run_with_silos
from tests.silo_server.test_privacy import make as make_private_hub


def samples(metrics: HubMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics, name, **labels):
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_a_round_shows_up_in_round_silo_traffic_and_refusal_metrics(tmp_path):
    hub = make_hub(tmp_path / "hub", run_description={"algorithm": "mean", "num_classes": 3,
                                                      "algorithm_options": {"tau": 0.9}})
    seen = []
    hub.rounds.on_round = seen.append  # an existing callback keeps working
    m = HubMetrics(hub)
    before = samples(m)
    assert before[("silokit_hub_phase", (("phase", "starting"),))] == 1
    assert before[("silokit_hub_rounds_completed", ())] == 0
    assert before[("silokit_hub_test_accuracy_ratio", ())] != before[("silokit_hub_test_accuracy_ratio", ())]  # NaN
    for reason in REFUSAL_REASONS:  # exported at zero before the first refusal
        assert before[("silokit_hub_refusals_total", (("reason", reason),))] == 0
    for stage in SECAGG_STAGES:
        assert before[("silokit_hub_secagg_stage_duration_seconds_count", (("stage", stage),))] == 0
    assert before[("silokit_hub_dp_epsilon_spent", ())] == 0 and before[("silokit_hub_dp_epsilon_budget", ())] == 0

    hub.join("a", 10, 0, "cpu")
    hub.join("b", 10, 0, "cpu", preparing=True)  # still loading its images
    loading = samples(m)
    assert loading[("silokit_hub_silos_connected", ())] == 2 and loading[("silokit_hub_silos_preparing", ())] == 1
    hub.join("b", 10, 0, "cpu")
    thread, out = start_round(hub)
    ta, tb = wait_task(hub, "a"), wait_task(hub, "b")
    bundle = hub.download("a", hub.run_id, ta.task_id)
    live = samples(m)
    assert live[("silokit_hub_phase", (("phase", "training"),))] == 1
    assert live[("silokit_hub_current_round_silos", (("state", "sampled"),))] == 2
    assert live[("silokit_hub_round_attempt", ())] == 1
    assert live[("silokit_hub_sent_bytes_total", ())] == len(bundle)
    upload(hub, "a", ta, result(1.0))
    with pytest.raises(Refusal, match="already reported"):
        upload(hub, "a", ta, result(1.0))  # duplicate: refused and counted
    upload(hub, "b", tb, {}, skipped=True)
    thread.join(timeout=10)
    assert out["state"].round == 1 and [e.round for e in seen] == [1] and seen == hub.records.history

    after = samples(m)
    assert after[("silokit_hub_rounds_completed", ())] == 1
    assert after[("silokit_hub_refusals_total", (("reason", "duplicate"),))] == 1
    assert after[("silokit_hub_updates_accepted_total", (("kind", "update"),))] == 1
    assert after[("silokit_hub_updates_accepted_total", (("kind", "skip"),))] == 1
    assert after[("silokit_hub_received_bytes_total", ())] > 0
    assert after[("silokit_hub_round_silos", (("state", "reported"),))] == 2
    assert after[("silokit_hub_round_silos", (("state", "skipped"),))] == 1
    assert after[("silokit_hub_round_silos", (("state", "dropped"),))] == 0
    assert after[("silokit_hub_round_duration_seconds_count", ())] == 1
    assert after[("silokit_hub_aggregation_duration_seconds_count", ())] == 1
    # The round's checkpoint write is timed in its record, in history.json and in the histogram.
    assert hub.records.history[0].checkpoint_seconds is not None and hub.records.history[0].checkpoint_seconds > 0
    saved = json.loads((tmp_path / "hub" / "history.json").read_text())["rounds"][0]
    assert saved["checkpoint_seconds"] == hub.records.history[0].checkpoint_seconds
    assert after[("silokit_hub_checkpoint_duration_seconds_count", ())] == 1
    assert after[("silokit_hub_checkpoint_duration_seconds_sum", ())] == pytest.approx(saved["checkpoint_seconds"])
    assert after[("silokit_hub_silos_enrolled", ())] == 2 and after[("silokit_hub_silos_connected", ())] == 2
    assert after[("silokit_hub_silos_preparing", ())] == 0
    assert after[("silokit_hub_silo_rounds_contributed", (("silo", "a"),))] == 1
    assert after[("silokit_hub_silo_rounds_contributed", (("silo", "b"),))] == 0
    # SemiFL-style single tau: every class must pass the same threshold.
    assert [after[("silokit_hub_class_threshold", (("class", str(k)),))] for k in range(3)] == [0.9] * 3


def test_no_class_threshold_gauge_when_each_silo_computes_its_own(tmp_path):
    shown = {}
    for rule in ("fixed", "freematch"):
        hub = make_hub(tmp_path / rule, run_description={
            "algorithm": "mean", "num_classes": 3, "algorithm_options": {"tau": 0.9, "threshold_rule": rule}})
        shown[rule] = [v for (name, _), v in samples(HubMetrics(hub)).items() if name == "silokit_hub_class_threshold"]
    assert shown == {"fixed": [0.9] * 3, "freematch": []}  # the hub cannot know the silos' own thresholds


def test_round_records_feed_accuracy_thresholds_privacy_and_secagg(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    # The DP part comes from the controller that produces it in a real round, not from keys written here.
    dp = DPController(DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=1.0, epsilon_budget=8.0),
                      secure_aggregation=False, seed=0)
    spent = []
    for r, acc in ((1, 0.70), (2, 0.62)):
        _, charged = dp.finish_round({"delta/x": torch.zeros(3)}, contributors=2, expected_silos=3, enrolled=3)
        spent.append(charged.epsilon)
        secagg = SecAggRound(sampled=3, advertised=3, u1=3, u2=3, u3=2, u4=2, degree=2, threshold=2, bytes_in=10,
                             bytes_out=20, stage_seconds={"share_keys": 0.3})
        record = RoundRecord(
            round=r, scores=Scores(test_accuracy=acc, test_loss=1.0 - acc), round_seconds=3.0 * r,
            aggregation_seconds=0.2, evaluation_seconds=0.4, silo_train_seconds=1.5 * r, silos_sampled=3,
            silos_reported=2, silos_dropped=1, dp=charged, secagg=secagg,
            algorithm={threshold_metric(0): 0.91, threshold_metric(1): 0.85})
        hub.records.history.append(record)
        for sink in hub.rounds.sinks[1:]:  # every sink but history.json, as the round loop hands it on
            sink.round_done(record)
    s = samples(m)
    assert s[("silokit_hub_test_accuracy_ratio", ())] == pytest.approx(0.62)
    assert s[("silokit_hub_test_accuracy_previous_ratio", ())] == pytest.approx(0.70)
    assert s[("silokit_hub_class_threshold", (("class", "0"),))] == pytest.approx(0.91)
    assert s[("silokit_hub_class_threshold", (("class", "1"),))] == pytest.approx(0.85)
    assert 0 < spent[0] < spent[1] == s[("silokit_hub_dp_epsilon_spent", ())]
    assert s[("silokit_hub_dp_epsilon_budget", ())] == 8.0 and s[("silokit_hub_dp_delta", ())] == 1e-5
    assert s[("silokit_hub_secagg_stage_duration_seconds_count", (("stage", "share_keys"),))] == 2
    assert s[("silokit_hub_secagg_recoveries_total", ())] == 2  # u2 - u3 in each round
    assert s[("silokit_hub_silo_dropouts_total", ())] == 2
    assert s[("silokit_hub_round_duration_seconds_sum", ())] == pytest.approx(9.0)
    assert s[("silokit_hub_evaluation_duration_seconds_sum", ())] == pytest.approx(0.8)
    assert s[("silokit_hub_silo_train_seconds", ())] == pytest.approx(3.0)  # the last round's mean
    # A round bucket of 5 s holds the 3 s round, not the 6 s one.
    assert s[("silokit_hub_round_duration_seconds_bucket", (("le", "5.0"),))] == 1


def test_a_secure_round_counts_its_masked_inputs_and_every_stage_byte_as_received(tmp_path):
    """Under secure aggregation the update arrives as a masked input: the Updates and Traffic panels must not read
    0 while rounds complete."""
    hub = make_private_hub(tmp_path, PrivacySection(secure_aggregation=SECAGG), quorum=1.0)
    m = HubMetrics(hub)
    run_with_silos(hub, [1.0 + i for i in range(5)])
    s = samples(m)
    (record,) = hub.records.history
    assert record.secagg.contributors == 5 and record.bytes_up > 0
    assert s[("silokit_hub_updates_accepted_total", (("kind", "update"),))] == 5
    assert s[("silokit_hub_received_bytes_total", ())] == record.bytes_up


def test_a_dp_run_through_the_hub_core_exports_the_epsilon_it_spent_and_its_budget(tmp_path):
    """The privacy layer, the hub and the exporter together: what the hub charged is what the gauges show."""
    section = PrivacySection(dp=DPConfig(enabled=True, noise_multiplier=1.0, clip_norm=200.0, epsilon_budget=20.0))
    hub = make_private_hub(tmp_path, section, rounds=2, quorum=1.0)
    m = HubMetrics(hub)
    run_with_silos(hub, [0.25 * (i + 1) for i in range(5)])
    s = samples(m)
    assert [r.round for r in hub.records.history] == [1, 2]
    assert s[("silokit_hub_dp_epsilon_spent", ())] == hub.records.history[-1].dp.epsilon == hub.privacy.dp.epsilon() > 0
    assert s[("silokit_hub_dp_epsilon_budget", ())] == 20.0 and s[("silokit_hub_dp_delta", ())] == 1e-5
    assert s[("silokit_hub_aggregation_duration_seconds_count", ())] == 2  # timed under DP too


def test_the_initial_models_test_accuracy_is_exported_beside_the_last_rounds(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    unscored = samples(m)[("silokit_hub_initial_test_accuracy_ratio", ())]
    assert unscored != unscored  # NaN: no test set, or not scored yet
    hub.records.initial = Scores(test_accuracy=0.64, test_loss=1.07)
    hub.records.history.append(RoundRecord(round=1, scores=Scores(test_accuracy=0.71)))
    s = samples(m)
    assert s[("silokit_hub_initial_test_accuracy_ratio", ())] == pytest.approx(0.64)
    assert s[("silokit_hub_test_accuracy_ratio", ())] == pytest.approx(0.71)


def test_validation_rounds_feed_the_best_round_gauges(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    s = samples(m)
    assert s[("silokit_hub_best_round", ())] == 0  # nothing validated yet
    best = s[("silokit_hub_best_validation_accuracy_ratio", ())]
    assert best != best  # NaN
    for r, acc in ((1, 0.70), (2, 0.78), (3, 0.74), (4, 0.78), (5, 0.71)):
        hub.records.history.append(RoundRecord(round=r, scores=Scores(validation_accuracy=acc)))
    s = samples(m)
    assert s[("silokit_hub_validation_accuracy_ratio", ())] == pytest.approx(0.71)
    assert s[("silokit_hub_best_round", ())] == 4  # a tie goes to the later round, as the hub keeps it
    assert s[("silokit_hub_best_validation_accuracy_ratio", ())] == pytest.approx(0.78)


def test_the_best_round_gauge_names_the_initial_model_when_no_round_beat_it(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    hub.records.initial = Scores(validation_accuracy=0.80)  # the hub's labels alone, scored before round 1
    for r, acc in ((1, 0.70), (2, 0.79)):
        hub.records.history.append(RoundRecord(round=r, scores=Scores(validation_accuracy=acc)))
    s = samples(m)
    assert s[("silokit_hub_best_round", ())] == 0  # as best_model.safetensors: the initial model
    assert s[("silokit_hub_best_validation_accuracy_ratio", ())] == pytest.approx(0.80)
    hub.records.history.append(RoundRecord(round=3, scores=Scores(validation_accuracy=0.83)))
    s = samples(m)
    assert s[("silokit_hub_best_round", ())] == 3
    assert s[("silokit_hub_best_validation_accuracy_ratio", ())] == pytest.approx(0.83)


def test_silent_rounds_count_rounds_completed_since_a_silo_was_last_heard(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    hub.join("quiet", 5, 0, "cpu")
    hub.join("chatty", 5, 0, "cpu")
    for r in (1, 2, 3):
        hub.registry.silos["chatty"].last_seen = 1e12  # heard from after every round
        m.on_round(RoundRecord(round=r))
    s = samples(m)
    assert s[("silokit_hub_silo_rounds_silent", (("silo", "quiet"),))] == 3
    assert s[("silokit_hub_silo_rounds_silent", (("silo", "chatty"),))] == 0


def test_a_silo_waiting_in_a_long_poll_is_connected_and_not_silent(tmp_path):
    # The registry counts a silo in a long-poll as live; the metrics read last_seen alone (set when a poll starts
    # and ends), so an unsampled silo in a 300 s poll showed as disconnected, and silent after three short rounds.
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    hub.join("waiting", 5, 0, "cpu")
    hub.join("gone", 5, 0, "cpu")
    for s_id in ("waiting", "gone"):
        hub.registry.silos[s_id].last_seen = time.time() - 4 * hub.registry.liveness_s
    hub.registry.silos["waiting"].polling = 1
    for r in (1, 2, 3):
        m.on_round(RoundRecord(round=r))
    s = samples(m)
    assert s[("silokit_hub_silo_connected", (("silo", "waiting"),))] == 1
    assert s[("silokit_hub_silo_rounds_silent", (("silo", "waiting"),))] == 0
    assert s[("silokit_hub_silo_connected", (("silo", "gone"),))] == 0
    assert s[("silokit_hub_silo_rounds_silent", (("silo", "gone"),))] == 3
    assert s[("silokit_hub_silos_connected", ())] == 1


def test_a_silo_that_left_the_run_is_not_counted_silent(tmp_path):
    """A branch whose policy ended its part (Leave) stops polling on purpose: SilokitSiloSilent must not page for
    it (SilokitBranchLeft does, once, by kind and clause)."""
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    hub.join("leaver", 5, 0, "cpu")
    hub.join("quiet", 5, 0, "cpu")
    hub.leave("leaver", hub.run_id, Departure("budget", "lifetime_epsilon", "3", "3.2", "budget spent", 0))
    for r in (1, 2, 3):
        m.on_round(RoundRecord(round=r))
    s = samples(m)
    assert s[("silokit_hub_silo_rounds_silent", (("silo", "quiet"),))] == 3
    assert ("silokit_hub_silo_rounds_silent", (("silo", "leaver"),)) not in s
    assert s[("silokit_hub_silo_departures_total", (("clause", "lifetime_epsilon"), ("kind", "budget")))] == 1


def test_certificate_time_left_for_the_hub_the_ca_and_each_silo(tmp_path):
    ca = tmp_path / "ca"
    init_ca(ca, days=3650)
    hub_bundle = issue_hub(ca, tmp_path / "hubcert", days=90)
    soon = issue_silo(ca, "branch-1", tmp_path / "b1", days=10)
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub, certs=hub_bundle)
    hub.join("branch-1", 5, 0, "cpu")
    m.observe_silo_certificate("branch-1", (soon / "cert.pem").read_bytes())
    s = samples(m)
    day = 86400
    assert 89 * day < s[("silokit_hub_certificate_remaining_seconds", (("certificate", "hub"),))] <= 90 * day
    assert 3600 * day < s[("silokit_hub_certificate_remaining_seconds", (("certificate", "ca"),))] <= 3650 * day
    assert 9 * day < s[("silokit_hub_silo_certificate_remaining_seconds", (("silo", "branch-1"),))] <= 10 * day
    # An operator copies only a renewed cert.pem (its key not beside it): the hub keeps serving the old
    # certificate, so the series keeps counting down to the old one's expiry (else the alert would go quiet).
    credentials = ReloadingServerCredentials(hub_bundle, on_load=lambda pem: setattr(m, "served_certificate", pem))
    renewed = renew(ca, "hub", tmp_path / "renewed", days=365)
    (hub_bundle / "cert.pem").write_bytes((renewed / "cert.pem").read_bytes())  # the new key stays behind
    assert credentials._fetch() is None  # not loaded: the old certificate is still served
    assert 89 * day < value(m, "silokit_hub_certificate_remaining_seconds", certificate="hub") <= 90 * day


def test_the_endpoint_serves_the_registry_and_a_busy_port_is_one_clear_error(tmp_path):
    hub = make_hub(tmp_path / "hub")
    m = HubMetrics(hub)
    port = m.serve("127.0.0.1", 0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "silokit_hub_rounds_planned 3.0" in body
        assert "_created" not in body
        with pytest.raises(OSError, match=rf"cannot serve metrics on 127.0.0.1:{port}: .*metrics.port"):
            HubMetrics(make_hub(tmp_path / "other")).serve("127.0.0.1", port)
    finally:
        m.close()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # closed: nothing listens there any more


def test_silo_server_with_a_busy_metrics_port_stops_with_one_clear_line(tmp_path):
    ca = init_ca(tmp_path / "ca")
    certs = issue_hub(ca, tmp_path / "hubcert")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "hub.yaml"
        cfg.write_text(yaml.safe_dump({
            "run": {"state_dir": str(tmp_path / "state")},
            "server": {"certs": str(certs), "host": "127.0.0.1", "port": 0},
            "data": {"labeled": {"kind": "demo", "labels_per_class": 2}},
            "metrics": {"port": port},
        }))
        proc = subprocess.run([sys.executable, "-m", "silo_server.cli", "--config", str(cfg)], capture_output=True,
                              text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in proc.stderr
    assert errors == [(f"error: cannot serve metrics on 127.0.0.1:{port}: Address already in use; set "
                                   f"metrics.port in hub.yaml to a free port (0 picks one) or metrics.enabled false")]
