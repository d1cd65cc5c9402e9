"""Operations end to end: silo-sim runs with a real Prometheus (the shipped config and alert rules) scraping the hub
and the silo workers on loopback; every query of the shipped dashboards and alert rules must return data, the
endpoints must pass `promtool check metrics`, and the numbers must mean what the panels say."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT, wait_for
from tools.promstack import (
    DASHBOARDS,
    Prometheus,
    alert_rules,
    alert_signal,
    binary,
    dashboard_queries,
    dashboard_variable_queries,
    stop_process_group,
)

MISSING = [b for b in ("prometheus", "promtool") if binary(b) is None]
# .ci/run installs Prometheus and sets this, so CI fails rather than skips when it is missing.
if MISSING and os.environ.get("SILOKIT_REQUIRE_PROMETHEUS") == "1":
    raise RuntimeError(f"{', '.join(MISSING)} not on PATH but SILOKIT_REQUIRE_PROMETHEUS=1")
pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs prometheus and promtool (apt-get install prometheus)")

SILOS, WORKERS, ROUNDS = 4, 2, 3
# Alerts that a healthy tiny run must not trip (accuracy may well drop between rounds of a 1-epoch toy run).
QUIET = {"SilokitSiloSilent", "SilokitRoundBelowQuorum", "SilokitNoProgress", "SilokitHubDown",
         "SilokitEpsilonNearBudget", "SilokitHubCertificateExpiring", "SilokitSiloCertificateExpiring",
         "SilokitSiloOwnCertificateExpiring", "SilokitUpdatesRefused"}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def targets(prom: Prometheus, job: str) -> list[str]:
    text = (prom.targets / ("hub.yml" if job == "hub" else "silos.yml")).read_text()
    return [line.split('"')[0].strip("- '") for line in text.splitlines() if "127.0.0.1:" in line]


def promtool_check_metrics(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)


def values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def test_every_dashboard_and_alert_query_returns_data_from_a_real_run(tmp_path):
    prom = Prometheus(tmp_path / "prometheus").start()
    sim = None
    try:
        started = time.time()
        sim = subprocess.Popen(
            [sys.executable, "-m", "silo_sim.cli", "--silos", str(SILOS), "--workers", str(WORKERS),
             "--rounds", str(ROUNDS), "--labels-per-class", "2", "--unlabeled", "80", "--option", "hub_epochs=1",
             "--option", "tau=0.0", "--option", "local_epochs=1", "--no-baseline",
             # silo-sim keeps the hub up 30 s after the run for a Prometheus that scrapes every 15 s; this one
             # scrapes every second (and the hub still waits for one scrape of its final values).
             "--hub-set", "server.min_linger_s=3", "--hub-set", "metrics.final_scrape_s=20", "--workdir",
             str(tmp_path / "sim"), "--prometheus-targets", str(prom.targets)],
            stdout=open(tmp_path / "sim.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        hub_url = "http://" + wait_for(lambda: (targets(prom, "hub") or [None])[0], 120, "the hub's metrics target")
        worker_urls = ["http://" + t for t in wait_for(lambda: targets(prom, "silos"), 60, "worker targets")]
        assert len(worker_urls) == WORKERS
        # The silo hosts wait for a last scrape as long as the hub does (its metrics.final_scrape_s).
        specs = [json.loads((tmp_path / "sim" / f"worker-{w}.json").read_text()) for w in range(WORKERS)]
        assert [spec["metrics_final_scrape_s"] for spec in specs] == [20.0] * WORKERS

        # Mid-run, once a round is done: the endpoints as Prometheus reads them pass promtool's linter.
        wait_for(lambda: "silokit_hub_rounds_completed 1.0" in fetch(hub_url + "/metrics") or sim.poll() is not None,
                 240, "round 1")
        for url in [hub_url, *worker_urls]:
            check = promtool_check_metrics(fetch(url + "/metrics"))
            assert check.returncode == 0 and not check.stdout.strip(), f"{url}: {check.stdout}{check.stderr}"

        assert sim.wait(timeout=300) == 0, (tmp_path / "sim.log").read_text()[-3000:]
        # Evaluate at the last moment every endpoint was up: the run's final state, all series present.
        at = prom.last_time_all_up({"silokit-hub": 1, "silokit-silos": WORKERS}, started, time.time())
        assert at is not None, "Prometheus never scraped the hub and both workers at the same time"

        missing = []
        for board, panel, expr in dashboard_queries({"silo": "silo-001"}):
            if not prom.query(expr, at=at):
                missing.append(f"{board} / {panel}: {expr}")
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)

        for board, var, selector, label in dashboard_variable_queries():
            found = {r["metric"].get(label) for r in prom.query(selector, at=at)}
            assert found == {f"silo-{i:03d}" for i in range(1, SILOS + 1)}, (board, var, found)

        fired = {}
        for rule in alert_rules():
            result = prom.query(alert_signal(rule["expr"]), at=at)
            assert result, f"alert {rule['alert']}: {rule['expr']} has no data to evaluate"
            assert set(values(result)) <= {0.0, 1.0}, (rule["alert"], result)
            fired[rule["alert"]] = max(values(result))
        assert {name for name, v in fired.items() if v} & QUIET == set(), fired
        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == len(alert_rules()) and all(r["health"] == "ok" for r in rules), rules

        # The numbers mean what the panels say, in each endpoint's final scrape (each waits for one before exiting).
        at_hub = prom.last_time_all_up({"silokit-hub": 1}, started, time.time())
        at_silos = prom.last_time_all_up({"silokit-silos": WORKERS}, started, time.time())

        def one(expr, at=at_hub):
            result = values(prom.query(expr, at=at))
            assert len(result) == 1, (expr, result)
            return result[0]

        assert one("silokit_hub_rounds_completed") == ROUNDS == one("silokit_hub_rounds_planned")
        assert one('silokit_hub_phase{phase="done"}') == 1
        assert one("silokit_hub_silos_enrolled") == SILOS
        assert one('silokit_hub_round_silos{state="reported"}') == SILOS
        assert one('silokit_hub_round_duration_seconds_count') == ROUNDS
        assert 0.0 <= one("silokit_hub_test_accuracy_ratio") <= 1.0
        assert one("silokit_hub_pseudo_label_ratio") == 1.0  # tau 0: every pseudo-label passes
        assert one('sum(silokit_hub_updates_accepted_total{kind="update"})') == SILOS * ROUNDS
        assert one("sum(silokit_hub_refusals_total)") == 0
        assert one("silokit_hub_received_bytes_total") > SILOS * ROUNDS * 10_000
        assert 89 < one('silokit_hub_certificate_remaining_seconds{certificate="hub"}') / 86400 <= 90
        joined = prom.query("silokit_silo_rounds_joined_total", at=at_silos)
        assert {r["metric"]["silo"] for r in joined} == {f"silo-{i:03d}" for i in range(1, SILOS + 1)}
        assert values(joined) == [ROUNDS] * SILOS
        assert one("sum(silokit_silo_samples)", at_silos) == 80
        assert one("min(silokit_silo_samples_above_threshold)", at_silos) > 0
        assert one('count(silokit_silo_device_info{device="cpu"})', at_silos) == SILOS
        # One endpoint per worker, one `silo` label per hosted silo.
        per_worker = prom.query("count by (instance) (silokit_silo_samples)", at=at_silos)
        assert sorted(values(per_worker)) == [SILOS / WORKERS] * WORKERS

        # The docs tooling draws every panel of both dashboards from this run (docs/img is made the same way).
        if importlib.util.find_spec("matplotlib") is not None:
            from PIL import Image

            from tools.render_dashboard import collect, draw

            for path in DASHBOARDS:
                board = json.loads(path.read_text())
                panels = collect(prom, board, {"silo": "silo-001"}, started, time.time(), at)
                assert len(panels) == len(board["panels"])
                png = tmp_path / f"{board['uid']}.png"
                draw(board, panels, started, time.time(), png, "test run")
                with Image.open(png) as image:
                    assert image.width > 1000 and image.height > 600  # every panel on a 24-column canvas
    finally:
        if sim is not None:
            stop_process_group(sim)
        prom.stop()
    assert prom.proc.poll() is not None and sim.poll() is not None
