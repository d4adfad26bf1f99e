"""Browser helpers shared by the Playwright tests (the ``browser`` fixture is in conftest)."""

from __future__ import annotations

import re

from hubfixtures import PASSWORD, HubProcess
from playwright.sync_api import Page, expect


def hub_login(page: Page, hub: HubProcess, name: str) -> None:
    """Log ``name`` in through the hub's login form (the test hub's dummy password)."""
    page.goto(f"{hub.url}/hub/login")
    page.locator("#username_input").fill(name)
    page.locator("#password_input").fill(PASSWORD)
    page.locator("#login_submit").click()
    expect(page).not_to_have_url(re.compile(r"/hub/login"))
