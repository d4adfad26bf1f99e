"""In a real browser (headless Chromium over the DevTools protocol), against a real hub:
the options form renders and submits, the pending page shows the queue position, and
a preempted user's page says why. ``SLICEBROKER_SCREENSHOTS=docs/screenshots`` refreshes
the documentation's screenshots.

Skipped where Chromium is not installed (Debian: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hubfixtures import PASSWORD, Browser, HubProcess, find_chromium, proxy_available, wait_until

CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available())),
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is not installed (Debian/Ubuntu: apt-get install -y chromium)",
    ),
]


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where screenshots go: $SLICEBROKER_SCREENSHOTS (``docs/screenshots`` refreshes the
    documentation's), else a temporary directory."""
    where = os.environ.get("SLICEBROKER_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = HubProcess(tmp_path_factory.mktemp("browser-hub"))
    try:
        yield hub.start()
    finally:
        hub.shutdown()


@pytest.fixture
async def browser(tmp_path):
    browser = Browser(CHROMIUM, tmp_path / "profile")
    try:
        yield await browser.start()
    finally:
        browser.close()


async def log_in(browser: Browser, hub: HubProcess, name: str) -> None:
    await browser.goto(f"{hub.url}/hub/login")
    await browser.evaluate(
        f"document.getElementById('username_input').value = {json.dumps(name)};"
        f"document.getElementById('password_input').value = {json.dumps(PASSWORD)};"
        "document.querySelector('form').submit();"
    )
    await browser.wait_for("!location.pathname.endsWith('/hub/login')")


def text(selector: str) -> str:
    return f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent || ''"


async def test_the_options_form_submits_and_the_pending_page_shows_the_queue_position(
    hub, browser, screenshots
):
    hub.start_server("dave", project="systems", gpus=2, protected="15m")  # the cluster is full
    hub.wait_ready("dave")
    await log_in(browser, hub, "alice")

    await browser.goto(f"{hub.url}/hub/spawn")
    await browser.wait_for("document.getElementById('sb-project')")
    fields = await browser.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#spawn_form select')].map("
        "s => [s.name, [...s.options].map(o => o.value)]))"
    )
    assert fields == {
        "project": ["vision"],
        "gpus": ["1", "2"],  # max_gpus: the largest node
        "gpu_type": ["", "h100"],
        "protected": ["2s", "15m", "0s"],
    }
    assert "vision" in await browser.evaluate(text("#sb-budget"))
    assert "Nobody is waiting" in await browser.evaluate(text("#sb-queue-total"))
    await browser.evaluate(
        "document.getElementById('sb-gpus').value = '1';"
        "document.getElementById('sb-protected').value = '15m';"
    )
    await browser.screenshot(screenshots / "spawn-options.png")

    await browser.evaluate("document.getElementById('spawn_form').submit()")
    await browser.wait_for("location.pathname.includes('/hub/spawn-pending/alice')")
    message = await browser.wait_for(
        f"{text('#progress-message')}.includes('in the queue') && {text('#progress-message')}"
    )
    await browser.screenshot(screenshots / "spawn-pending.png")
    assert "1st in the queue" in message
    assert "fair-share value" in message
    assert hub.slice_of("alice")["queue_position"] == 1
    assert hub.server("alice")["user_options"]["protected"] == "15m"

    hub.stop_server("dave")  # GPUs free: the pending page moves on to the server
    await browser.wait_for("location.pathname.startsWith('/user/alice/')")
    assert "stand-in server of alice" in await browser.evaluate("document.body.textContent")
    hub.stop_server("alice")


async def test_a_preempted_user_sees_why_in_the_browser(hub, browser, screenshots):
    # alice and bob (vision) hold the node's 2 GPUs, nlp nothing: bob's GPU for carol
    # leaves both projects at their fair share, a fair-share move; alice's session
    # is still protected.
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")
    hub.start_server("bob", project="vision", gpus=1, protected="2s")
    hub.wait_ready("bob")
    victim = hub.slice_of("bob")
    await log_in(browser, hub, "bob")

    hub.start_server("carol", project="nlp", gpus=1, protected="15m")
    hub.wait_ready("carol")
    wait_until(lambda: hub.server("bob") is None, 30, "bob's server to stop")
    await browser.goto(f"{hub.url}/user/bob/")
    notice = await browser.wait_for(f"{text('#sb-notice')}")
    await browser.screenshot(screenshots / "preempted.png")

    assert "Your GPU session was preempted" in notice
    ended = hub.broker("GET", f"/slices/{victim['id']}")
    # The notice tells when the session stopped, a moment after its grace deadline.
    assert ended["ended_at"] >= ended["preempt_deadline"]
    assert time.strftime("%H:%M:%S UTC", time.gmtime(ended["ended_at"])) in notice
    assert "Start a new session" in notice
    assert await browser.evaluate("!!document.getElementById('start')")  # the Launch button
    hub.stop_server("carol")
    hub.stop_server("alice")


async def test_a_waiter_is_told_that_the_only_node_drains(hub, browser):
    hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})
    try:
        await log_in(browser, hub, "erin")
        await browser.goto(f"{hub.url}/hub/spawn")
        await browser.wait_for("document.getElementById('sb-project')")
        # Nothing runs there: the drain completes at once.
        assert "Out of service: test-0 drained" in await browser.evaluate(text("#sb-capacity"))
        assert "h100 (0 of 2 free now; 2 on draining nodes)" in await browser.evaluate(
            text("#sb-gpu-type")
        )

        await browser.evaluate("document.getElementById('spawn_form').submit()")
        await browser.wait_for("location.pathname.includes('/hub/spawn-pending/erin')")
        message = await browser.wait_for(
            f"{text('#progress-message')}.includes('Out of service') && {text('#progress-message')}"
        )
        assert "No node with GPUs takes new work now" in message
        assert "no start can be estimated" in message
    finally:
        hub.broker("POST", "/nodes/test-0/undrain", json={})
    hub.wait_ready("erin")
    hub.stop_server("erin")
