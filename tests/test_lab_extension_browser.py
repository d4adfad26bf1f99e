"""The Lab extension in a real browser (Playwright on the system Chromium), in a real hub
session (``jupyterhub-singleuser`` with JupyterLab): the status bar shows the slice, and
an admin's drain brings the countdown dialog with its Save-all button.

``SLICEBROKER_SCREENSHOTS=docs/screenshots`` refreshes the documentation's screenshots.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from browsers import hub_login
from gpustandin import StandinGpus
from hubfixtures import TEST_CLUSTER, HubProcess, proxy_available, wait_until
from labfixtures import JupyterServer, session_environment
from playwright.sync_api import expect
from servicefixtures import BUDGET_OF_ONE_CONFIG, kept_to_its_end, running_service

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))

#: A grace period long enough to read the countdown.
CLUSTER = TEST_CLUSTER.replace('grace_period = "2s"', 'grace_period = "3m"')
#: Real Lab sessions, protected for 60 s (then a drain preempts them).
LAB_SESSIONS = """
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.SliceBrokerMixin.protected_choices = ["60s", "15m", "0"]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubProcess]:
    hub = HubProcess(
        tmp_path_factory.mktemp("lab-ext-hub"), cluster=CLUSTER, extra_config=LAB_SESSIONS
    )
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def test_the_status_bar_shows_the_slice_and_a_drain_brings_the_countdown(hub, browser, screenshots):
    hub.start_server("alice", project="vision", gpus=1, protected="60s")
    hub.wait_ready("alice", timeout=90)
    slice_ = hub.slice_of("alice")
    assert slice_ is not None and slice_["state"] == "granted"

    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    hub_login(page, hub, "alice")
    page.goto(f"{hub.url}/user/alice/lab")

    status = page.locator(".sb-status")
    expect(status).to_have_text(
        # under a minute of protection left: minutes and seconds, never rounded up
        re.compile(r"^GPU ×1 · vision · protected 0:[0-5]\d · \d+\.\d\d GPU-h$"),
        timeout=90_000,
    )
    expect(page.locator(".jp-Launcher")).to_be_visible(timeout=60_000)
    page.screenshot(path=str(screenshots / "lab-status-bar.png"))

    # The details: the slice's terms and a link to the broker's pages.
    status.click()
    details = page.locator(".jp-Dialog")
    expect(details).to_contain_text("GPU session details")
    expect(details).to_contain_text("test-0")
    link = details.get_by_role("link", name=re.compile("GPU broker"))
    expect(link).to_have_attribute("href", "/services/slicebroker/")
    page.screenshot(path=str(screenshots / "lab-session-details.png"))
    details.get_by_role("button", name="Close").click()
    expect(details).to_have_count(0)

    # An admin drains the node: past its 60 s the slice is preempted, with a 3 min grace.
    hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_contain_text("Your GPU session is stopping", timeout=90_000)
    expect(dialog).to_contain_text("an admin is draining the node")
    countdown = dialog.locator(".sb-countdown")
    expect(countdown).to_have_text(re.compile(r"^Time left: [0-3]:\d\d$"))
    first = countdown.text_content()
    expect(countdown).not_to_have_text(first, timeout=5_000)  # it counts down live
    expect(status).to_have_text(re.compile(r"stops in [0-3]:\d\d"))
    page.screenshot(path=str(screenshots / "lab-preemption-dialog.png"))
    assert hub.slice_of("alice")["state"] == "preempting"

    dialog.get_by_role("button", name="Save all").click()
    expect(dialog).to_have_count(0)
    hub.stop_server("alice")


def test_an_idle_warning_comes_with_the_hub_s_limit_and_a_countdown(tmp_path, browser, screenshots):
    # The hub's default limits (15 min idle while someone waits, past protection); a
    # warning lead longer than that, so that the warning is due at once. The session's
    # GPUs, a stand-in's, hold memory and do nothing.
    gpus = StandinGpus(tmp_path / "gpus", count=2)
    gpus.set(0, memory_used=20_000)
    config = LAB_SESSIONS + "".join(
        f'c.Spawner.args.append("--SliceBrokerLab.{option}")\n'
        for option in (
            "cull_warning=3600",
            f"nvidia_smi={gpus.program}",
            "gpu_sample_interval=0.5",
            "use_nvml=False",
        )
    )
    hub = HubProcess(tmp_path / "hub", cluster=CLUSTER, extra_config=config)
    try:
        hub.start()
        hub.start_server("alice", project="vision", gpus=1, protected="0")
        hub.wait_ready("alice", timeout=90)
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        hub_login(page, hub, "alice")
        page.goto(f"{hub.url}/user/alice/lab")

        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text("Your GPU session may stop as idle", timeout=90_000)
        expect(dialog).to_contain_text("once it has been idle for 15 min")
        expect(dialog.locator(".sb-countdown")).to_have_text(
            re.compile(r"^Time left: 1[0-5]:\d\d$")
        )
        expect(page.locator(".sb-status")).to_have_text(
            re.compile(r"^GPU ×1 · vision · not protected · \d+\.\d\d GPU-h$")
        )
        expect(page.locator(".sb-gpu-use")).to_have_text("GPU 0%")
        page.screenshot(path=str(screenshots / "lab-idle-warning.png"))
        dialog.get_by_role("button", name="Keep my session").click()
        expect(dialog).to_have_count(0)
        wait_until(
            lambda: "the user kept the session after" in hub.log_text(), 30, "the keep's log line"
        )

        # Work on the GPUs shows in the status bar, and is activity.
        gpus.set(70, memory_used=20_000)
        expect(page.locator(".sb-gpu-use")).to_have_text("GPU 70%", timeout=30_000)
    finally:
        hub.shutdown()


def test_when_the_grace_period_is_over_lab_says_the_session_ended(tmp_path, browser, screenshots):
    # A short grace period: the session is gone soon after the drain.
    cluster = TEST_CLUSTER.replace('grace_period = "2s"', 'grace_period = "20s"')
    hub = HubProcess(tmp_path / "hub", cluster=cluster, extra_config=LAB_SESSIONS)
    try:
        hub.start()
        hub.start_server("alice", project="vision", gpus=1, protected="0")
        hub.wait_ready("alice", timeout=90)
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        hub_login(page, hub, "alice")
        page.goto(f"{hub.url}/user/alice/lab")
        status = page.locator(".sb-status")
        expect(status).to_contain_text("not protected", timeout=90_000)

        hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text("Your GPU session is stopping", timeout=30_000)
        # The countdown gives way to what happened, with the cost and the way on.
        expect(dialog).to_contain_text("GPU session ended", timeout=60_000)
        expect(dialog).to_have_count(1)
        expect(dialog).to_contain_text("its grace period after a preemption is over")
        expect(dialog).to_contain_text(re.compile(r"It cost \d+\.\d\d GPU-h"))
        expect(dialog.get_by_role("link", name="My GPUs")).to_have_attribute(
            "href", "/services/slicebroker/"
        )
        expect(status).to_have_text(
            re.compile(r"^GPU ×1 · vision · ended \(preempted\) · \d+\.\d\d GPU-h$")
        )
        page.screenshot(path=str(screenshots / "lab-session-ended.png"))
        assert hub.slice_of("alice") is None  # the broker ended it: nothing live is left
    finally:
        hub.shutdown()


#: A notebook that computes its variable only when no preemption kept it.
KEEPING = (
    "%load_ext slicebroker_lab\n"
    "if 'answer' not in dir():\n"
    "    answer = 41 + 1\n"
    "    print('computed')\n"
    "%slicebroker_keep answer"
)
NOTEBOOK = {
    "type": "notebook",
    "content": {
        "cells": [{"cell_type": "code", "source": KEEPING, "metadata": {}, "outputs": []}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    },
}


def run_all_cells(page) -> None:
    """Run → Run All Cells, as a person does it, once the notebook's kernel is idle."""
    expect(page.locator(".jp-StatusBar-Widget")).to_contain_text(["| Idle"], timeout=60_000)
    page.locator(".lm-MenuBar-itemLabel").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu-itemLabel").get_by_text("Run All Cells", exact=True).click()


def test_a_session_that_comes_back_saves_its_notebooks_and_says_when_it_is_restored(
    tmp_path, browser, screenshots
):
    cluster = TEST_CLUSTER.replace('grace_period = "2s"', 'grace_period = "20s"')
    # A home of this test's own: the session's files and Lab workspace (its open tabs)
    # are what comes back, so nothing of another run may be there.
    home = f'c.SimpleLocalProcessSpawner.home_dir_template = "{tmp_path}/{{username}}"\n'
    hub = HubProcess(tmp_path / "hub", cluster=cluster, extra_config=LAB_SESSIONS + home)
    try:
        hub.start()
        hub.start_server("frank", project="systems", gpus=1, protected="0", restore=True)
        hub.wait_ready("frank", timeout=90)
        first = hub.slice_of("frank")
        name = "work.ipynb"
        contents = f"{hub.url}/user/frank/api/contents/{name}"
        assert hub.http.put(contents, json=NOTEBOOK, timeout=10).status_code == 201
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        hub_login(page, hub, "frank")
        page.goto(f"{hub.url}/user/frank/lab/tree/{name}")
        expect(page.locator(".sb-status")).to_contain_text("not protected", timeout=90_000)
        notebook = page.locator(".jp-Notebook:visible")
        output = notebook.locator(".jp-OutputArea-output")
        run_all_cells(page)  # run, not saved: its outputs are only in the browser
        expect(output.first).to_contain_text("computed", timeout=60_000)
        expect(output.last).to_contain_text("kept across a preemption: answer")

        # A drain takes the GPUs back: the notebook and the kept variable are saved at
        # once, and Lab says the session comes back.
        hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})
        dialog = page.locator(".jp-Dialog")
        expect(dialog).to_contain_text("were saved", timeout=30_000)
        expect(dialog).to_contain_text("comes back by itself")
        page.screenshot(path=str(screenshots / "lab-restore-countdown.png"))
        saved = wait_until(
            lambda: "kept across a preemption" in str(hub.http.get(contents, timeout=10).json()),
            30,
            "the notebook with its outputs to be saved",
        )
        assert saved
        # When the grace is over, Lab's own "Server unavailable" dialog may come first
        # (the hub answers for the stopped server): ours follows it.
        ended = page.locator(".jp-Dialog", has_text="GPU session ended")
        lost = page.locator(".jp-Dialog", has_text="Server unavailable")
        expect(ended.or_(lost).first).to_be_visible(timeout=60_000)
        if lost.count():
            lost.get_by_role("button", name="Dismiss").click()
        expect(ended).to_contain_text("It comes back by itself", timeout=30_000)

        # The hub asks again at once; the request waits while the node is drained.
        back = wait_until(
            lambda: hub.slices(user="frank", state="pending"), 60, "frank's session to queue"
        )[-1]
        assert back["submitted_at"] == first["submitted_at"]
        hub.broker("POST", "/nodes/test-0/undrain")
        hub.wait_ready("frank", timeout=90)

        # Back on the same files, and Lab says what happened.
        page.goto(f"{hub.url}/user/frank/lab/tree/{name}")
        restored = page.locator(".jp-Dialog")
        expect(restored).to_contain_text("GPU session brought back", timeout=90_000)
        expect(restored).to_contain_text("after a preemption at")
        expect(restored).to_contain_text(f"(slice {first['id']})")
        expect(restored).to_contain_text("the kernels restarted")
        expect(notebook).to_contain_text("kept across a preemption: answer")  # saved output
        expect(restored).to_contain_text(f"The last cell you ran was cell 1 of {name}.")
        page.screenshot(path=str(screenshots / "lab-session-restored.png"))
        restored.get_by_role("button", name="Go to the last cell run").click()
        expect(restored).to_have_count(0)
        expect(notebook.locator(".jp-Cell.jp-mod-active")).to_contain_text("%slicebroker_keep")
        # The new kernel loads the kept variable back instead of computing it.
        run_all_cells(page)
        expect(output.first).to_contain_text("restored answer", timeout=60_000)
        expect(notebook.locator(".jp-OutputArea").first).not_to_contain_text("computed")
    finally:
        hub.shutdown()


def test_a_session_past_its_preemption_budget_reads_kept_to_its_end(tmp_path, browser):
    # A Jupyter server with Lab and the session's environment, on a broker with a budget of
    # one: the slice, preempted once by a drain and granted again, is kept to its end.
    with running_service(tmp_path / "broker", config=BUDGET_OF_ONE_CONFIG) as service:
        token = service.token("alice")
        slice_ = kept_to_its_end(service, token)
        server = JupyterServer(tmp_path, session_environment(service, token, slice_["id"]))
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            page.goto(f"{server.url}/lab?token={server.token}")
            status = page.locator(".sb-status")
            expect(status).to_have_text(
                re.compile(r"^GPU ×4 · vision · kept to its end · \d+\.\d\d GPU-h$"),
                timeout=90_000,
            )
            status.click()
            details = page.locator(".jp-Dialog")
            expect(details.get_by_role("row", name=re.compile("Protected until"))).to_have_text(
                "Protected untilkept to its end: preempted 1 time, its budget; only a drain or "
                "a node going down ends it early"
            )
        finally:
            server.stop()
