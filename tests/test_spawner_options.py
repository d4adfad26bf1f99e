"""spawner.options and spawner.notices: what the user may ask for, and what they are told."""

from __future__ import annotations

import os
import re
import time
import tomllib
from fnmatch import fnmatch
from html.parser import HTMLParser
from pathlib import Path

import pytest

from broker.units import ordinal
from spawner.notices import (
    clock_time,
    describe,
    notice_from_slice,
    notices_for,
    queue_event,
    sooner_text,
    wait_reason,
    wait_text,
)
from spawner.options import (
    FORM_TEMPLATE,
    TEMPLATES,
    Choices,
    GpuTypeView,
    OptionsError,
    ProjectView,
    SliceRequest,
    budget_position,
    capacity_note,
    form_template,
    gpu_type_views,
    options_from_form,
    project_views,
    render_form,
    resolve_request,
)

ROWS = [
    {"name": "org", "parent": None, "is_project": False, "usage": 1000.0},
    {
        "name": "vision",
        "parent": "org",
        "is_project": True,
        "usage": 800.0,
        "entitlement": 0.35,
        "fairshare_value": 800 / 1000 / 0.35,
        "rank": 3,
        "users": ["alice", "bob"],
        "groups": [],
        "pending": 2,
        "gpus_held": 4,
    },
    {
        "name": "systems",
        "parent": "org",
        "is_project": True,
        "usage": 100.0,
        "entitlement": 0.2,
        "fairshare_value": 100 / 1000 / 0.2,
        "rank": 1,
        "users": ["alice"],
        "groups": [],
        "pending": 0,
        "gpus_held": 1,
    },
    {
        "name": "eval",
        "parent": "org",
        "is_project": True,
        "usage": 100.0,
        "entitlement": 0.1,
        "fairshare_value": 100 / 1000 / 0.1,
        "rank": 2,
        "users": [],
        "groups": ["demo-users"],
        "pending": 0,
        "gpus_held": 0,
    },
]
NODES = [
    {"name": "a", "gpu_type": "h100", "gpu_count": 8, "state": "ready", "gpus_held": 5},
    {"name": "b", "gpu_type": "h100", "gpu_count": 8, "state": "draining", "gpus_held": 8},
    {"name": "c", "gpu_type": "b200", "gpu_count": 4, "state": "down", "gpus_held": 0},
]
CHOICES = Choices(max_gpus=4)


def views(user="alice", groups=()):
    return project_views(ROWS, user, groups)


def test_a_user_sees_only_the_projects_they_may_charge_best_ranked_first():
    assert [p.name for p in views()] == ["systems", "vision"]
    assert [p.name for p in views("carol", ["demo-users"])] == ["eval"]
    assert views("mallory") == []


def test_the_budget_position_compares_usage_with_entitlement():
    systems, vision = views()
    assert vision.used_fraction == pytest.approx(0.8) and vision.over_share
    assert systems.used_fraction == pytest.approx(0.1) and not systems.over_share
    assert budget_position(vision) == (
        "entitled to 35%, used 80% of GPU time (over its share); rank 3; 2 waiting"
    )
    fresh = ProjectView("new", 0.5, 0.0, None, 0.0, 1, 0, 0)
    assert budget_position(fresh) == "entitled to 50%, no GPU time used yet; rank 1; nobody waiting"


def test_gpu_types_count_what_takes_work_what_is_free_and_what_is_out_of_service():
    assert gpu_type_views(NODES) == [GpuTypeView("h100", 16, 3, 8)]  # c (b200) is down


def test_the_capacity_note_tells_the_truth_about_draining_and_down_nodes():
    assert capacity_note(NODES[:1], 2) == ""
    partly = capacity_note(NODES, 2, "h100")
    assert partly.startswith("Out of service: b draining.")
    assert "waits may be longer" in partly
    assert "Only 8 h100 GPUs are in service" in capacity_note(NODES, 16, "h100")
    only_draining = [{**NODES[1], "state_reason": "firmware"}]
    assert capacity_note(only_draining, 1) == (
        "Out of service: b draining (firmware). No node with GPUs takes new work now, so "
        "nothing can start until an admin puts one back in service, and no start can be "
        "estimated."
    )
    assert "c down" in capacity_note(NODES, 1, "b200")


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, SliceRequest("systems", 1, None, 900.0)),
        (
            {"project": "vision", "gpus": "2", "gpu_type": "h100", "protected": "1h"},
            SliceRequest("vision", 2, "h100", 3600.0),
        ),
        ({"gpus": 4, "protected": 0}, SliceRequest("systems", 4, None, 0.0)),
        ({"protected": "8h", "gpu_type": "any"}, SliceRequest("systems", 1, None, 28800.0)),
        ({"protected": 7200}, SliceRequest("systems", 1, None, 7200.0)),
        ({"restore": "on"}, SliceRequest("systems", 1, None, 900.0, restore=True)),
        (
            {"restore": True, "restores": "12"},
            SliceRequest("systems", 1, None, 900.0, restore=True, restores=12),
        ),
        ({"restore": "", "restores": 12}, SliceRequest("systems", 1, None, 900.0, restores=12)),
    ],
)
def test_options_resolve_to_a_request(options, expected):
    assert (
        resolve_request(options, projects=views(), gpu_types=gpu_type_views(NODES), choices=CHOICES)
        == expected
    )


def test_the_admins_default_project_wins_when_the_user_may_charge_it():
    choices = Choices(default_project="vision")
    request = resolve_request({}, projects=views(), gpu_types=[], choices=choices)
    assert request.project == "vision"


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"project": "eval"}, "project"),
        ({"project": ["vision"]}, "project"),
        ({"gpus": 8}, "too_many_gpus"),
        ({"gpus": 3}, "gpus"),
        ({"gpus": 0}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"gpu_type": "b200"}, "gpu_type"),
        ({"protected": "3h"}, "protected"),
        ({"protected": "soon"}, "protected"),
        ({"restore": "maybe"}, "restore"),
        ({"restores": 0}, "restores"),
        ({"restores": "slice 12"}, "restores"),
    ],
)
def test_options_the_user_may_not_have_are_refused(options, reason):
    with pytest.raises(OptionsError) as raised:
        resolve_request(options, projects=views(), gpu_types=gpu_type_views(NODES), choices=CHOICES)
    assert raised.value.reason == reason
    assert raised.value.message.endswith(".")


def test_no_project_means_no_session_at_all():
    with pytest.raises(OptionsError) as raised:
        resolve_request({"protected": "0"}, projects=[], gpu_types=[], choices=CHOICES)
    assert raised.value.reason == "no_project"


def test_a_hub_that_brings_no_session_back_refuses_the_option_and_shows_no_box():
    choices = Choices(offer_restore=False)
    with pytest.raises(OptionsError, match="does not bring sessions back") as raised:
        resolve_request({"restore": "on"}, projects=views(), gpu_types=[], choices=choices)
    assert raised.value.reason == "restore"
    assert 'name="restore"' not in render_form(projects=views(), gpu_types=[], choices=choices)


def test_the_bring_it_back_box_is_offered_and_keeps_the_last_choice():
    fresh = render_form(projects=views(), gpu_types=[], choices=CHOICES)
    again = render_form(projects=views(), gpu_types=[], choices=CHOICES, previous={"restore": True})
    assert 'id="sb-restore" value="on">' in fresh  # unchecked
    assert 'id="sb-restore" value="on" checked>' in again
    assert "Bring it back after a preemption" in fresh


def test_form_fields_become_options():
    form = {"project": ["vision"], "gpus": ["2"], "gpu_type": [""], "protected": ["1h"], "x": ["y"]}
    assert options_from_form(form) == {
        "project": "vision",
        "gpus": "2",
        "gpu_type": "",
        "protected": "1h",
    }


class _Fields(HTMLParser):
    """Select names with their options (value, selected), from a rendered form."""

    def __init__(self):
        super().__init__()
        self.fields: dict[str, list[tuple[str, bool]]] = {}
        self._select = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "select":
            self._select = attrs["name"]
            self.fields[self._select] = []
        elif tag == "option":
            self.fields[self._select].append((attrs["value"], "selected" in attrs))


def test_the_form_offers_the_users_projects_counts_types_and_protected_lengths():
    html = render_form(
        projects=views(),
        gpu_types=gpu_type_views(NODES),
        choices=CHOICES,
        previous={"project": "vision", "gpus": "2", "protected": "1h"},
        queue_total=2,
    )
    parser = _Fields()
    parser.feed(html)

    assert parser.fields["project"] == [("systems", False), ("vision", True)]
    assert parser.fields["gpus"] == [("1", False), ("2", True), ("4", False)]
    assert parser.fields["gpu_type"] == [("", True), ("h100", False)]
    assert parser.fields["protected"] == [
        ("15m", False),
        ("1h", True),
        ("2h", False),
        ("4h", False),
        ("8h", False),
        ("0s", False),
    ]
    assert "15 min — debug: gets a GPU fastest" in html
    assert "0 — free: not charged" in html
    assert "h100 (3 of 16 free now; 8 on draining nodes)" in html
    assert "waiting request could use its GPUs" in html  # the idle rule, stated
    assert "2 requests waiting in the whole queue." in html
    assert "80% ▲" in html  # vision is over its share


def test_the_form_escapes_names_and_says_when_there_is_no_project():
    row = dict(ROWS[1], name="<b>x</b>", users=["alice"])
    html = render_form(
        projects=project_views([ROWS[0], row], "alice", []), gpu_types=[], choices=CHOICES
    )
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert 'id="sb-no-project"' in render_form(projects=[], gpu_types=[], choices=CHOICES)


# ---- the form's template ----------------------------------------------------------------------

ADMIN_TEMPLATE = """<ul id="my-projects">{% for option in project_options %}
<li data-selected="{{ option.selected }}">{{ option.label }}</li>{% endfor %}</ul>
<p id="my-queue">{{ queue_text }}</p>{{ notice_html }}"""


def test_the_form_is_the_shipped_template_with_every_element_the_pages_use():
    capped = Choices(max_gpus=4, project_caps={"vision": 2})
    html = render_form(
        projects=views(),
        gpu_types=gpu_type_views(NODES),
        choices=capped,
        notice_html='<div class="alert" id="sb-notice">Your GPU session was preempted</div>',
        queue_total=1,
        capacity=capacity_note(NODES, 1),
        queue_url="https://hub.example.org/services/slicebroker/queue?sort=rank&x=1",
    )
    ids = {
        "sb-notice",
        "sb-capacity",
        "sb-project",
        "sb-budget",
        "sb-queue-total",
        "sb-queue-link",
        "sb-gpus",
        "sb-gpus-cap",
        "sb-gpu-type",
        "sb-protected",
        "sb-idle-rule",
    }
    assert ids <= set(re.findall(r'id="([^"]+)"', html))
    assert html.startswith('<div class="slicebroker-options">')
    assert '<div class="alert" id="sb-notice">' in html  # the notice's HTML, as it was made
    assert "1 request waiting in the whole queue." in html
    assert 'href="https://hub.example.org/services/slicebroker/queue?sort=rank&amp;x=1"' in html
    assert "project.addEventListener" in html  # the script that applies the cap
    assert Path(form_template().filename) == Path(TEMPLATES) / FORM_TEMPLATE


def test_the_template_ships_with_the_package():
    with open(Path(TEMPLATES).parents[1] / "pyproject.toml", "rb") as f:
        shipped = tomllib.load(f)["tool"]["setuptools"]["package-data"]["spawner"]
    name = f"{Path(TEMPLATES).name}/{FORM_TEMPLATE}"
    assert any(fnmatch(name, pattern) for pattern in shipped)


def test_a_broker_error_replaces_the_form_escaped():
    html = render_form(
        projects=views(), gpu_types=[], choices=CHOICES, broker_error="Not answering <now>"
    )
    assert html.strip() == (
        '<div class="alert alert-danger" id="sb-broker-error">Not answering &lt;now&gt;</div>'
    )


def test_an_admins_template_replaces_the_shipped_one_and_values_stay_escaped(tmp_path):
    mine, empty = tmp_path / "mine", tmp_path / "empty"
    mine.mkdir()
    empty.mkdir()
    template = mine / FORM_TEMPLATE
    template.write_text(ADMIN_TEMPLATE)
    hostile = dict(ROWS[1], name='<script>alert("x")</script>', users=["alice"])
    projects = project_views([ROWS[0], hostile], "alice", [])

    html = render_form(
        projects=projects,
        gpu_types=[],
        choices=CHOICES,
        queue_total=3,
        notice_html='<div id="sb-notice">ended</div>',
        template_paths=[str(empty), str(mine)],
    )
    assert 'id="my-projects"' in html and 'id="sb-budget"' not in html
    assert '<p id="my-queue">3 requests waiting in the whole queue.</p>' in html
    assert "<script>" not in html
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; — rank 3" in html
    assert '<div id="sb-notice">ended</div>' in html

    # The admin edits the file: the next form shows the edit (no hub restart).
    template.write_text('<p id="edited">{{ projects[0].name }}</p>')
    later = template.stat().st_mtime + 10
    os.utime(template, (later, later))
    edited = render_form(
        projects=projects, gpu_types=[], choices=CHOICES, template_paths=[str(empty), str(mine)]
    )
    assert edited == '<p id="edited">&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;</p>'

    # A directory without the file leaves the shipped template in use.
    shipped = render_form(
        projects=projects, gpu_types=[], choices=CHOICES, template_paths=[str(empty)]
    )
    assert 'id="sb-budget"' in shipped and "<script>alert" not in shipped


# ---- notices --------------------------------------------------------------------------------

SLICE = {
    "id": 12,
    "project": "vision",
    "gpus": 2,
    "state": "preempting",
    "preempt_reason": "fair_share",
    "preempt_deadline": 1_700_000_060.0,
    "end_reason": None,
    "ended_at": None,
    "protected_until": 1_700_000_000.0,
}


@pytest.mark.parametrize(
    ("changes", "title", "words"),
    [
        ({}, "Your GPU session is being preempted", "save your work before then"),
        (
            {"state": "ended", "end_reason": "preempted", "ended_at": 1_700_000_061.0},
            "Your GPU session was preempted",
            "ranks higher in fair share",
        ),
        ({"preempt_reason": "debug_lane"}, "being preempted", "short debugging session"),
        ({"preempt_reason": "unallocated"}, "being preempted", "protected length 0"),
        ({"preempt_reason": "drain"}, "being preempted", "drained for maintenance"),
        (
            {"state": "ended", "preempt_reason": None, "end_reason": "expired", "ended_at": 1.0},
            "Your GPU session ended",
            "maximum runtime",
        ),
        (
            {"state": "ended", "preempt_reason": None, "end_reason": "node_down", "ended_at": 1.0},
            "Your GPU session ended",
            "node went down",
        ),
    ],
)
def test_notices_say_what_happened_when_and_what_to_do(changes, title, words):
    notice = notice_from_slice({**SLICE, **changes})
    text = describe(notice)

    assert title in text["title"]
    assert words in text["text"]
    assert "2 GPUs, project vision" in text["text"]
    assert "UTC" in text["text"]
    assert text["what_to_do"]
    assert "(slice 12)" in text["html"]


@pytest.mark.parametrize(
    ("preemptions", "words"),
    [
        (3, "This is its 3rd preemption of the 5 its budget allows: after 2 more, it comes back "
            "kept to its end."),
        (5, "This is its 5th preemption of the 5 its budget allows: it comes back kept to its "
            "end."),
    ],
)  # fmt: skip
def test_a_session_that_comes_back_is_told_how_much_of_its_preemption_budget_is_left(
    preemptions, words
):
    preempted = {**SLICE, "preemptions": preemptions, "min_runtime": 3600}
    assert describe(notice_from_slice(preempted, budget=5))["text"].endswith(words)
    # Not coming back (no budget passed), free work, a notice stored before the count: silent.
    assert "budget" not in describe(notice_from_slice(preempted))["text"]
    assert (
        "budget"
        not in describe(notice_from_slice({**preempted, "min_runtime": 0}, budget=5))["text"]
    )
    assert "budget" not in describe(notice_from_slice(SLICE))["text"]


def test_only_slices_the_broker_ended_or_preempts_make_notices():
    assert notice_from_slice({**SLICE, "state": "granted"}) is None
    assert notice_from_slice({**SLICE, "state": "pending"}) is None


def test_the_pages_read_notices_from_the_stored_state():
    class OrmSpawner:
        def __init__(self, state):
            self.state = state

    user = type("U", (), {})()
    user.orm_spawners = {
        "": OrmSpawner({"slicebroker": {"notice": notice_from_slice(SLICE)}}),
        "other": OrmSpawner({"pid": 3}),
    }
    found = notices_for(user)
    assert list(found) == [""] and found[""]["title"] == "Your GPU session is being preempted"
    assert notices_for(None) == {}


@pytest.mark.parametrize(
    ("n", "text"),
    [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (22, "22nd"), (113, "113th")],
)
def test_ordinals(n, text):
    assert ordinal(n) == text


def test_the_queue_event_shows_position_value_and_wait():
    now = time.time()
    event = queue_event(
        {
            "gpus": 1,
            "gpu_type": "h100",
            "project": "nlp",
            "queue_position": 2,
            "fairshare_value": 1.2049,  # share used: shown with two decimals
            "estimated_start": now + 1500,
        },
        now,
    )
    assert event["message"] == (
        "Waiting for 1 h100 GPU for project nlp: 2nd in the queue; project at 1.20× its share "
        "(lower goes first); estimated start: in about 25 min."
    )
    assert wait_text(None, now) == "no estimate yet"
    assert wait_text(now + 30, now) == "within a minute"
    assert wait_text(now + 5400, now) == "in about 1.5 h"


#: Two granted slices on node a: protected until 14:05 and 15:00 (UTC, today).
NOON = 1_764_676_800.0  # 2025-12-02 12:00 UTC
HELD = [
    {"placements": [{"node": "a"}], "protected_until": NOON + 2 * 3600 + 300},
    {"placements": [{"node": "a"}], "protected_until": NOON + 3 * 3600},
    {"placements": [{"node": "b"}], "protected_until": NOON + 600},  # b is draining
]


@pytest.mark.parametrize(
    ("request_", "held", "reason"),
    [
        (
            {"gpus": 4, "queue_position": 1},
            HELD,
            "Waiting for 4 GPUs to free up: 5 of 8 GPUs are in use, held under protection "
            "until 14:05:00 UTC.",
        ),
        (
            {"gpus": 1, "gpu_type": "h100", "queue_position": 1},
            [],
            "Waiting for 1 h100 GPU to free up: 5 of 8 h100 GPUs are in use.",
        ),
        (
            {"gpus": 2, "queue_position": 3},
            HELD,
            "2 requests go first (their projects used less of their share, or submitted "
            "earlier); "
            "5 of 8 GPUs are in use.",
        ),
        ({"gpus": 1, "gpu_type": "b200", "queue_position": 1}, HELD, ""),  # its node is down
    ],
)
def test_the_pending_page_says_why_a_request_waits(request_, held, reason, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOON)  # clock_time shows today's times bare
    assert wait_reason(request_, NODES, held, NOON) == reason
    if reason:
        event = queue_event({**request_, "project": "nlp"}, NOON, reason=reason)
        assert event["message"].endswith(f"estimated start: no estimate yet. {reason}")
        assert f'<span id="sb-wait-reason">{reason}</span>' in event["html_message"]


def test_a_project_cap_limits_the_form_and_refuses_larger_requests_before_submitting():
    capped = Choices(max_gpus=4, project_caps={"vision": 2})
    html = render_form(projects=views(), gpu_types=gpu_type_views(NODES), choices=capped)
    assert 'value="vision" data-cap="2"' in html
    assert 'id="sb-gpus-cap"' in html
    with pytest.raises(OptionsError) as raised:
        resolve_request(
            {"project": "vision", "gpus": 4}, projects=views(), gpu_types=[], choices=capped
        )
    assert raised.value.reason == "project_cap"
    assert (
        raised.value.message == "Project vision may hold at most 2 GPUs at a time; you asked for 4."
    )
    allowed = resolve_request(
        {"project": "systems", "gpus": 4}, projects=views(), gpu_types=[], choices=capped
    )
    assert allowed.gpus == 4
    assert "data-cap" not in render_form(projects=views(), gpu_types=[], choices=CHOICES)


@pytest.mark.parametrize(
    ("nodes", "words"),
    [
        (None, "placed on a node in service, or waits in the queue"),
        ([{"name": "a", "state": "draining"}], "No other node takes new sessions now"),
        (
            [{"name": "a", "state": "draining"}, {"name": "b", "state": "ready"}],
            "placed on another node",
        ),
    ],
)
def test_after_a_drain_the_notice_says_whether_another_node_takes_sessions(nodes, words):
    drained = {**SLICE, "preempt_reason": "drain", "placements": [{"node": "a"}]}
    assert words in describe(notice_from_slice(drained, nodes))["what_to_do"]


def test_the_pending_message_explains_a_draining_cluster():
    event = queue_event(
        {"id": 3, "gpus": 1, "project": "vision", "queue_position": 3},
        1_700_000_000.0,
        capacity_note([{**NODES[1], "state_reason": "maintenance"}], 1),
    )
    assert (
        "estimated start: no estimate yet. Out of service: b draining (maintenance)."
        in (event["message"])
    )
    assert "no start can be estimated" in event["message"]
    assert 'id="sb-capacity"' in event["html_message"]


def test_the_pending_message_says_what_would_start_the_request_sooner():
    request_ = {"id": 3, "gpus": 2, "gpu_type": "b200", "project": "vision", "min_runtime": 28800}
    found = {
        "now": NOON,
        "alternatives": [
            {"change": "gpus", "fields": {"gpus": 1}, "starts_at": NOON, "gpu_hours": 8.0},
            {
                "change": "gpu_type",
                "fields": {"gpu_type": "h100"},
                "starts_at": NOON,
                "gpu_hours": 16.0,
            },
            {
                "change": "min_runtime",
                "fields": {"min_runtime": 7200},
                "starts_at": NOON + 300,
                "gpu_hours": 8.0,
            },
        ],
    }
    sooner = sooner_text(found, request_)
    assert sooner == (
        "Start sooner with 1 GPU instead of 2: now (8.00 GPU-h protected) · "
        "h100 instead of b200: now (16.00 GPU-h protected) · "
        "2 h protection instead of 8 h: in about 5 min (8.00 GPU-h protected)."
    )
    event = queue_event(request_, NOON, sooner=sooner)
    assert event["message"].endswith(sooner)
    assert 'id="sb-sooner"' in event["html_message"]
    # nothing sooner: nothing said
    assert sooner_text({"now": NOON, "alternatives": []}, request_) == ""
    # an answer a busy broker gave again (past its what-if budget) says when it is from
    assert sooner_text(found, request_, asked_at=NOON + 30) == sooner
    later = sooner_text(found, request_, asked_at=NOON + 600)
    assert later.startswith(sooner) and later.endswith(
        f"(As the broker worked it out at {clock_time(NOON)}; it may have changed.)"
    )


def test_the_expected_start_line_follows_the_project_chosen_in_the_browser(browser):
    from playwright.sync_api import expect  # only this test of the file needs a browser

    now = time.time()

    def expected(project: str, wait: float) -> dict:
        starts = [{"gpu_type": "h100", "gpus": 1, "starts_at": now + wait}]
        return {"now": now, "project": project, "kind": "interactive", "min_runtime": 900.0,
                "starts": starts}  # fmt: skip

    html = render_form(
        projects=views(),
        gpu_types=[],
        choices=CHOICES,
        expected={"systems": expected("systems", 0.0), "vision": expected("vision", 7200.0)},
    )
    page = browser.new_page()
    page.set_content(html)
    line = page.locator("#sb-expected")
    expect(line).to_have_text("Expected start for systems (15 min protected): h100 — 1 GPU now.")
    page.select_option("#sb-project", "vision")
    expect(line).to_have_text(
        "Expected start for vision (15 min protected): h100 — 1 GPU in about 2.0 h."
    )
    page.close()
