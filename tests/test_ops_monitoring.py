"""The shipped Grafana dashboard and Prometheus alert rules (``docs/monitoring/``).

Both files must parse, and every series their queries name must be one the
broker exposes: the names are taken from a real exposition of
:class:`broker.service.metrics.BrokerMetrics` with every metric given a value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from broker.service.metrics import BrokerMetrics

MONITORING = Path(__file__).resolve().parent.parent / "docs" / "monitoring"
DASHBOARD = MONITORING / "slicebroker-dashboard.json"
ALERTS = MONITORING / "slicebroker-alerts.yml"
#: Series a query may name that Prometheus itself makes, not the broker.
PROMETHEUS_SERIES = {"up"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}


def exposed_series() -> dict[str, str]:
    """Every series name the broker's metrics endpoint can show, with its family's name
    (the ``_created`` series of counters and histograms left out)."""
    metrics = BrokerMetrics()
    for metric in vars(metrics).values():
        if not isinstance(metric, Counter | Gauge | Histogram):
            continue
        labels = {name: "x" for name in metric._labelnames}
        child = metric.labels(**labels) if labels else metric
        if isinstance(metric, Histogram):
            child.observe(1.0)
        elif isinstance(metric, Counter):
            child.inc()
        else:
            child.set(1)
    text = metrics.exposition().decode()
    return {
        sample.name: family.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")  # creation times: no query needs them
    }


def series_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (functions, labels, keywords left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings first: they may hold anything
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.groups()
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        queries += [target["expr"] for target in panel["targets"]]
    return queries


def alert_rules() -> list[dict]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def test_series_names_finds_the_metrics_a_query_selects():
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate(slicebroker_pass_duration_seconds_bucket"
        '{job="x", a=~"b|c"}[$__rate_interval]))) > 1 unless on (project) up == 0'
    )
    assert series_names(expr) == {"slicebroker_pass_duration_seconds_bucket", "up"}
    assert series_names("min_over_time((sum by (p) (x_total))[6h:5m]) and y") == {"x_total", "y"}


def test_the_dashboard_parses_and_shows_every_metric_by_an_existing_name():
    exposed = exposed_series()
    queries = dashboard_queries()
    assert len(queries) >= 15
    named = set().union(*(series_names(q) for q in queries))
    assert named <= set(exposed) | PROMETHEUS_SERIES, named - set(exposed)
    # every family the broker exports has a panel
    assert {exposed[name] for name in named if name in exposed} == set(exposed.values())
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    project = next(v for v in variables if v["name"] == "project")
    assert series_names(project["definition"].removeprefix("label_values(").split(",")[0]) <= set(
        exposed
    )


def test_the_alert_rules_parse_and_name_only_existing_metrics():
    exposed = set(exposed_series())
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= {
        "SlicebrokerUnreachable",
        "SlicebrokerDatabaseUnavailable",
        "SlicebrokerPassFailing",
        "SlicebrokerPassSlow",
        "SlicebrokerDrainStuck",
        "SlicebrokerProjectStarved",
    }
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]
        names = series_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= exposed | PROMETHEUS_SERIES, (rule["alert"], names - exposed)


@pytest.mark.parametrize("path", [DASHBOARD, ALERTS])
def test_the_monitoring_files_are_linked_from_the_monitoring_page(path):
    page = (MONITORING.parent / "monitoring.md").read_text()
    assert f"monitoring/{path.name}" in page
