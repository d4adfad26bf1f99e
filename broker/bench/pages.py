"""``python -m broker.bench pages``: the web pages' time to first paint and bytes per update.

A broker service (a real ``python -m broker.service`` process on SQLite) holds
``--slices`` live slices (most granted, the rest waiting) on ``--nodes`` nodes of
8 GPUs. Headless Chromium (Playwright, the system's Chromium) logs in as an
admin, who sees the most, and loads each page ``--repeat`` times; the figure is
the browser's first contentful paint, counted from the start of the navigation
(what a click on the menu costs), median and worst. The reference is a trivial
static page served by the same server. Bytes per update are the size of one
refresh of a page's data (its fragment), and of a refresh when nothing changed
(a 304 without a body).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from ..config import parse_config
from ..service.auth import create_token
from ..store import Broker
from ..store.access import Principal

CHROMIUM = "/usr/bin/chromium"
PAGES = ("gpus", "queue", "projects", "cluster", "usage")
PROJECTS = ("vision", "nlp", "speech", "robotics", "systems", "theory")


def cluster_toml(nodes: int) -> str:
    lines = ['admins = ["root"]', "[gpu_types]", "h100 = 1.0"]
    for i in range(nodes):
        lines += ["[[nodes]]", f'name = "node-{i:03d}"', 'gpu_type = "h100"', "gpus = 8"]
    lines.append("[projects.lab]")
    for project in PROJECTS:
        users = ", ".join(f'"{project}-{u}"' for u in range(20))
        lines += [f"[projects.{project}]", 'parent = "lab"', f"users = [{users}]"]
    return "\n".join(lines) + "\n"


def fill(db_url: str, toml: str, slices: int) -> None:
    """``slices`` live slices: one in ten asks for 8 GPUs, the rest for 1."""
    import tomllib

    broker = Broker(db_url, parse_config(tomllib.loads(toml)))
    try:
        for i in range(slices):
            project = PROJECTS[i % len(PROJECTS)]
            broker.submit(
                principal=Principal(f"{project}-{i % 20}", admin=True),
                project=project,
                gpus=8 if i % 10 == 0 else 1,
                kind="batch" if i % 3 else "interactive",
            )
        broker.run_pass()
    finally:
        broker.close()


def serve(directory: Path, db_url: str, config: Path, port: int) -> subprocess.Popen:
    log = open(directory / "service.log", "ab")  # noqa: SIM115 - the child holds it
    process = subprocess.Popen(
        [sys.executable, "-m", "broker.service", f"--config-file={config}",
         f"--db-url={db_url}", f"--port={port}", "--lease=3600"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/api/v1/", timeout=2).ok:
                return process
        except requests.RequestException:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the broker service did not start")


def first_paint(page: Any, url: str, repeat: int) -> dict[str, float]:
    """Median and worst first contentful paint of ``url``, in ms from navigation start."""
    times = []
    for _ in range(repeat + 1):
        page.goto(url, wait_until="load")
        paint = page.evaluate(
            """() => new Promise(done => {
                const find = () => performance.getEntriesByName("first-contentful-paint")[0];
                const check = () => find() ? done(find().startTime) : setTimeout(check, 10);
                check();
            })"""
        )
        times.append(paint)
    times = times[1:]  # the first load warms the connection and the caches
    return {"median_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1)}


def run(slices: int = 1000, nodes: int = 128, repeat: int = 10) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        config = directory / "cluster.toml"
        config.write_text(cluster_toml(nodes))
        db_url = f"sqlite:///{directory / 'broker.sqlite'}"
        started = time.perf_counter()
        fill(db_url, config.read_text(), slices)
        fill_s = time.perf_counter() - started
        token = create_token(db_url, "root", admin=True)
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        process = serve(directory, db_url, config, port)
        base = f"http://127.0.0.1:{port}/"
        try:
            live = requests.get(
                base + "api/v1/slices", params={"state": "live"},
                headers={"Authorization": f"token {token}"}, timeout=30,
            ).json()["slices"]  # fmt: skip
            report: dict[str, Any] = {
                "slices_live": len(live),
                "slices_pending": sum(s["state"] == "pending" for s in live),
                "nodes": nodes,
                "gpus": nodes * 8,
                "fill_s": round(fill_s, 1),
                "repeat": repeat,
            }
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, args=["--no-sandbox", "--headless", "--disable-gpu"]
                )
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                page.goto(base + "login")
                page.fill("#token", token)
                page.click("button[type=submit]")
                page.wait_for_url(base + "gpus")
                paint = {"static reference": first_paint(page, base + "static/blank.html", repeat)}
                for name in PAGES:
                    paint[name] = first_paint(page, base + name, repeat)
                browser.close()
            report["first_contentful_paint"] = paint
            report["bytes_per_update"] = update_bytes(base, token)
        finally:
            process.terminate()
            process.wait(10)
    return report


def update_bytes(base: str, token: str) -> dict[str, dict[str, int]]:
    """One refresh of each page's data: body bytes when it changed, and when it did not."""
    headers = {"Authorization": f"token {token}"}
    found = {}
    for name in PAGES:
        fresh = requests.get(f"{base}ui/fragment/{name}", headers=headers, timeout=30)
        again = requests.get(
            f"{base}ui/fragment/{name}",
            headers={**headers, "If-None-Match": fresh.headers.get("Etag", "")},
            timeout=30,
        )
        found[name] = {
            "changed": len(fresh.content),
            "unchanged": len(again.content),
            "unchanged_status": again.status_code,
        }
    return found
