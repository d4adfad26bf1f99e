"""A job preempted as many times as its budget allows is kept to its end (design.md §5.7,
rule 5), and says so wherever its protection shows: the API's limits, the pages, the
command line, the batch runner, the hub's pages. A real broker with a budget of one
preempts a job once (a drain) and grants it again."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import requests
from clihelpers import run_cli
from hypothesis import given
from hypothesis import strategies as st
from servicefixtures import BUDGET_OF_ONE_CONFIG, BrokerService, kept_to_its_end, running_service

from broker.batch import _describe_grant
from broker.budget import kept_to_end, preemptions_left
from broker.core.candidates import past_budget
from broker.core.model import Contract, Policy, Slice, SliceKind
from spawner import notices


@given(
    min_runtime=st.sampled_from([0.0, 60.0, 3600.0]),
    preemptions=st.integers(0, 8),
    budget=st.none() | st.integers(1, 6),
)
def test_a_client_tells_a_slice_kept_to_its_end_exactly_as_the_pass_does(
    min_runtime, preemptions, budget
):
    held = Slice(
        1, "vision", "alice", 1, SliceKind.BATCH, Contract(min_runtime), preemptions=preemptions
    )
    view = {"state": "granted", "min_runtime": min_runtime, "preemptions": preemptions}
    policy = Policy(preemption_budget=budget)
    assert kept_to_end(view, budget) == past_budget(held, policy)
    left = preemptions_left(view, budget)
    # Free work, and any slice where the policy sets no budget, has no limit.
    assert (left is None) == (budget is None or min_runtime == 0)
    assert left is None or left == max(budget - preemptions, 0)
    # A slice being preempted already (a drain) is not shown as kept.
    assert not kept_to_end({**view, "state": "preempting"}, budget)


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Iterator[tuple[BrokerService, dict]]:
    """A broker with a budget of one and alice's slice kept to its end on it."""
    directory = tmp_path_factory.mktemp("kept")
    with running_service(directory, config=BUDGET_OF_ONE_CONFIG, pass_interval=0.5) as service:
        yield service, kept_to_its_end(service, service.token("alice"))


def log_in(service: BrokerService, token: str) -> requests.Session:
    """A browser's session on the pages, logged in through the form."""
    session = requests.Session()
    session.get(service.url + "login", timeout=10).raise_for_status()
    data = {"_xsrf": session.cookies["_xsrf"], "token": token, "next": ""}
    session.post(service.url + "login", data=data, timeout=10).raise_for_status()
    return session


def test_the_limits_state_the_budget(kept):
    service, _ = kept
    limits = service.get("/limits", token=service.token("bob")).json()
    assert limits["preemption_budget"] == 1


def test_the_metrics_count_the_gpus_kept_to_their_end(kept):
    service, _ = kept
    text = service.get("/metrics", token=service.admin_token).text
    assert re.search(r"^slicebroker_gpus_kept_to_end 4\.0$", text, re.M), text


def test_the_pages_show_its_gpus_kept_and_its_row_kept_to_its_end(kept):
    service, slice_ = kept
    alice = log_in(service, service.token("alice"))
    node = slice_["placements"][0]["node"]
    cluster = alice.get(service.url + "cluster", timeout=10).text
    cells = re.findall(r'<li class="gpu (\w+)" title="GPU \d: vision, alice', cluster)
    assert cells == ["kept"] * 4, cluster
    assert f"{node}<br><small>h100, 4/4 held" in cluster
    mine = alice.get(service.url + "gpus", timeout=10).text
    assert "Kept to its end: preempted 1 time, its budget; only a drain or a node" in mine
    assert "to its end</td>" in mine

    # Another user's request waits behind it, and is told why.
    bob = service.token("bob")
    body = {"project": "vision", "gpus": 4, "kind": "batch", "min_runtime": "1h"}
    waiting = service.post("/slices", token=bob, json=body).json()
    try:
        page = log_in(service, bob).get(service.url + "gpus", timeout=10).text
        assert (
            "(4 of 4 in use, 4 of them by work kept to its end, preempted as many times as its "
            "budget allows)."
        ) in page
    finally:
        service.delete(f"/slices/{waiting['id']}", token=bob)


def test_the_command_line_says_to_its_end_and_how_often_it_was_preempted(kept, capsys, monkeypatch):
    service, slice_ = kept
    monkeypatch.setenv("SLICEBROKER_URL", service.url)
    monkeypatch.setenv("SLICEBROKER_TOKEN", service.token("alice"))
    status, out, err = run_cli(capsys, "slices")
    assert status == 0, err
    header, line = out.splitlines()
    cells = re.split(r"\s{2,}", line.strip())
    names = re.split(r"\s{2,}", header.strip())
    row = dict(zip(names, cells, strict=True))
    assert row["SLICE"] == str(slice_["id"])
    assert (row["PROTECTED UNTIL"], row["PREEMPTED"]) == ("to its end", "1 of 1")


def test_the_batch_runner_and_the_hub_say_it_is_kept_to_its_end(kept):
    _, slice_ = kept
    words = "kept to its end: preempted 1 time, its budget"
    assert words in _describe_grant(slice_, 1)
    assert "protected until" not in _describe_grant(slice_, 1)
    assert "protected until" in _describe_grant(slice_, None)  # no budget: as before
    assert words in notices.grant_event(slice_, 1)["message"]
    line = notices.session_line(slice_, time.time(), 1)
    assert line is not None and words in line and "may be preempted" not in line
    node = {"name": slice_["placements"][0]["node"], "state": "ready", "gpu_count": 4}
    waiting = {"gpus": 2, "queue_position": 1}
    reason = notices.wait_reason(waiting, [{**node, "gpus_held": 4}], [slice_], time.time(), 1)
    assert reason.endswith("4 of 4 GPUs are in use; 4 of them by work kept to its end, "
                           "preempted as many times as its budget allows.")  # fmt: skip
