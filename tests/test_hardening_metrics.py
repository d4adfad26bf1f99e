"""Every labelled counter and histogram series exists at zero before its first event (so
that the event shows in rate() and increase()), and the alert rules hold up under
promtool: they parse, each alert has a unit test, and a deliberately wrong rule fails one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from servicefixtures import REPO_ROOT, serving_in_process

from broker.core.model import EndReason, PreemptReason, SliceKind
from broker.service.metrics import PASS_PHASES, BrokerMetrics

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
    for phase in PASS_PHASES:
        key = ("slicebroker_pass_phase_duration_seconds_count", frozenset({("phase", phase)}))
        assert exposed[key] == 0


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
    assert "SUCCESS: 9 rules found" in checked.stdout


@needs_promtool
def test_every_alert_has_a_unit_test_and_they_pass():
    tested = promtool("test", "rules", "slicebroker-alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = Path(MONITORING / "slicebroker-alerts.yml").read_text()
    tests = Path(MONITORING / "slicebroker-alerts.test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert len(alerts) == 9
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
