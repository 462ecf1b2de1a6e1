"""The Prometheus rules, scrape configuration and Grafana dashboard in deploy/
work as shipped: promtool accepts the rules, the configuration and its target
files, and the rules' unit tests pass; the gateway's targets are all its
processes' admin ports; every dashboard query is valid PromQL, and every metric
they name is one a Hedgerow process exports (read from the real collectors of
the gateway, control plane and worker)."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from control_plane.metrics import ControlPlaneMetrics
from gateway.admin.metrics import GatewayMetrics
from hedgerow.latest import LatestValue
from tests.support.deploy_recipes import arg, unit_command
from hedgerow.wire import RegistrySnapshot
from workers.backend import BackendLoad
from workers.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "hedgerow.json"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
# Hedgerow's own names and the OpenTelemetry GenAI ones; recording rules use colons.
METRIC = re.compile(r"\b(?:hedgerow|gen_ai)_[a-z0-9_]+\b")
RECORDED = re.compile(r"\bhedgerow:[a-z0-9_:]+\b")
# Label names are not metric names: selectors and grouping clauses are left out.
LABELS = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$tenant": ".*"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # make test installs Debian's prometheus package (promtool) like the other tools.
    assert shutil.which("promtool"), "promtool missing: apt-get install prometheus"
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def rule_expressions() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def recorded_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def dashboard_expressions() -> list[str]:
    exprs = [t["expr"] for panel in dashboard_panels() for t in panel["targets"]]
    for variable, value in GRAFANA_VARIABLES.items():
        exprs = [e.replace(variable, value) for e in exprs]
    return exprs


def exported_names() -> set[str]:
    """Every series name the three process kinds can export, from their collectors
    fed with one of everything."""
    gateway = GatewayMetrics()
    request = gateway.request(1.0)
    request.identified("acme", "interactive")
    request.labelled("m", "interactive")
    request.responded(200)
    request.relayed(1.1, 1.1, token=True)
    request.used(3, 4)
    request.finished(1.2)
    gateway.cache_lookup("miss")
    gateway.watch_cache(lambda: {"embedder": {"ready": 1}})
    stats = {"counters": {"shed_deadline": 1}, "breakers": {"w": "open"}, "queued": {"m": 1},
             "inflight": {"w": 1}, "hedge_budget": {"level": 1.0}}
    texts = [gateway.render(stats, RegistrySnapshot(version=0))]
    texts.append(ControlPlaneMetrics(LatestValue(RegistrySnapshot(version=0))).render())
    load = BackendLoad(1, 0, 0, 0.0, 0, 0, 0)
    texts.append(WorkerMetrics(lambda: load, lambda: False).render())
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                "gauge": ("",)}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            names.update(family.name + s for s in suffixes.get(family.type, ("",)))
            names.update(sample.name for sample in family.samples)
    return names


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_the_alerts_fire_on_the_series_they_are_about() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool has no expression checker of its own: the queries as recording rules.
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr}
        for i, expr in enumerate(dashboard_expressions())]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Hedgerow"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in dashboard_panels()}
    for wanted in ("TTFT p50/p95/p99 by class", "Shed/s by reason", "Open circuit breakers "
                   "by worker", "Workers registered", "Cache hit ratio (15m)",
                   "Redis faults/s and limit fallbacks/s", "Tokens/s by tenant and type",
                   "Cost per hour by tenant (policy currency)"):
        assert wanted in titles
    for panel in dashboard_panels():
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])


def test_rules_and_dashboard_name_only_metrics_hedgerow_exports() -> None:
    exported = exported_names()
    assert "hedgerow_tenant_tokens_total" in exported  # the collectors were all read
    for source, exprs in (("alerts.yml", rule_expressions()),
                          ("hedgerow.json", dashboard_expressions())):
        named = {name for expr in exprs for name in METRIC.findall(LABELS.sub(" ", expr))}
        assert named, source
        assert not named - exported, f"{source} names unexported {sorted(named - exported)}"
        recorded = {name for expr in exprs for name in RECORDED.findall(expr)}
        assert not recorded - recorded_names(), f"{source}: {sorted(recorded - recorded_names())}"


def scrape_job(name: str) -> dict[str, Any]:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    job: dict[str, Any] = next(j for j in config["scrape_configs"] if j["job_name"] == name)
    return job


def test_promtool_accepts_the_scrape_config_and_its_target_files(tmp_path: Path) -> None:
    # The files the scrape presents are the operator's; promtool wants them to exist.
    copy = tmp_path / "prometheus"
    shutil.copytree(SCRAPE_CONFIG.parent, copy)
    job = scrape_job("hedgerow-gateway")
    secrets = [job["authorization"]["credentials_file"],
               *(job["tls_config"][k] for k in ("ca_file", "cert_file", "key_file"))]
    for secret in secrets:
        (copy / secret).parent.mkdir(parents=True, exist_ok=True)
        (copy / secret).touch()
    checked = promtool("check", "config", SCRAPE_CONFIG.name, cwd=copy)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def test_the_gateway_job_scrapes_every_process_of_the_systemd_gateway() -> None:
    """Process i of the unit's gateway serves /metrics on --admin-port + i: the
    example host's targets are exactly the ports of its processes, from the first."""
    argv, _ = unit_command("hedgerow-gateway.service")
    first = int(arg(argv, "--admin-port")[0])
    (sd,) = scrape_job("hedgerow-gateway")["file_sd_configs"]
    (pattern,) = sd["files"]
    files = [p for p in SCRAPE_CONFIG.parent.rglob("*.yml")
             if fnmatch.fnmatch(str(p.relative_to(SCRAPE_CONFIG.parent)), pattern)]
    assert files, f"no example target file matches {pattern}"
    for path in files:
        for group in yaml.safe_load(path.read_text()):
            hosts = {t.rpartition(":")[0] for t in group["targets"]}
            ports = [int(t.rpartition(":")[2]) for t in group["targets"]]
            assert len(hosts) == 1 and group["labels"]["pop"], path.name
            assert ports == list(range(first, first + len(ports))), path.name
    # The recipe in the comment writes the same ports.
    assert f"$(({first} + i))" in SCRAPE_CONFIG.read_text()
