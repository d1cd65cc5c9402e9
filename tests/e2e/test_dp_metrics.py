"""The privacy budget as operators see it: silo-sim runs with client-level DP and an epsilon budget (hub and silo
processes over mutual TLS) while a real Prometheus, with the shipped config and alert rules, scrapes the hub. The
epsilon gauge shows what the hub charged (its history.json), the budget gauge the configured budget, and once the
run has spent more than 80% of it Prometheus fires SilokitEpsilonNearBudget. (Before the round record, the exporter
read keys the privacy layer never wrote: both gauges stayed at 0 and the alert could not fire.)"""

import json
import os
import subprocess
import sys

import pytest
import yaml

from silo_core.rounds import records_from_json
from tests.conftest import ROOT, wait_for
from tests.e2e.test_ops import MISSING, values
from tools.promstack import Prometheus, stop_process_group

pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs prometheus and promtool (apt-get install prometheus)")

# Noise multiplier 1 with every silo in every round (sampling rate 1): epsilon 4.73 after round 1 (59% of the budget,
# quiet) and 7.08 after round 2 (89%, past the alert's 80%); the budget still allows round 2.
ROUNDS, BUDGET = 2, 8.0


def test_a_dp_runs_epsilon_and_budget_reach_prometheus_and_the_near_budget_alert_fires(tmp_path):
    prom = Prometheus(tmp_path / "prometheus").start()
    sim = None
    try:
        sim = subprocess.Popen(
            [sys.executable, "-m", "silo_sim.cli", "--silos", "3", "--workers", "1", "--rounds", str(ROUNDS),
             "--labels-per-class", "2", "--unlabeled", "30", "--option", "hub_epochs=1", "--option", "tau=0.0",
             "--option", "local_epochs=1", "--no-baseline", "--workdir", str(tmp_path / "sim"),
             "--hub-set", "privacy.dp.enabled=true", "--hub-set", f"privacy.dp.epsilon_budget={BUDGET}",
             # A run this short can end before Prometheus first scrapes the hub, and a hub never scraped does not
             # wait for a final scrape: it stays 3 s after its last round (as in test_ops).
             "--hub-set", "server.min_linger_s=3"],
            stdout=open(tmp_path / "sim.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        # The hub's endpoint goes to Prometheus as soon as it is open (during the hub's initial training): a run this
        # short could otherwise end before its first scrape, and a hub that was never scraped does not wait for a
        # final one.
        port_file = tmp_path / "sim" / "hub" / "state" / "metrics_port"
        port = wait_for(lambda: (port_file.is_file() and port_file.read_text().strip()) or sim.poll() is not None,
                        120, "the hub's metrics port")
        assert sim.poll() is None, (tmp_path / "sim.log").read_text()[-3000:]
        staged = prom.targets / "hub.yml.new"
        staged.write_text(yaml.safe_dump([{"targets": [f"127.0.0.1:{port}"]}]))
        os.replace(staged, prom.targets / "hub.yml")  # Prometheus never reads half a file
        assert sim.wait(timeout=240) == 0, (tmp_path / "sim.log").read_text()[-3000:]
        history = json.loads((tmp_path / "sim" / "hub" / "state" / "history.json").read_text())
        charged = [r.dp.epsilon for r in records_from_json(history["rounds"])]
        assert len(charged) == ROUNDS and 0 < charged[0] < 0.8 * BUDGET < charged[-1] <= BUDGET

        # What Prometheus stored while the hub ran (having been scraped, the hub waits for one more scrape after its
        # last round before it exits).
        def most(expr):
            return values(prom.query(f"max_over_time({expr}[10m])"))

        assert most("silokit_hub_rounds_completed") == [ROUNDS]
        assert most("silokit_hub_dp_epsilon_spent") == [pytest.approx(charged[-1])]
        assert most("silokit_hub_dp_epsilon_budget") == [BUDGET]
        assert most("silokit_hub_dp_delta") == [1e-5]
        # The shipped rule, evaluated by Prometheus on those scrapes (one evaluation may still be on its way).
        firing = 'ALERTS{alertname="SilokitEpsilonNearBudget", alertstate="firing"}'
        assert wait_for(lambda: most(firing), 60, "the near-budget alert") == [1.0]
    finally:
        if sim is not None:
            stop_process_group(sim)
        prom.stop()
