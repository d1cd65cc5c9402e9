"""A real Prometheus next to a silo-sim run, for the e2e test and the dashboard picture in the docs.

- `Prometheus`: starts the `prometheus` binary on 127.0.0.1 (free port, its own storage in a temp dir) with the
  shipped ops/prometheus config (only the scrape and evaluation intervals changed), answers HTTP API queries, and
  stops its process (and nothing else) at the end.
- `dashboard_queries` / `alert_signals`: every query in the shipped dashboards and alert rules, in a form that can
  be asked of Prometheus (template variables substituted; an alert's comparison turned into a `bool` one, so the
  answer is 0 or 1 per series whether or not it fires).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"
DASHBOARDS = sorted((OPS / "grafana" / "dashboards").glob("*.json"))
ALERTS = OPS / "prometheus" / "alerts.yml"

_COMPARISON = re.compile(r"(?s)^(?P<signal>.*\S)\s*(?P<op>==|!=|>=|<=|>|<)\s*(?P<threshold>-?[0-9.]+)$")


class PrometheusError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str | None:
    return shutil.which(name)


class Prometheus:
    """A Prometheus server of our own: `with Prometheus(workdir) as prom: ...`."""

    def __init__(self, workdir: Path, scrape_interval: str = "1s", evaluation_interval: str = "1s"):
        exe = binary("prometheus")
        if exe is None:
            raise PrometheusError("the prometheus binary is not on PATH; install it (Debian: apt-get install "
                                  "prometheus) or see docs/operations.md")
        self.exe = exe
        self.dir = Path(workdir)
        self.config_dir = self.dir / "config"
        self.targets = self.config_dir / "targets"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._write_config(scrape_interval, evaluation_interval)

    def _write_config(self, scrape_interval: str, evaluation_interval: str) -> None:
        """The shipped prometheus.yml and alerts.yml, with faster intervals and an empty targets folder."""
        self.config_dir.mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=scrape_interval, evaluation_interval=evaluation_interval,
                                scrape_timeout=scrape_interval)
        (self.config_dir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        shutil.copy(ALERTS, self.config_dir / "alerts.yml")
        self.targets.mkdir(exist_ok=True)
        for name in ("hub.yml", "silos.yml"):
            (self.targets / name).write_text("[]\n")

    def start(self, timeout: float = 60.0) -> Prometheus:
        log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [self.exe, f"--config.file={self.config_dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}: "
                                      f"{(self.dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready within {timeout:.0f}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP API
    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:
            body = json.loads(err.read() or b"{}")
            raise PrometheusError(f"{path} {params}: {body.get('error', err)}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")["result"]

    def active_targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def last_time_all_up(self, jobs: dict[str, int], start: float, end: float) -> float | None:
        """The last moment (1 s resolution) when every job had its expected number of targets up."""
        best = None
        ok_by_job = []
        for job, count in jobs.items():
            series = self.query_range(f'count(up{{job="{job}"}} == 1)', start, end, 1)
            ok_by_job.append({float(t) for t, v in (series[0]["values"] if series else []) if int(v) >= count})
        both = set.intersection(*ok_by_job) if ok_by_job else set()
        if both:
            best = max(both)
        return best


# ---------------------------------------------------------------------- the shipped queries
def _panels(board: dict) -> list[dict]:
    out = []
    for p in board.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))  # panels nested in collapsed rows
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    if "$" in expr:
        raise ValueError(f"unknown template variable in {expr!r}; known: {', '.join(sorted(variables))}")
    return expr


def dashboard_queries(variables: dict[str, str], paths: list[Path] | None = None) -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, query) for every panel target, with template variables substituted."""
    out = []
    for path in paths or DASHBOARDS:
        board = json.loads(Path(path).read_text())
        for panel in _panels(board):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((board["title"], panel["title"], substitute(target["expr"], variables)))
    return out


def dashboard_variable_queries(paths: list[Path] | None = None) -> list[tuple[str, str, str, str]]:
    """(dashboard, variable, metric selector, label) for every `label_values(metric, label)` template variable."""
    out = []
    for path in paths or DASHBOARDS:
        board = json.loads(Path(path).read_text())
        for var in board.get("templating", {}).get("list", []):
            query = var.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", text)
            if m:
                out.append((board["title"], var["name"], m.group(1), m.group(2)))
    return out


def alert_rules(path: Path = ALERTS) -> list[dict]:
    return [r for g in yaml.safe_load(Path(path).read_text())["groups"] for r in g["rules"] if "alert" in r]


def alert_signal(expr: str) -> str:
    """`signal op threshold` -> `(signal) op bool threshold`: 0 or 1 per series of the signal, firing or not."""
    m = _COMPARISON.match(" ".join(expr.split()))
    if m is None:
        raise ValueError(f"alert expression {expr!r} is not '<signal> <comparison> <number>'")
    return f"({m['signal']}) {m['op']} bool {m['threshold']}"


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a process started with start_new_session=True and everything it started (its process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children the leader did not reap in time
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()
