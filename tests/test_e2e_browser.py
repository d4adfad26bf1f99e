"""In a real browser (Playwright on the system Chromium), against a real hub: the
options form renders and submits, the pending page shows the queue position, and a
preempted user's page says why. ``SLICEBROKER_SCREENSHOTS=docs/screenshots`` refreshes
the documentation's screenshots.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from browsers import hub_login
from hubfixtures import HubProcess, proxy_available, wait_until
from playwright.sync_api import Browser, Page, expect

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubProcess]:
    hub = HubProcess(tmp_path_factory.mktemp("browser-hub"))
    try:
        yield hub.start()
    finally:
        hub.shutdown()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page of its own (a fresh context: no other user's login cookie)."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    try:
        yield context.new_page()
    finally:
        context.close()


def test_the_options_form_submits_and_the_pending_page_shows_the_queue_position(
    hub, page, screenshots
):
    hub.start_server("dave", project="systems", gpus=2, protected="15m")  # the cluster is full
    hub.wait_ready("dave")
    hub_login(page, hub, "alice")

    page.goto(f"{hub.url}/hub/spawn")
    expect(page.locator("#sb-project")).to_be_attached()
    fields = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#spawn_form select')].map("
        "s => [s.name, [...s.options].map(o => o.value)]))"
    )
    assert fields == {
        "project": ["vision"],
        "gpus": ["1", "2"],  # max_gpus: the largest node
        "gpu_type": ["", "h100"],
        "protected": ["2s", "15m", "0s"],
    }
    expect(page.locator("#sb-budget")).to_contain_text("vision")
    expect(page.locator("#sb-queue-total")).to_contain_text("Nobody is waiting")
    # when each size would start, asked of the broker for alice (dave holds the cluster)
    expect(page.locator("#sb-expected")).to_contain_text("Expected start for vision")
    expect(page.locator("#sb-expected")).to_contain_text("h100 — 1 GPU ")
    page.select_option("#sb-gpus", "1")
    page.select_option("#sb-protected", "15m")
    page.screenshot(path=screenshots / "spawn-options.png")

    page.locator("#spawn_form").evaluate("form => form.submit()")
    expect(page).to_have_url(re.compile(r"/hub/spawn-pending/alice"))
    message = page.locator("#progress-message")
    expect(message).to_contain_text("in the queue", timeout=30_000)
    page.screenshot(path=screenshots / "spawn-pending.png")
    expect(message).to_contain_text("1st in the queue")
    expect(message).to_contain_text("× its share")
    # Why it waits: dave's GPUs, protected for 15 minutes.
    reason = message.locator("#sb-wait-reason")
    expect(reason).to_contain_text("Waiting for 1 GPU to free up:", timeout=30_000)
    expect(reason).to_contain_text("held under protection until")
    assert hub.slice_of("alice")["queue_position"] == 1
    assert hub.server("alice")["user_options"]["protected"] == "15m"

    hub.stop_server("dave")  # GPUs free: the pending page moves on to the server
    expect(page).to_have_url(re.compile(r"/user/alice/"), timeout=30_000)
    expect(page.locator("body")).to_contain_text("stand-in server of alice")
    hub.stop_server("alice")


def test_a_preempted_user_sees_why_in_the_browser(hub, page, screenshots):
    # alice and bob (vision) hold the node's 2 GPUs, nlp nothing: bob's GPU for carol
    # leaves both projects at their fair share, a fair-share move; alice's session
    # is still protected.
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")
    hub.start_server("bob", project="vision", gpus=1, protected="2s")
    hub.wait_ready("bob")
    victim = hub.slice_of("bob")
    hub_login(page, hub, "bob")

    hub.start_server("carol", project="nlp", gpus=1, protected="15m")
    hub.wait_ready("carol")
    wait_until(lambda: hub.server("bob") is None, 30, "bob's server to stop")
    page.goto(f"{hub.url}/user/bob/")
    notice = page.locator("#sb-notice")
    expect(notice).to_contain_text("Your GPU session was preempted", timeout=30_000)
    page.screenshot(path=screenshots / "preempted.png")

    ended = hub.broker("GET", f"/slices/{victim['id']}")
    # The notice tells when the session stopped, a moment after its grace deadline.
    assert ended["ended_at"] >= ended["preempt_deadline"]
    expect(notice).to_contain_text(time.strftime("%H:%M:%S UTC", time.gmtime(ended["ended_at"])))
    expect(notice).to_contain_text("Start a new session")
    expect(page.locator("#start")).to_be_attached()  # the Launch button
    hub.stop_server("carol")
    hub.stop_server("alice")


def test_a_waiter_is_told_that_the_only_node_drains(hub, page):
    hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})
    try:
        hub_login(page, hub, "erin")
        page.goto(f"{hub.url}/hub/spawn")
        expect(page.locator("#sb-project")).to_be_attached()
        # Nothing runs there: the drain completes at once.
        expect(page.locator("#sb-capacity")).to_contain_text("Out of service: test-0 drained")
        expect(page.locator("#sb-gpu-type")).to_contain_text(
            "h100 (0 of 2 free now; 2 on draining nodes)"
        )

        page.locator("#spawn_form").evaluate("form => form.submit()")
        expect(page).to_have_url(re.compile(r"/hub/spawn-pending/erin"))
        message = page.locator("#progress-message")
        expect(message).to_contain_text("Out of service", timeout=30_000)
        expect(message).to_contain_text("No node with GPUs takes new work now")
        expect(message).to_contain_text("no start can be estimated")
    finally:
        hub.broker("POST", "/nodes/test-0/undrain", json={})
    hub.wait_ready("erin")
    hub.stop_server("erin")
