"""The shipped ops/ files: valid for the tools that load them, consistent with each other and with the metrics the
code exports. (The e2e test tests/e2e/test_ops.py runs them against a real Prometheus.)"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from security import pki
from security.cli import main as silo_certs
from silo_client.metrics import SiloMetricFamilies, SiloMetrics
from silo_server.config import parse_config
from silo_server.metrics import MALFORMED_UPDATE_REASONS, REFUSAL_REASONS, HubMetrics
from tests.silo_server.test_hub import make_hub
from tools import build_dashboards
from tools.promstack import DASHBOARDS, alert_rules, alert_signal, dashboard_queries

ROOT = Path(__file__).resolve().parent.parent.parent
OPS = ROOT / "ops"
PROMTOOL = shutil.which("promtool")
# .ci/run installs Prometheus and sets SILOKIT_REQUIRE_PROMETHEUS=1: there a missing promtool fails instead of skipping.
needs_promtool = pytest.mark.skipif(PROMTOOL is None and os.environ.get("SILOKIT_REQUIRE_PROMETHEUS") != "1",
                                    reason="needs promtool (apt-get install prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, "promtool is not on PATH (Debian: apt-get install prometheus)"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@needs_promtool
def test_promtool_accepts_the_config_and_the_rules_and_every_alert_passes_its_unit_test():
    for args in (("check", "config", "ops/prometheus/prometheus.yml"), ("check", "rules", "ops/prometheus/alerts.yml"),
                 ("test", "rules", "tests/ops/alerts_test.yml")):
        result = promtool(*args)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    tested = {t["alertname"] for case in yaml.safe_load((ROOT / "tests/ops/alerts_test.yml").read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == {r["alert"] for r in alert_rules()}, "every alert needs a promtool test where it fires"


def test_every_alert_is_a_signal_against_a_threshold_with_severity_and_guidance():
    for rule in alert_rules():
        assert alert_signal(rule["expr"]).count(" bool ") == 1, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40, rule["alert"]
    with pytest.raises(ValueError, match="not '<signal> <comparison> <number>'"):
        alert_signal("up == 0 or absent(up)")  # a shape the e2e test could not check: refused


def test_the_certificate_alerts_name_a_silo_certs_command_that_works_on_a_live_certificate(tmp_path, capsys):
    """The expiry alerts fire while the certificate is still live, when issuing for the name again is refused:
    the command they name must be the one that renews a live certificate."""
    ca = pki.init_ca(tmp_path / "ca")
    pki.issue_hub(ca, tmp_path / "hub")
    pki.issue_silos(ca, [("branch-a", tmp_path / "branch-a")])
    for alert, name in (("SilokitHubCertificateExpiring", "hub"), ("SilokitSiloCertificateExpiring", "branch-a")):
        (rule,) = [r for r in alert_rules() if r["alert"] == alert]
        text = rule["annotations"]["description"].replace("{{ $labels.silo }}", name)
        command = re.search(r"`silo-certs ([^`]+)`", text).group(1).split()
        assert silo_certs([*command, "--ca", str(ca), "--out", str(tmp_path / f"{name}-new")]) == 0, command
    capsys.readouterr()


def test_the_malformed_update_alert_watches_every_reason_validation_refuses_an_upload_for():
    (rule,) = [r for r in alert_rules() if r["alert"] == "SilokitUpdatesRefused"]
    watched = re.search(r'reason=~"([^"]+)"', rule["expr"]).group(1).split("|")
    assert sorted(watched) == sorted(MALFORMED_UPDATE_REASONS) and set(watched) <= set(REFUSAL_REASONS)
    source = "".join((ROOT / f).read_text() for f in ("security/validation.py", "silo_server/wire/servicer.py",
                                                       "silo_server/wire/intake.py", "silo_server/rounds/privacy.py"))
    raised = refusal_reasons(source)
    assert set(MALFORMED_UPDATE_REASONS) <= raised, sorted(set(MALFORMED_UPDATE_REASONS) - raised)


def refusal_reasons(source: str) -> set[str]:
    """The reasons of every refusal raised in `source`: refuse(silo, "CODE", "reason", ...), Invalid("CODE",
    "reason", ...), Refusal(...) and _bad(...), the code possibly chosen by a conditional."""
    code = r'"[A-Z_]+"(?: if \w+ else "[A-Z_]+")?'
    return set(re.findall(rf'(?:_bad|Invalid|refuse|Refusal)\((?:\w+, )?(?:{code},\s*)?"([a-z_]+)"', source))


def test_every_reason_the_hub_refuses_for_is_exported_at_zero_from_the_start():
    # A reason missing from REFUSAL_REASONS has no series until its first refusal, so increase() and the alerts
    # over it miss that first one.
    files = [*(ROOT / "silo_server").rglob("*.py"), *(ROOT / "security").rglob("*.py")]
    raised = refusal_reasons("".join(f.read_text() for f in files))
    assert len(raised) >= 20  # the scan still finds the refusals
    assert raised <= set(REFUSAL_REASONS), sorted(raised - set(REFUSAL_REASONS))


def exported_metric_names(state_dir: Path) -> set[str]:
    """Every sample name the hub and a silo export (histograms: _bucket/_sum/_count; counters: _total)."""
    hub = HubMetrics(make_hub(state_dir))
    families = SiloMetricFamilies()
    silo = SiloMetrics(families, "s")
    silo.joined("cpu", 1, 0)
    silo.hub_error("UNAVAILABLE")
    names = set()
    for registry in (hub.registry, families.registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                name, kind = line.split()[2:4]
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
            elif line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line)[0])
    return names


def test_dashboards_and_alerts_only_use_metrics_the_code_exports(tmp_path):
    exported = exported_metric_names(tmp_path)
    queries = [q for _, _, q in dashboard_queries({"silo": "s"})] + [r["expr"] for r in alert_rules()]
    used = {m for q in queries for m in re.findall(r"\bsilokit_[a-z0-9_]+", q)}
    assert used and used <= exported, f"unknown metrics: {sorted(used - exported)}"


def test_dashboards_are_up_to_date_and_use_the_provisioned_datasource_on_a_clean_grid():
    assert build_dashboards.main(["--check"]) == 0, "run python tools/build_dashboards.py"
    datasource = yaml.safe_load((OPS / "grafana/provisioning/datasources/silokit.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert {p.name for p in DASHBOARDS} == {"silokit-overview.json", "silokit-silo.json"}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        ids, cells = set(), set()
        for panel in board["panels"]:
            assert panel["id"] not in ids
            ids.add(panel["id"])
            assert panel["datasource"]["uid"] == datasource["uid"], (path.name, panel["title"])
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24 and panel["targets"], (path.name, panel["title"])
            cover = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cover & cells, f"{path.name}: {panel['title']} overlaps another panel"
            cells |= cover
    overview = json.loads((OPS / "grafana/dashboards/silokit-overview.json").read_text())
    titles = {p["title"] for p in overview["panels"]}
    assert {"Rounds", "Silos", "Test accuracy", "Privacy (epsilon)"} <= titles  # what the issue asks to see


def test_the_compose_steps_hand_the_hub_key_to_the_containers_user():
    """silo-certs writes key.pem 0600 for whoever ran it; the hub container runs as the Dockerfile's user, so the
    documented steps must give that uid the bundle, or the hub cannot read its key and restarts forever."""
    uid = re.search(r"useradd --system --uid (\d+)", (OPS / "compose/Dockerfile").read_text()).group(1)
    for text in ((OPS / "compose/compose.yaml").read_text(), (ROOT / "docs/operations.md").read_text()):
        assert f"chown -R {uid} ops/compose/pki/hub" in text


def test_grafana_provisioning_and_compose_agree_on_paths():
    compose = yaml.safe_load((OPS / "compose/compose.yaml").read_text())
    provider = yaml.safe_load((OPS / "grafana/provisioning/dashboards/silokit.yml").read_text())["providers"][0]
    mounts = {}
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            mounts[target] = source
            if source.startswith("."):  # a bind mount: it must exist, except the operator's own certificates
                assert (OPS / "compose" / source).exists() or source == "./pki/hub", source
    assert mounts[provider["options"]["path"]] == "../grafana/dashboards"
    assert mounts["/etc/grafana/provisioning/datasources"] == "../grafana/provisioning/datasources"
    assert mounts["/etc/prometheus"] == "../prometheus"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name in {p.name for p in DASHBOARDS} and Path(home).parent == Path(provider["options"]["path"])
    build = compose["services"]["hub"]["build"]
    assert ((OPS / "compose" / build["context"]).resolve() / build["dockerfile"]).is_file()
    # The container's hub.yaml is a valid hub config whose metrics endpoint is the one Prometheus scrapes.
    hub = parse_config(yaml.safe_load((OPS / "compose/hub.yaml").read_text()), "ops/compose/hub.yaml")
    target = yaml.safe_load((OPS / "prometheus/targets/hub.yml").read_text())[0]["targets"][0]
    assert target == f"{hub.metrics.host}:{hub.metrics.port}"
    datasource = yaml.safe_load((OPS / "grafana/provisioning/datasources/silokit.yml").read_text())["datasources"][0]
    prometheus_listen = [a for a in compose["services"]["prometheus"]["command"] if "listen-address" in a][0]
    assert datasource["url"] == "http://" + prometheus_listen.split("=")[1]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_units_verify(tmp_path):
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "silo-server").exists():
        pytest.skip("silo-server is not installed beside this Python (pip install -e .)")
    for name in ("silokit-hub.service", "silokit-silo.service"):
        text = (OPS / "systemd" / name).read_text().replace("/opt/silokit/bin/", f"{bin_dir}/")
        (tmp_path / name).write_text(text.replace("/etc/silokit/silo.env", str(OPS / "systemd/silo.env")))
    result = subprocess.run(["systemd-analyze", "verify", "silokit-hub.service", "silokit-silo.service"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    env = dict(line.split("=", 1) for line in (OPS / "systemd/silo.env").read_text().splitlines()
               if line and not line.startswith("#"))
    exec_start = [line for line in (OPS / "systemd/silokit-silo.service").read_text().splitlines()
                  if line.startswith("ExecStart=")][0]
    assert set(re.findall(r"\$\{(\w+)\}", exec_start)) == set(env)  # every variable the unit uses is defined
    # silo-client exits 3 when it left the run by its policy: systemd must not restart it into the same refusal
    unit = (OPS / "systemd/silokit-silo.service").read_text()
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=3" in unit


def test_every_exported_metric_is_documented(tmp_path):
    doc = (ROOT / "docs/operations.md").read_text()
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported_metric_names(tmp_path)}
    families = {n for n in families if n.startswith("silokit_")}
    missing = sorted(n for n in families if f"`{n}`" not in doc)
    assert len(families) > 50 and not missing, f"metrics missing from docs/operations.md: {missing}"
