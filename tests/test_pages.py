"""The web pages in a real browser (Playwright on the system Chromium) against a real broker
service, standalone (token login form) and as a hub service (the hub's OAuth login).

``SLICEBROKER_SCREENSHOTS=docs/screenshots`` refreshes the documentation's screenshots.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import requests
from browsers import hub_login
from hubfixtures import HubProcess, wait_until
from playwright.sync_api import Browser, Page, expect
from servicefixtures import BrokerService, running_service

HOSTILE = "<script>window.pwned=1</script>\"x='1'=2"


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[BrokerService]:
    with running_service(tmp_path_factory.mktemp("pages"), pass_interval=1) as service:
        yield service


def new_page(browser: Browser) -> Page:
    page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    return page


def log_in(page: Page, service: BrokerService, token: str, path: str = "gpus") -> None:
    page.goto(service.url + path)
    expect(page).to_have_url(re.compile(r"/login\?next="))
    page.get_by_label("Token").fill(token)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(service.url + path)


def submit(service: BrokerService, token: str, project: str, gpus: int, kind="batch") -> dict:
    reply = service.post(
        "/slices", token=token, json={"project": project, "gpus": gpus, "kind": kind}
    )
    assert reply.status_code == 201, reply.text
    return reply.json()


def page_post(page: Page, path: str, body: dict, xsrf: bool = True) -> dict:
    """POST from the page's own origin and cookies, as its script does; status and JSON."""
    return page.evaluate(
        """async ([path, body, xsrf]) => {
            const headers = {"Content-Type": "application/json"};
            if (xsrf) headers["X-XSRFToken"] = document.body.dataset.xsrf;
            const r = await fetch(document.body.dataset.base + path,
                {method: "POST", headers, body: JSON.stringify(body)});
            return {status: r.status, json: await r.json()};
        }""",
        [path, body, xsrf],
    )


def test_a_researcher_sees_only_their_own_slices_live_and_may_release_them(
    service, browser, screenshots
):
    alice, carol = service.token("alice"), service.token("carol")
    held = submit(service, alice, "vision", 4)
    theirs = submit(service, carol, "nlp", 4)
    page = new_page(browser)
    log_in(page, service, alice)

    row = page.locator(f"#slice-{held['id']}")
    expect(row).to_contain_text("vision")
    expect(row).to_contain_text("GPU-h")
    expect(page.locator(f"#slice-{theirs['id']}")).to_have_count(0)
    expect(row.locator(".countdown")).to_contain_text("left")  # protected-until, counting

    # A new request shows up without a reload, with its queue position and why it waits.
    waiting = submit(service, alice, "vision", 4)
    pending = page.locator(f"#slice-{waiting['id']}")
    expect(pending).to_contain_text("pending", timeout=15_000)
    expect(page.locator(f"#slice-{waiting['id']} + tr.why")).to_contain_text("GPUs")
    page.screenshot(path=screenshots / "web-my-gpus.png", full_page=True)

    page.goto(service.url + "queue")
    queue = page.locator("#queue")
    expect(queue).to_contain_text("alice")
    expect(queue.locator("th", has_text="Estimated start")).to_have_count(1)
    expect(queue.locator("tr.mine td").last).to_have_text(re.compile(r"^(\d|no estimate yet)"))
    expect(page.locator("#head-why")).to_contain_text("Why the head of the queue waits")
    assert "carol" not in page.locator("main").inner_text()
    page.screenshot(path=screenshots / "web-queue.png", full_page=True)

    page.goto(service.url + "gpus")
    page.locator(f"#release-{waiting['id']}").click()  # Cancel (the dialog is accepted)
    expect(page.locator("#flash")).to_contain_text(f"Slice {waiting['id']} cancelled")
    expect(page.locator(f"#slice-{waiting['id']}")).to_have_count(0)
    assert service.get(f"/slices/{waiting['id']}", token=alice).json()["state"] == "ended"
    # Someone else's slice cannot be released from the pages either.
    refused = page_post(page, f"ui/slices/{theirs['id']}/release", {})
    assert refused["status"] == 404
    assert service.get(f"/slices/{theirs['id']}", token=carol).json()["state"] == "granted"
    for slice_ in (held, theirs):
        service.delete(f"/slices/{slice_['id']}", token=service.admin_token)


def test_a_waiting_request_is_replaced_by_a_sooner_alternative_in_one_click(
    tmp_path, browser, screenshots
):
    with running_service(tmp_path, pass_interval=1) as service:
        alice, carol = service.token("alice"), service.token("carol")
        for gpus in (4, 3):  # alice holds 7 of the 8 GPUs under 8 h of protection
            held = service.post(
                "/slices",
                token=alice,
                json={"project": "vision", "gpus": gpus, "kind": "batch", "min_runtime": "8h"},
            )
            assert held.status_code == 201, held.text
        waiting = submit(service, alice, "vision", 2)
        page = new_page(browser)
        log_in(page, service, alice)

        sooner = page.locator(f"#sooner-{waiting['id']}")
        take = sooner.get_by_role("button", name=re.compile(r"^1 GPU instead of 2: now"))
        expect(take).to_contain_text("GPU-h protected")
        page.screenshot(path=screenshots / "web-sooner.png", full_page=True)

        # Terms the request may not have, or another user's slice: refused, nothing lost.
        bad = page_post(page, f"ui/slices/{waiting['id']}/replace", {"gpus": 0})
        assert bad["status"] == 400 and bad["json"]["error"]["message"], bad
        carols = new_page(browser)
        log_in(carols, service, carol)
        body = {"project": "vision", "gpus": 1, "kind": "batch"}
        theirs = page_post(carols, f"ui/slices/{waiting['id']}/replace", body)
        assert theirs["status"] == 404, theirs
        assert service.get(f"/slices/{waiting['id']}", token=alice).json()["state"] == "pending"

        take.click()
        expect(page.locator("#flash")).to_contain_text(f"Slice {waiting['id']} withdrawn")
        old = service.get(f"/slices/{waiting['id']}", token=alice).json()
        assert (old["state"], old["end_reason"]) == ("ended", "cancelled")
        new = old["replaced_by"]
        expect(page.locator(f"#slice-{new}")).to_contain_text("granted")
        assert service.get(f"/slices/{new}", token=alice).json()["gpus"] == 1


def test_a_non_admin_gets_no_admin_action_neither_button_nor_post(service, browser):
    page = new_page(browser)
    log_in(page, service, service.token("bob"), "cluster")
    expect(page.locator("#nodes")).to_contain_text("n0")
    expect(page.locator("#node-form")).to_have_count(0)
    assert page.get_by_role("button", name="Drain", exact=True).count() == 0
    refused = page_post(page, "ui/nodes/n0/drain", {"reason": "mine"})
    assert refused["status"] == 403, refused
    assert "only admins" in refused["json"]["error"]["message"]
    page.goto(service.url + "projects")
    expect(page.locator("#projects")).to_contain_text("vision")
    expect(page.locator("#project-form")).to_have_count(0)
    assert page_post(page, "ui/projects/vision", {"share": 5})["status"] == 403
    nodes = service.get("/nodes", token=service.admin_token).json()["nodes"]
    assert {n["name"]: n["state"] for n in nodes}["n0"] == "ready"


def test_admin_posts_need_the_xsrf_token(service, browser, screenshots):
    page = new_page(browser)
    log_in(page, service, service.admin_token, "cluster")
    refused = page_post(page, "ui/nodes/n1/drain", {"reason": "disk"}, xsrf=False)
    assert refused["status"] == 403 and refused["json"]["error"]["code"] == "xsrf", refused
    assert service.get("/nodes", token=service.admin_token).json()["nodes"][1]["state"] == "ready"

    page.get_by_label("Node").fill("n1")
    page.get_by_label("Reason").fill("disk replacement")
    form = page.locator("#node-form")
    form.get_by_role("button", name="Drain", exact=True).click()
    expect(page.locator("#flash")).to_contain_text("Node n1 is")
    expect(page.locator("#nodes")).to_contain_text("drained")  # nothing ran there
    page.screenshot(path=screenshots / "web-cluster.png", full_page=True)
    form.get_by_role("button", name="Undrain").click()
    expect(page.locator("#flash")).to_contain_text("Node n1 is ready")

    # Each node has its own buttons, each asking first (the test's page accepts).
    # Names are exact: "Drain" alone would also match the Undrain button the row shows
    # until the refresh after the undrain above replaces it.
    row = page.locator("#nodes tbody tr").filter(has=page.locator("th", has_text="n1"))
    row.get_by_role("button", name="Drain", exact=True).click()
    expect(row).to_contain_text("drained")
    row.get_by_role("button", name="Undrain", exact=True).click()
    expect(row.get_by_role("button", name="Drain", exact=True)).to_be_visible()
    states = {
        n["name"]: n["state"]
        for n in service.get("/nodes", token=service.admin_token).json()["nodes"]
    }
    assert states["n1"] == "ready"

    # The same validation as the API: a share of 0 is refused, with the API's words.
    page.goto(service.url + "projects")
    bad = page_post(page, "ui/projects/vision", {"share": 0})
    assert bad["status"] == 400 and "share" in bad["json"]["error"]["message"], bad
    page.get_by_label("Name").fill("vision")
    page.get_by_label("Share").fill("3")
    page.get_by_label("Parent").fill("lab")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#flash")).to_contain_text("Project vision saved")
    shares = {
        p["name"]: p["share"]
        for p in service.get("/projects", token=service.admin_token).json()["projects"]
    }
    assert shares["vision"] == 3
    events = service.get(
        "/projects/events", token=service.admin_token, params={"project": "vision"}
    ).json()["events"]
    assert (events[-1]["action"], events[-1]["who"]) == ("set", "root")  # the page's admin

    # Parent left blank keeps the account where it is; the top level is asked for by name.
    def parent_of(name: str) -> str | None:
        rows = service.get("/projects", token=service.admin_token).json()["projects"]
        return next(p["parent"] for p in rows if p["name"] == name)

    def share_of_vision(share: float) -> bool:
        rows = service.get("/projects", token=service.admin_token).json()["projects"]
        return next(p["share"] for p in rows if p["name"] == "vision") == share

    def save() -> None:
        # Each save asks first (entitlements move); the page's dialogs are answered
        # while Playwright waits on the page, so the wait is for the page's own word.
        page.evaluate("document.getElementById('flash').textContent = ''")
        page.get_by_role("button", name="Save").click()
        expect(page.locator("#flash")).to_contain_text("Project vision saved")

    page.get_by_label("Parent").fill("")
    page.get_by_label("Share").fill("4")
    save()
    wait_until(lambda: share_of_vision(4), 30, "the second save")
    assert parent_of("vision") == "lab"
    both = page_post(page, "ui/projects/vision", {"share": 4, "parent": "lab", "top_level": True})
    assert both["status"] == 400 and "not both" in both["json"]["error"]["message"], both
    page.get_by_label("Move to the top level").check()
    page.get_by_label("Share").fill("5")
    save()
    wait_until(lambda: share_of_vision(5), 30, "the move to the top")
    assert parent_of("vision") is None
    page.get_by_label("Move to the top level").uncheck()
    page.get_by_label("Parent").fill("lab")
    page.get_by_label("Share").fill("3")
    save()
    wait_until(lambda: share_of_vision(3) and parent_of("vision") == "lab", 30, "vision back")
    expect(page.locator("svg.chart").first).to_be_visible()
    page.screenshot(path=screenshots / "web-projects.png", full_page=True)


def test_a_change_to_the_tree_says_whose_entitlements_move_and_asks_first(service, browser):
    asked: list[str] = []
    answer = {"accept": False}
    page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()

    def on_dialog(dialog) -> None:
        asked.append(dialog.message)
        dialog.accept() if answer["accept"] else dialog.dismiss()

    page.on("dialog", on_dialog)
    log_in(page, service, service.admin_token, "projects")

    def accounts() -> dict[str, dict]:
        rows = service.get("/projects", token=service.admin_token).json()["projects"]
        return {p["name"]: p for p in rows}

    before = accounts()
    page.get_by_label("Name").fill("scratch")
    page.get_by_label("Share").fill("1")
    page.get_by_label("Parent").fill("lab")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#flash")).to_contain_text("Not applied: nothing changed.")
    (question,) = asked
    title, *moves, last = question.splitlines()
    assert (title, last) == ("This changes entitlements:", "Apply?")
    assert moves[0].startswith("scratch: — → ") and len(moves) >= 2, moves  # and a sibling's
    assert accounts().keys() == before.keys()  # dismissed: nothing written

    answer["accept"] = True
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#flash")).to_contain_text("Project scratch saved")
    assert accounts()["scratch"]["parent"] == "lab"
    # a change that moves no entitlement (its members) asks nothing
    page.get_by_label("Users").fill("alice")
    page.evaluate("document.getElementById('flash').textContent = ''")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#flash")).to_contain_text("Project scratch saved")
    wait_until(lambda: accounts()["scratch"]["users"] == ["alice"], 30, "the members")
    assert len(asked) == 2
    assert service.delete("/projects/scratch", token=service.admin_token).status_code in (200, 204)


def test_names_with_markup_quotes_and_equals_render_inert(service, browser, screenshots):
    admin = service.admin_token
    reply = service.put(
        "/projects/evil", token=admin, json={"share": 1, "parent": "lab", "users": [HOSTILE]}
    )
    assert reply.status_code == 200, reply.text
    held = submit(service, service.token(HOSTILE), "evil", 1)
    page = new_page(browser)
    log_in(page, service, admin, "cluster")
    for path, where in (("cluster", "#nodes"), ("projects", "#projects"), ("usage", "#usage")):
        page.goto(service.url + path)
        expect(page.locator(where)).to_contain_text(HOSTILE)
        assert page.evaluate("window.pwned") is None
    csv = page.evaluate("fetch(document.getElementById('csv').href).then(r => r.text())")
    assert '"=2' not in csv and HOSTILE.replace('"', '""') in csv
    page.screenshot(path=screenshots / "web-usage.png", full_page=True)
    service.delete(f"/slices/{held['id']}", token=admin)


def test_the_login_form_refuses_a_bad_token_and_goes_nowhere_else(service, browser):
    page = new_page(browser)
    page.goto(service.url + "login?next=https://evil.example/")
    page.get_by_label("Token").fill("sb_1_nope")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator(".problem")).to_contain_text("not valid")
    page.get_by_label("Token").fill(service.token("alice"))
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(service.url + "gpus")
    assert requests.get(service.url + "ui/fragment/gpus", timeout=10).status_code == 401


def test_a_refused_fragment_answers_the_apis_error_shape_and_logs_no_traceback(service):
    long_name = "x" * 5000
    reply = requests.get(
        service.url + f"ui/fragment/{long_name}",
        headers={"Authorization": f"token {service.token('alice')}"},
        timeout=10,
    )
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "not_found"
    assert len(error["message"]) < 1200  # the name is not echoed whole
    anonymous = requests.get(service.url + "ui/fragment/gpus", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    log = service.log_text()
    assert "Traceback" not in log and "Uncaught exception" not in log


# ---- as a hub service ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubProcess]:
    hub = HubProcess(tmp_path_factory.mktemp("pages-hub"))
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def test_the_hub_logs_people_in_and_lists_the_pages(hub, browser, screenshots):
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice")
    mine = hub.slice_of("alice")
    page = new_page(browser)
    hub_login(page, hub, "alice")
    page.goto(f"{hub.url}/hub/home")
    # the Services menu names the pages as they name themselves
    menu = page.locator(".dropdown-menu a[href$='/services/slicebroker/']")
    expect(menu).to_have_text("GPU broker")
    page.goto(f"{hub.url}/services/slicebroker/")  # OAuth: to the hub and back, no question
    expect(page).to_have_url(f"{hub.url}/services/slicebroker/gpus")
    expect(page.locator(".who")).to_contain_text("alice")
    expect(page.locator(f"#slice-{mine['id']}")).to_contain_text("granted")
    page.goto(f"{hub.url}/services/slicebroker/cluster")
    expect(page.locator("#node-form")).to_have_count(0)
    assert page_post(page, "ui/nodes/test-0/drain", {})["status"] == 403

    admin = new_page(browser)
    hub_login(admin, hub, "admin")
    admin.goto(f"{hub.url}/services/slicebroker/cluster")
    expect(admin.locator(".who")).to_contain_text("admin")
    expect(admin.locator("#node-form")).to_be_visible()
    assert page_post(admin, "ui/nodes/test-0/drain", {}, xsrf=False)["status"] == 403
    drained = page_post(admin, "ui/nodes/test-0/drain", {"reason": "test"})
    assert drained["status"] == 200, drained
    wait_until(lambda: hub.broker("GET", "/nodes")["nodes"][0]["state"] != "ready", 10, "drain")
    assert page_post(admin, "ui/nodes/test-0/undrain", {})["status"] == 200
    hub.stop_server("alice")
