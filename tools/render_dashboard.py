"""Draw the shipped Grafana dashboards' panels from a real run, for docs/operations.md (Grafana does not install here).

    python tools/render_dashboard.py                         # run silo-sim under Prometheus, draw both dashboards
    python tools/render_dashboard.py --silos 6 --rounds 10   # a longer run

It starts a real Prometheus with the shipped ops/prometheus config, runs silo-sim with its metrics scraped, then
asks Prometheus every query of every panel of ops/grafana/dashboards/*.json (over the run for time series; for stats,
bar gauges and tables at the hub's final scrape, or, for series only the silo workers serve, at the last moment all
endpoints were up) and draws each panel where its gridPos puts it.
Writes docs/img/dashboard-<uid>.png and docs/img/dashboard-runs.json (what was run, when, how long).
Needs the docs extra (`pip install -e ".[docs]"`, matplotlib) and the prometheus binary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.promstack import DASHBOARDS, Prometheus, stop_process_group, substitute  # noqa: E402

ROW_INCHES = 0.34  # one Grafana grid row
COL_INCHES = 0.78  # one of Grafana's 24 columns


def legend(fmt: str, labels: dict[str, str], fallback: str) -> str:
    if not fmt:
        return fallback
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v).replace("{{ " + k + " }}", v)
    return out


def fmt_value(v: float, unit: str) -> str:
    if v != v:
        return "-"
    if unit == "percentunit":
        return f"{100 * v:.1f}%"
    if unit == "Bps":
        for u in ("B/s", "kB/s", "MB/s", "GB/s"):
            if abs(v) < 1000:
                return f"{v:.0f} {u}" if u == "B/s" else f"{v:.1f} {u}"
            v /= 1000
    if unit == "bytes":
        for u in ("B", "kB", "MB", "GB", "TB"):
            if abs(v) < 1000:
                return f"{v:.0f} {u}" if u == "B" else f"{v:.1f} {u}"
            v /= 1000
    if unit == "s":
        return f"{v:.1f} s" if v < 120 else f"{v / 60:.1f} min"
    if unit == "d":
        return f"{v:.0f} days"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def series_values(result: list[dict]) -> list[tuple[dict, list[tuple[float, float]]]]:
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in result]


def collect(prom: Prometheus, board: dict, variables: dict[str, str], start: float, end: float,
            at: float | list[float]) -> list:
    """Per panel: (panel, [(target, result)]) with range results for time series and instant ones otherwise.

    Instant queries are asked at the first time in `at` that answers: e.g. the hub's final scrape, then the last
    moment every endpoint was up (the silo workers exit a little before the hub).
    """
    step = max(1.0, round((end - start) / 240))
    times = at if isinstance(at, list) else [at]
    panels = []
    for panel in board["panels"]:
        results = []
        for target in panel["targets"]:
            expr = substitute(target["expr"], variables)
            if panel["type"] == "timeseries":
                results.append((target, series_values(prom.query_range(expr, start, end, step))))
            else:
                result = []
                for t in times:
                    result = prom.query(expr, at=t)
                    if result:
                        break
                results.append((target, result))
        panels.append((panel, results))
    return panels


def panel_rect(g: dict, kind: str, fig_w: float, fig_h: float, header: float) -> list[float]:
    """The axes rectangle (figure fractions) for a panel at Grafana gridPos `g`, leaving room for its labels."""
    left = {"timeseries": 0.75, "bargauge": 1.0}.get(kind, 0.1)
    bottom = 0.5 if kind in ("timeseries", "bargauge") else 0.08
    x0, x1 = g["x"] * COL_INCHES + left, (g["x"] + g["w"]) * COL_INCHES - 0.15
    top, low = header + g["y"] * ROW_INCHES + 0.32, header + (g["y"] + g["h"]) * ROW_INCHES - bottom
    return [x0 / fig_w, 1 - low / fig_h, (x1 - x0) / fig_w, (low - top) / fig_h]


def draw(board: dict, panels: list, start: float, end: float, out: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter

    by_id = {p["id"]: p for p in board["panels"]}
    panels = [(by_id[p] if isinstance(p, int) else p, results) for p, results in panels]
    header = 0.7
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p, _ in panels)
    fig_w, fig_h = 24 * COL_INCHES, rows * ROW_INCHES + header + 0.1
    fig = plt.figure(figsize=(fig_w, fig_h), facecolor="#f4f5f5")
    fig.text(0.1 / fig_w, 1 - 0.3 / fig_h, board["title"], fontsize=15, fontweight="bold", va="center")
    fig.text(0.1 / fig_w, 1 - 0.55 / fig_h, subtitle, fontsize=9, color="#555", va="center")
    styles = ["-", "--", ":", "-."]
    for panel, results in panels:
        g, kind = panel["gridPos"], panel["type"]
        box_x, box_y = g["x"] * COL_INCHES + 0.04, header + (g["y"] + g["h"]) * ROW_INCHES - 0.04
        fig.patches.append(Rectangle((box_x / fig_w, 1 - box_y / fig_h), (g["w"] * COL_INCHES - 0.08) / fig_w,
                                     (g["h"] * ROW_INCHES - 0.08) / fig_h, transform=fig.transFigure,
                                     facecolor="white", edgecolor="#d8d9da", zorder=-1))
        fig.text((box_x + 0.08) / fig_w, 1 - (header + g["y"] * ROW_INCHES + 0.17) / fig_h, panel["title"],
                 fontsize=10, fontweight="bold", va="center")
        ax = fig.add_axes(panel_rect(g, kind, fig_w, fig_h, header))
        defaults = panel["fieldConfig"]["defaults"]
        unit = defaults.get("unit", "")
        if kind == "timeseries":
            n = 0
            for target, series in results:
                for labels, points in series:
                    ax.plot([(t - start) / 60 for t, _ in points], [v for _, v in points], linewidth=1.8,
                            linestyle=styles[n % len(styles)],
                            label=legend(target.get("legendFormat", ""), labels, target["expr"][:30]))
                    n += 1
            ax.set_xlim(0, (end - start) / 60)
            if "min" in defaults:
                ax.set_ylim(bottom=defaults["min"])
            if "max" in defaults:
                ax.set_ylim(top=defaults["max"] * 1.02)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: fmt_value(v, u)))
            ax.set_xlabel("minutes into the run", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best", ncol=2 if g["w"] >= 12 else 1, framealpha=0.8)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes, color="#999")
        elif kind == "stat":
            ax.axis("off")
            items = []
            for target, result in results:
                for r in result:
                    name = legend(target.get("legendFormat", ""), r["metric"], "")
                    value = fmt_value(float(r["value"][1]), unit)
                    items.append(name if panel["options"]["textMode"] == "name" else f"{value} {name}".strip())
            ax.text(0.5, 0.5, "\n".join(items) or "no data", ha="center", va="center",
                    fontsize=17 if len(items) <= 1 else 12, fontweight="bold", color="#1f7a45",
                    transform=ax.transAxes)
        elif kind == "bargauge":
            names, vals = [], []
            for target, result in results:
                fmt = target.get("legendFormat", "")
                for r in sorted(result, key=lambda r, f=fmt: legend(f, r["metric"], "")):
                    names.append(legend(fmt, r["metric"], ""))
                    vals.append(float(r["value"][1]))
            finite = [v for v in vals if not math.isnan(v)]
            ax.barh(range(len(vals)), [0 if math.isnan(v) else v for v in vals], color="#3274d9", height=0.6)
            ax.set_yticks(range(len(vals)), names, fontsize=7)
            top = max([*finite, defaults.get("max", 0)])
            ax.set_xlim(0, top * 1.25 if top > 0 else 1)
            ax.invert_yaxis()
            ax.tick_params(axis="x", labelsize=7)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: fmt_value(v, u)))
            for i, v in enumerate(vals):
                ax.text(0 if math.isnan(v) else v, i, " " + fmt_value(v, unit), va="center", fontsize=7)
        elif kind == "table":
            ax.axis("off")
            columns = [t.get("legendFormat", "") for t, _ in results]
            table: dict[str, list[str]] = {}
            for i, (_, result) in enumerate(results):
                for r in result:
                    row = table.setdefault(r["metric"].get("silo", "?"), ["-"] * len(columns))
                    row[i] = fmt_value(float(r["value"][1]), "")
            cells = [[silo, *vals] for silo, vals in sorted(table.items())]
            if cells:
                t = ax.table(cellText=cells, colLabels=["silo", *columns], loc="upper center", cellLoc="center")
                t.auto_set_font_size(False)
                t.set_fontsize(8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--silos", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--labels-per-class", type=int, default=10)
    p.add_argument("--unlabeled", type=int, default=1800)
    p.add_argument("--validation-per-class", type=int, default=10,
                   help="the hub's validation split, so the validation-accuracy series has data (0: none)")
    p.add_argument("--option", action="append", help="silo-sim --option (repeatable; default: local_epochs=1, "
                   "hub_epochs=2)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    p.add_argument("--save-data", type=Path, help="also write what Prometheus answered (JSON) here")
    p.add_argument("--replay", type=Path, help="draw from a --save-data file instead of running")
    args = p.parse_args(argv)
    if args.replay:
        data = json.loads(args.replay.read_text())
    else:
        data = run_and_collect(args)
        if data is None:
            return 1
        if args.save_data:
            args.save_data.write_text(json.dumps(data))
    boards = {json.loads(path.read_text())["uid"]: json.loads(path.read_text()) for path in DASHBOARDS}
    for uid, panels in data["panels"].items():
        out = args.out / f"dashboard-{uid}.png"
        note = "; silo = silo-001" if "$silo" in json.dumps(boards[uid]) else ""
        draw(boards[uid], panels, data["start"], data["end"], out, data["subtitle"] + note)
        print("wrote", out)
    if not args.replay:
        (args.out / "dashboard-runs.json").write_text(json.dumps(data["run"], indent=2) + "\n")
    return 0


def run_and_collect(args: argparse.Namespace) -> dict | None:
    """Run silo-sim under a fresh Prometheus; return every panel's answers, the run's window and a description."""
    work = Path(tempfile.mkdtemp(prefix="silokit-render-"))
    prom = Prometheus(work / "prometheus", scrape_interval="2s", evaluation_interval="2s").start()
    sim = None
    try:
        started = time.time()
        command = [sys.executable, "-m", "silo_sim.cli", "--silos", str(args.silos), "--workers", str(args.workers),
                   "--rounds", str(args.rounds), "--labels-per-class", str(args.labels_per_class), "--unlabeled",
                   str(args.unlabeled), "--validation-per-class", str(args.validation_per_class), "--no-baseline", "--workdir", str(work / "sim"),
                   "--prometheus-targets", str(prom.targets)]
        for option in args.option or ["local_epochs=1", "hub_epochs=2"]:
            command += ["--option", option]
        print("running:", " ".join(command[1:]), flush=True)
        sim = subprocess.Popen(command, cwd=ROOT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               stdout=open(work / "sim.log", "w"), stderr=subprocess.STDOUT)
        if sim.wait() != 0:
            print((work / "sim.log").read_text()[-3000:], file=sys.stderr)
            return None
        end = time.time()
        at = prom.last_time_all_up({"silokit-hub": 1, "silokit-silos": args.workers}, started, end)
        at_hub = prom.last_time_all_up({"silokit-hub": 1}, started, end)
        if at is None or at_hub is None:
            print("error: Prometheus never scraped all endpoints at once", file=sys.stderr)
            return None
        panels = {}
        for path in DASHBOARDS:
            board = json.loads(path.read_text())
            panels[board["uid"]] = [(panel["id"], results) for panel, results in
                                    collect(prom, board, {"silo": "silo-001"}, started, end, [at_hub, at])]
        day = time.strftime("%Y-%m-%d", time.gmtime(started))
        return {
            "start": started, "end": end, "at": at, "panels": panels,
            "subtitle": f"silo-sim: {args.silos} silos in {args.workers} workers, {args.rounds} rounds; real metrics "
                        f"scraped by Prometheus every 2 s; {day}",
            "run": {"command": ["silo-sim", *(c.replace(str(work), "$TMP") for c in command[3:])],
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                    "seconds": round(end - started, 1),
                    "images": [f"dashboard-{uid}.png" for uid in panels]},
        }
    finally:
        if sim is not None:
            stop_process_group(sim)
        prom.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
