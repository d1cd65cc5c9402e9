"""A silo's metrics: many silos share one registry (silo-sim's workers), one series per silo."""

import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from security.pki import init_ca, issue_silo, renew
from silo_client.metrics import SiloMetricFamilies, SiloMetrics


def samples(families: SiloMetricFamilies) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(families.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_two_silos_in_one_registry_keep_their_own_series(tmp_path):
    ca = init_ca(tmp_path / "ca")
    certs = issue_silo(ca, "silo-a", tmp_path / "a", days=30)
    families = SiloMetricFamilies()
    a = SiloMetrics(families, "silo-a", certs=certs)
    b = SiloMetrics(families, "silo-b")
    fresh = samples(families)
    assert fresh[("silokit_silo_rounds_joined_total", (("silo", "silo-b"),))] == 0
    assert math.isnan(fresh[("silokit_silo_local_loss", (("silo", "silo-b"),))])  # unknown, not zero

    a.joined("cpu", 100, 2)
    a.received(5000)
    a.trained(3, 4.0, {"pl_total": 100.0, "pl_selected": 40.0, "pl_correct": 30.0, "train_loss": 0.5}, False)
    a.sent(1200)
    b.joined("cpu", 50, 0)
    b.trained(3, 0.1, {"pl_total": 50.0, "pl_selected": 1.0}, True)
    a.joined("cuda:0", 100, 2)  # a re-join on another device replaces the device series
    s = samples(families)
    A, B = (("silo", "silo-a"),), (("silo", "silo-b"),)
    assert s[("silokit_silo_rounds_joined_total", A)] == 1 and s[("silokit_silo_rounds_skipped_total", A)] == 0
    assert s[("silokit_silo_rounds_skipped_total", B)] == 1
    assert s[("silokit_silo_round", A)] == 3
    assert s[("silokit_silo_samples_above_threshold", A)] == 40
    assert s[("silokit_silo_pseudo_label_ratio", A)] == 0.4
    assert s[("silokit_silo_pseudo_label_accuracy_ratio", A)] == 0.75
    assert s[("silokit_silo_local_loss", A)] == 0.5
    assert s[("silokit_silo_received_bytes_total", A)] == 5000 and s[("silokit_silo_sent_bytes_total", A)] == 1200
    assert s[("silokit_silo_local_train_duration_seconds_sum", A)] == 4.0
    assert s[("silokit_silo_samples", B)] == 50 and s[("silokit_silo_unreadable_images", A)] == 2
    assert s[("silokit_silo_device_info", (("device", "cuda:0"), ("silo", "silo-a")))] == 1
    assert ("silokit_silo_device_info", (("device", "cpu"), ("silo", "silo-a"))) not in s
    assert s[("silokit_silo_device_info", (("device", "cpu"), ("silo", "silo-b")))] == 1
    assert s[("silokit_silo_last_contact_timestamp_seconds", A)] > 1.6e9
    assert 29 * 86400 < s[("silokit_silo_certificate_remaining_seconds", A)] <= 30 * 86400
    assert ("silokit_silo_certificate_remaining_seconds", B) not in s  # no bundle given: no series rather than a guess


def test_the_certificate_series_is_the_one_the_silo_dials_with_until_it_restarts(tmp_path):
    """A silo reads its bundle once, at start: a renewed cert.pem copied in is not in use before a restart, so the
    series keeps counting down to the old certificate's expiry (else its expiry alert would go quiet)."""
    ca = init_ca(tmp_path / "ca")
    certs = issue_silo(ca, "silo-a", tmp_path / "a", days=10)
    families = SiloMetricFamilies()
    SiloMetrics(families, "silo-a", certs=certs)
    renewed = renew(ca, "silo-a", tmp_path / "renewed", days=90)
    (certs / "cert.pem").write_bytes((renewed / "cert.pem").read_bytes())
    left = samples(families)[("silokit_silo_certificate_remaining_seconds", (("silo", "silo-a"),))]
    assert 9 * 86400 < left <= 10 * 86400
