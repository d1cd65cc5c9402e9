"""Write the Grafana dashboards in ops/grafana/dashboards/ from the compact panel lists below.

    python tools/build_dashboards.py            # rewrite the JSON files
    python tools/build_dashboards.py --check    # exit 1 when the committed JSON differs (the tests do this)

The JSON files are what Grafana loads (provisioned, see ops/grafana/provisioning); this script only keeps them
consistent: one datasource uid, unique panel ids, a 24-column grid, and every query in one readable place.
Queries use `$silo` (the per-silo dashboard's variable) and fixed range windows; tests/e2e/test_ops.py runs each
of them against a real Prometheus scraping a real simulation.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "ops" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "silokit-prometheus"}  # provisioned in ops/grafana/provisioning


@dataclass
class Panel:
    title: str
    kind: str  # timeseries | stat | bargauge | table
    w: int
    h: int
    targets: list[tuple[str, str]]  # (expr, legend)
    description: str
    unit: str = ""
    min: float | None = None
    max: float | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=list)
    text_mode: str = "value_and_name"  # stat panels: "name" shows the label (e.g. the phase) instead of 1


def _thresholds(steps: list[tuple[float | None, str]]) -> dict:
    steps = steps or [(None, "green")]
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": p.unit} if p.unit else {}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    defaults["thresholds"] = _thresholds(p.thresholds)
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 2, "pointSize": 4, "showPoints": "auto",
                              "spanNulls": True, "fillOpacity": 0}
        defaults["color"] = {"mode": "palette-classic"}
    elif p.kind in ("stat", "bargauge"):
        defaults["color"] = {"mode": "thresholds"}
    targets = []
    for i, (expr, legend) in enumerate(p.targets):
        t = {"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
             "range": p.kind == "timeseries", "instant": p.kind != "timeseries"}
        if p.kind == "table":
            t["format"] = "table"
        targets.append(t)
    out = {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": p.w, "h": p.h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": targets,
    }
    reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
    if p.kind == "stat":
        out["options"] = {"reduceOptions": reduce, "textMode": p.text_mode, "colorMode": "value",
                          "graphMode": "none", "justifyMode": "center", "orientation": "auto"}
    elif p.kind == "bargauge":
        out["options"] = {"reduceOptions": reduce, "orientation": "horizontal", "displayMode": "basic",
                          "showUnfilled": True}
    elif p.kind == "timeseries":
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "none"}}
    elif p.kind == "table":
        out["options"] = {"showHeader": True, "cellHeight": "sm"}
        out["transformations"] = [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True, "federation": True},
                "renameByName": {f"Value #{chr(ord('A') + i)}": legend for i, (_, legend) in enumerate(p.targets)},
            }},
        ]
    return out


def layout(rows: list[list[Panel]]) -> list[dict]:
    """Rows of panels, left to right; each row's panels must fill at most 24 columns."""
    panels, y, pid = [], 0, 1
    for row in rows:
        x = 0
        assert sum(p.w for p in row) <= 24, [p.title for p in row]
        for p in row:
            panels.append(panel_json(p, pid, x, y))
            pid, x = pid + 1, x + p.w
        y += max(p.h for p in row)
    return panels


def dashboard(uid: str, title: str, description: str, rows: list[list[Panel]], variables: list[dict],
              links: list[dict]) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["silokit"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser", "graphTooltip": 1,
        "time": {"from": "now-3h", "to": "now"},
        "annotations": {"list": []}, "templating": {"list": variables}, "links": links,
        "panels": layout(rows),
    }


CERT_STEPS = [(None, "red"), (14, "orange"), (30, "green")]
PERCENT = {"unit": "percentunit", "min": 0, "max": 1}


def overview() -> dict:
    rows = [
        [
            Panel("Rounds", "stat", 4, 4, [("silokit_hub_rounds_completed", "completed"),
                                          ("silokit_hub_rounds_planned", "planned")],
                  "Rounds applied (checkpointed) and rounds planned (rounds.total)."),
            Panel("Phase", "stat", 4, 4, [("silokit_hub_phase == 1", "{{phase}}")],
                  "What the hub is doing: starting, waiting_for_silos, training, aggregating, done, failed.",
                  text_mode="name"),
            Panel("Silos", "stat", 4, 4, [("silokit_hub_silos_connected", "connected"),
                                         ("silokit_hub_silos_enrolled", "enrolled")],
                  "Silos heard from within rounds.liveness_s, and all that joined since the hub started."),
            Panel("Test accuracy", "stat", 4, 4, [("silokit_hub_test_accuracy_ratio", "accuracy")],
                  "Accuracy of the global model on the hub's test set after the last round.", **PERCENT),
            Panel("Privacy (epsilon)", "stat", 4, 4, [("silokit_hub_dp_epsilon_spent", "spent"),
                                                      ("silokit_hub_dp_epsilon_budget", "budget")],
                  "Differential-privacy epsilon spent and budget (both 0 without DP)."),
            Panel("Hub certificate", "stat", 4, 4, [("min(silokit_hub_certificate_remaining_seconds) / 86400", "left")],
                  "Days until the hub's certificate or the CA's expires, whichever is first.", unit="d",
                  thresholds=CERT_STEPS),
        ],
        [
            Panel("Model quality", "timeseries", 12, 8, [
                ("silokit_hub_test_accuracy_ratio", "test accuracy"),
                ("silokit_hub_initial_test_accuracy_ratio", "test accuracy of the initial model"),
                ("silokit_hub_validation_accuracy_ratio", "validation accuracy"),
                ("silokit_hub_pseudo_label_ratio", "pseudo-labels above threshold"),
                ("silokit_hub_pseudo_label_accuracy_ratio", "pseudo-label accuracy (simulation)"),
            ], "Test accuracy after each round, and of the initial model (trained on the hub's labels alone before "
               "round 1, where the silos start from); accuracy on the hub's validation split (data.validation, which picks "
               "best_model.safetensors); the share of the silos' images whose pseudo-label passed the "
               "threshold, and (simulation only) how many of those were right.", **PERCENT),
            Panel("Silos per round", "timeseries", 12, 8, [
                ("silokit_hub_round_silos", "{{state}}"),
                ("silokit_hub_silos_connected", "connected"),
            ], "Of the last completed round: silos sampled, reported, skipped (nothing passed the threshold) and "
               "dropped (no report before the deadline).", min=0),
        ],
        [
            Panel("Loss", "timeseries", 8, 8, [("silokit_hub_test_loss", "test"),
                                               ("silokit_hub_silo_train_loss", "silos (local, mean)")],
                  "Test cross-entropy of the global model and the silos' mean local training loss.", min=0),
            Panel("Where a round's time goes", "timeseries", 8, 8, [
                ("histogram_quantile(0.5, sum by (le) (rate(silokit_hub_round_duration_seconds_bucket[30m])))",
                 "round p50"),
                ("histogram_quantile(0.5, sum by (le) (rate(silokit_hub_aggregation_duration_seconds_bucket[30m])))",
                 "aggregation p50"),
                ("histogram_quantile(0.5, sum by (le) (rate(silokit_hub_evaluation_duration_seconds_bucket[30m])))",
                 "evaluation p50"),
                ("silokit_hub_silo_train_seconds", "silo training (mean, last round)"),
            ], "Median wall time of the rounds completed in the last 30 minutes, of the hub's aggregation "
               "(sums to next model, including the hub's fine-tune) and of its scoring of each round's model; "
               "and how long a silo trained in the last round. What the round takes beyond these is waiting: "
               "for the slowest silo, transfers, polls.", unit="s", min=0),
            Panel("Privacy budget", "timeseries", 8, 8, [("silokit_hub_dp_epsilon_spent", "epsilon spent"),
                                                         ("silokit_hub_dp_epsilon_budget", "epsilon budget")],
                  "Epsilon spent by differential privacy against its budget (0 without DP; alert at 80%).", min=0),
        ],
        [
            Panel("Updates", "timeseries", 8, 8, [
                ("sum by (kind) (increase(silokit_hub_updates_accepted_total[5m]))", "accepted {{kind}}"),
                ("sum(increase(silokit_hub_refusals_total[5m]))", "refused"),
            ], "Results accepted (updates, and skips: nothing passed the threshold) and requests refused, "
               "per 5 minutes.", min=0),
            Panel("Traffic", "timeseries", 8, 8, [
                ("rate(silokit_hub_received_bytes_total[5m])", "from silos"),
                ("rate(silokit_hub_sent_bytes_total[5m])", "to silos"),
            ], "Bytes per second of results received and round bundles sent.", unit="Bps", min=0),
            Panel("Refusals by reason", "bargauge", 8, 8, [("sum by (reason) (silokit_hub_refusals_total)",
                                                           "{{reason}}")],
                  "Requests refused since the hub started, by reason; a refused upload changes nothing.", min=0),
        ],
        [
            Panel("Pseudo-label threshold per class", "bargauge", 8, 8, [("silokit_hub_class_threshold",
                                                                         "class {{class}}")],
                  "Confidence a pseudo-label of each class must reach (SemiFL: tau for all; FedSEAL: adaptive).",
                  **PERCENT),
            Panel("Secure aggregation", "timeseries", 8, 8, [
                ("sum by (stage) (increase(silokit_hub_secagg_stage_duration_seconds_sum[30m]))", "{{stage}}"),
                ("increase(silokit_hub_secagg_recoveries_total[30m])", "recovered silos"),
            ], "Seconds spent per secure-aggregation stage, and dropped silos whose masks were recovered, over "
               "30 minutes (0 without secure aggregation).", min=0),
            Panel("Certificates (days left)", "bargauge", 8, 8, [
                ("silokit_hub_certificate_remaining_seconds / 86400", "{{certificate}}"),
                ("silokit_hub_silo_certificate_remaining_seconds / 86400", "{{silo}}"),
            ], "Days until each certificate expires: the hub's, the CA's and each silo's (alert under 14).",
               unit="d", thresholds=CERT_STEPS),
        ],
        [
            Panel("Branches that refused or left", "bargauge", 24, 6, [
                ("sum by (kind, clause) (silokit_hub_silo_departures_total)", "{{kind}}: {{clause}}"),
            ], "Silos whose own policy refused the run's privacy terms at join (refused), found a task asking for less "
               "than the terms pinned for the run (breach) or reached an epsilon ceiling (budget), by the policy "
               "clause they named; `silo-server --check` lists which branch and both values.", min=0),
        ],
        [
            Panel("Hub memory", "timeseries", 12, 7, [
                ('process_resident_memory_bytes{job="silokit-hub"}', "resident"),
            ], "Resident memory of the hub process. Streaming aggregation keeps it flat as more silos report.",
               unit="bytes", min=0),
            Panel("Hub CPU", "timeseries", 12, 7, [
                ('rate(process_cpu_seconds_total{job="silokit-hub"}[5m])', "cores busy"),
            ], "CPU time the hub process uses per second (1 = one core busy): its fine-tune, evaluation and "
               "aggregation.", min=0),
        ],
        [
            Panel("Silos", "table", 24, 8, [
                ("silokit_hub_silo_connected", "connected"),
                ("silokit_hub_silo_rounds_silent", "rounds silent"),
                ("silokit_hub_silo_rounds_contributed", "rounds contributed"),
                ("time() - silokit_hub_silo_last_seen_timestamp_seconds", "seconds since last heard"),
                ("silokit_hub_silo_unlabeled_images", "images"),
            ], "Every enrolled silo as the hub sees it. Open 'silokit / Silo' for one silo's details."),
        ],
    ]
    return dashboard("silokit-overview", "silokit / Federation overview",
                     "How the federation is doing: rounds, silos, model quality, privacy, traffic, certificates.",
                     rows, [], [{"title": "Silo details", "type": "link", "url": "/d/silokit-silo/silokit-silo",
                                 "targetBlank": False, "keepTime": True}])


def silo_view() -> dict:
    s = '{silo="$silo"}'
    rows = [
        [
            Panel("Connected", "stat", 4, 4, [(f"silokit_hub_silo_connected{s}", "connected")],
                  "1 when the hub heard from the silo within rounds.liveness_s.",
                  thresholds=[(None, "red"), (1, "green")]),
            Panel("Last heard", "stat", 4, 4, [(f"time() - silokit_hub_silo_last_seen_timestamp_seconds{s}",
                                                "ago")],
                  "Seconds since the hub last heard from the silo.", unit="s"),
            Panel("Rounds", "stat", 4, 4, [(f"silokit_hub_silo_rounds_contributed{s}", "contributed"),
                                          (f"silokit_hub_silo_rounds_silent{s}", "silent")],
                  "Rounds whose sums hold this silo's update; rounds completed since it was last heard."),
            Panel("Certificate", "stat", 4, 4, [(f"silokit_hub_silo_certificate_remaining_seconds{s} / 86400", "left")],
                  "Days until the silo's client certificate expires.", unit="d", thresholds=CERT_STEPS),
            Panel("Images", "stat", 4, 4, [(f"silokit_hub_silo_unlabeled_images{s}", "unlabeled"),
                                          (f"silokit_hub_silo_skipped_images{s}", "unreadable")],
                  "Images the silo declared when it joined, and files it skipped as unreadable."),
            Panel("Device", "stat", 4, 4, [(f"silokit_silo_device_info{s}", "{{device}}")],
                  "Where the silo trains (from its own endpoint).", text_mode="name"),
        ],
        [
            Panel("Pseudo-labels", "timeseries", 12, 8, [
                (f"silokit_silo_pseudo_label_ratio{s}", "above threshold"),
                (f"silokit_silo_pseudo_label_accuracy_ratio{s}", "accuracy (simulation)"),
            ], "Share of this silo's images whose pseudo-label passed the threshold in its last round; in "
               "simulation, how many of those were right.", **PERCENT),
            Panel("Samples above threshold", "timeseries", 12, 8, [
                (f"silokit_silo_samples_above_threshold{s}", "above threshold"),
                (f"silokit_silo_samples{s}", "all images"),
            ], "Images that trained this silo's last round, out of all it holds.", min=0),
        ],
        [
            Panel("Rounds joined", "timeseries", 8, 8, [
                (f"silokit_silo_rounds_joined_total{s}", "joined"),
                (f"silokit_silo_rounds_skipped_total{s}", "skipped"),
                (f"silokit_silo_updates_unsent_total{s}", "not sent"),
            ], "Rounds this silo trained for and reported (skipped: nothing passed the threshold; not sent: its "
               "update failed the silo's own check, such as a float16 overflow).", min=0),
            Panel("Local training", "timeseries", 8, 8, [
                (f"rate(silokit_silo_local_train_duration_seconds_sum{s}[30m]) / "
                 f"rate(silokit_silo_local_train_duration_seconds_count{s}[30m])", "mean train time"),
                (f"silokit_silo_local_loss{s}", "local loss"),
            ], "Mean local training time per round over 30 minutes, and the last round's local loss.", min=0),
            Panel("Traffic", "timeseries", 8, 8, [
                (f"rate(silokit_silo_received_bytes_total{s}[5m])", "from hub"),
                (f"rate(silokit_silo_sent_bytes_total{s}[5m])", "to hub"),
            ], "Bytes per second this silo downloaded and uploaded.", unit="Bps", min=0),
        ],
        [
            Panel("Privacy spent (the silo's own ledger)", "timeseries", 24, 7, [
                (f"silokit_silo_epsilon{s}", "{{guarantee}}"),
            ], "Epsilon by the silo's own ledger, never the hub's figures: client_dp (distributed noise; holds while "
               "the round's minimum number of cohort silos add theirs honestly), sample_dp (DP-SGD; holds against "
               "any hub), image (the tighter, this run), lifetime (all runs and hubs). Empty: no guarantee.", min=0),
        ],
        [
            Panel("Last contact (silo side)", "stat", 8, 4, [
                (f"time() - silokit_silo_last_contact_timestamp_seconds{s}", "ago")],
                  "Seconds since the hub last answered this silo, as the silo sees it.", unit="s"),
            Panel("Last round (silo side)", "stat", 8, 4, [(f"silokit_silo_round{s}", "")],
                  "The last round this silo trained for."),
            Panel("Own certificate", "stat", 8, 4, [(f"silokit_silo_certificate_remaining_seconds{s} / 86400", "left")],
                  "Days left on the certificate in the silo's bundle, read at the branch.", unit="d",
                  thresholds=CERT_STEPS),
        ],
    ]
    variable = {
        "name": "silo", "label": "Silo", "type": "query", "datasource": DATASOURCE,
        "definition": "label_values(silokit_hub_silo_connected, silo)",
        "query": {"query": "label_values(silokit_hub_silo_connected, silo)", "refId": "silo"},
        "refresh": 2, "sort": 1, "includeAll": False, "multi": False, "current": {}, "options": [],
    }
    return dashboard("silokit-silo", "silokit / Silo",
                     "One silo: the hub's view (liveness, contributions, certificate) and, where Prometheus can "
                     "scrape the silo, its own endpoint (pseudo-labels, training, traffic).",
                     rows, [variable], [{"title": "Federation overview", "type": "link",
                                         "url": "/d/silokit-overview/silokit-overview", "keepTime": True,
                                         "targetBlank": False}])


def render() -> dict[str, str]:
    return {name: json.dumps(board, indent=2) + "\n"
            for name, board in (("silokit-overview.json", overview()), ("silokit-silo.json", silo_view()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed dashboards are out of date")
    args = p.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run python tools/build_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
