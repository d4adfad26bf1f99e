"""Every labelled counter and histogram series exists at zero before its first event (so
that the event shows in rate() and increase()), and the alert rules hold up under
promtool: they parse, each alert has a unit test, and a deliberately wrong rule fails one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import requests
from hubfixtures import wait_until
from prometheus_client.parser import text_string_to_metric_families
from servicefixtures import REPO_ROOT, free_port, running_service, serving_in_process
from test_ops_monitoring import dashboard_queries

from broker.core.model import Decisions, EndReason, PreemptReason, SliceKind
from broker.core.resume import RESUME_PHASE
from broker.service.metrics import PASS_PHASES, PHASE_SERIES, BrokerMetrics

MONITORING = REPO_ROOT / "docs" / "monitoring"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of an exposition: (name, labels) -> value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_every_reason_and_phase_has_its_series_at_zero_from_the_start():
    exposed = samples(BrokerMetrics().exposition().decode())
    for reason in EndReason:
        assert (
            exposed[("slicebroker_slice_endings_total", frozenset({("reason", reason.value)}))] == 0
        )
    for reason in PreemptReason:
        key = ("slicebroker_preemptions_total", frozenset({("reason", reason.value)}))
        assert exposed[key] == 0
    for phase in PHASE_SERIES:
        key = ("slicebroker_pass_phase_duration_seconds_count", frozenset({("phase", phase)}))
        assert exposed[key] == 0


def test_a_resumed_pass_counts_in_its_own_phase_series():
    metrics = BrokerMetrics()
    metrics.record_pass(Decisions(phase_seconds={RESUME_PHASE: 0.001}), {}, 0.002)
    exposed = samples(metrics.exposition().decode())
    count = "slicebroker_pass_phase_duration_seconds_count"
    assert exposed[(count, frozenset({("phase", RESUME_PHASE)}))] == 1
    assert all(exposed[(count, frozenset({("phase", phase)}))] == 0 for phase in PASS_PHASES)
    assert exposed[("slicebroker_pass_duration_seconds_count", frozenset())] == 1


def queue_wait_counts(text: str) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["project"], dict(labels)["kind"]): value
        for (name, labels), value in samples(text).items()
        if name == "slicebroker_queue_wait_seconds_count"
    }


async def test_each_projects_grant_series_is_at_zero_before_its_first_grant(tmp_path):
    async with serving_in_process(f"sqlite:///{tmp_path}/b.sqlite") as api:
        admin = api.admin_token
        decisions = await api.runner.run_pass()
        assert tuple(decisions.phase_seconds) == PASS_PHASES  # the phases the metrics know
        counts = queue_wait_counts((await api.call("GET", "/metrics", token=admin)).text)
        kinds = [kind.value for kind in SliceKind]
        assert counts == {(p, k): 0 for p in ("vision", "nlp") for k in kinds}
        # a project made through the API has its series before anything is charged to it
        made = await api.call(
            "PUT",
            "/projects/speech",
            token=admin,
            json={"share": 1, "parent": "lab", "users": ["dan"]},
        )
        assert made.status == 200, made.text
        counts = queue_wait_counts((await api.call("GET", "/metrics", token=admin)).text)
        assert counts[("speech", "batch")] == 0
        body = {"project": "speech", "gpus": 1, "kind": "batch", "user": "dan"}
        submitted = (await api.call("POST", "/slices", token=admin, json=body)).json
        params = {"wait": 10, "state": "pending"}
        granted = await api.call("GET", f"/slices/{submitted['id']}", token=admin, params=params)
        assert granted.json["state"] == "granted", granted.text
        counts = queue_wait_counts((await api.call("GET", "/metrics", token=admin)).text)
        assert counts[("speech", "batch")] == 1


# ---- the alert rules under promtool ----------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)"
)


def promtool(*args: str | Path, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@needs_promtool
def test_the_alert_rules_pass_promtools_check():
    checked = promtool("check", "rules", "slicebroker-alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 10 rules found" in checked.stdout


@needs_promtool
def test_every_alert_has_a_unit_test_and_they_pass():
    tested = promtool("test", "rules", "slicebroker-alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = Path(MONITORING / "slicebroker-alerts.yml").read_text()
    tests = Path(MONITORING / "slicebroker-alerts.test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert len(alerts) == 10
    for alert in alerts:
        assert f"alertname: {alert}" in tests, f"no unit test for {alert}"


@needs_promtool
def test_a_deliberately_wrong_rule_fails_its_unit_test(tmp_path):
    # The starvation rule without its "unless" clause fires for a project that was granted:
    # the unit tests must notice.
    rules = (MONITORING / "slicebroker-alerts.yml").read_text()
    starved = rules.index("alert: SlicebrokerProjectStarved")
    clause = rules.index("unless on (project)", starved)
    end = rules.index("\n        for:", clause)
    wrong = rules[:clause] + rules[end:]
    assert wrong != rules
    (tmp_path / "slicebroker-alerts.yml").write_text(wrong)
    shutil.copy(MONITORING / "slicebroker-alerts.test.yml", tmp_path)
    assert promtool("check", "rules", "slicebroker-alerts.yml", cwd=tmp_path).returncode == 0
    tested = promtool("test", "rules", "slicebroker-alerts.test.yml", cwd=tmp_path)
    assert tested.returncode != 0, tested.stdout
    assert "SlicebrokerProjectStarved" in tested.stdout + tested.stderr


def test_the_monitoring_page_lists_every_rule():
    rules = (MONITORING / "slicebroker-alerts.yml").read_text()
    page = (REPO_ROOT / "docs" / "monitoring.md").read_text()
    for line in rules.splitlines():
        if "- alert:" in line:
            assert f"`{line.split(':', 1)[1].strip()}`" in page


# ---- a real Prometheus scraping a real broker ------------------------------------------------

PROMETHEUS = shutil.which("prometheus")
#: What Grafana puts in for the dashboard's variables.
GRAFANA_VARIABLES = {"$project": ".*", "$__rate_interval": "1m", "$__interval": "15s"}


class Prometheus:
    """A Prometheus server scraping ``target`` every second, with the shipped rules loaded."""

    def __init__(self, directory: Path, target: str):
        self.port = free_port()
        config = directory / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{MONITORING / 'slicebroker-alerts.yml'}]\n"
            "scrape_configs:\n"
            "  - job_name: slicebroker\n"
            "    metrics_path: /api/v1/metrics\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def query(self, expr: str) -> list[dict]:
        answer = requests.get(
            f"http://127.0.0.1:{self.port}/api/v1/query", params={"query": expr}, timeout=10
        ).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict]:
        """The first non-empty answer to ``expr`` (polled)."""

        def answer() -> list[dict] | None:
            try:
                return self.query(expr)
            except requests.RequestException:  # not listening, or not ready, yet
                return None

        return wait_until(answer, timeout, what=f"Prometheus to answer {expr}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self.log.close()


needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install prometheus)"
)


@needs_prometheus
def test_a_real_prometheus_sees_a_first_grant_and_answers_every_dashboard_query(tmp_path):
    args = ["--no-authenticate-metrics"]
    with running_service(tmp_path / "broker", pass_interval=1, extra_args=args) as service:
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{service.port}")
        try:
            # vision's grant series is scraped at zero before its first grant ...
            zero = 'slicebroker_queue_wait_seconds_count{project="vision", kind="batch"} == 0'
            prometheus.wait_for(f"count_over_time(({zero})[1m:1s]) >= 2")
            body = {"project": "vision", "gpus": 1, "kind": "batch", "min_runtime": "1h"}
            alice = service.token("alice")
            made = service.post("/slices", token=alice, json=body).json()
            assert made["state"] == "granted", made
            # ... so the grant shows in increase(), as the dashboard's "Grants" panel asks
            grants = 'increase(slicebroker_queue_wait_seconds_count{project="vision"}[1m]) > 0'
            assert prometheus.wait_for(grants)[0]["metric"]["kind"] == "batch"
            for expr in dashboard_queries():
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                prometheus.query(expr)  # every panel's query is valid PromQL on real data
            assert prometheus.query(
                "sum by (project) (max by (project, kind) (slicebroker_queue_length_slices)) >= 0"
            )
            rules = requests.get(
                f"http://127.0.0.1:{prometheus.port}/api/v1/rules", timeout=10
            ).json()["data"]["groups"][0]["rules"]
            assert len(rules) == 10 and {rule["health"] for rule in rules} <= {"ok", "unknown"}
        finally:
            prometheus.stop()
