"""Inventory from Kubernetes at scale: ``python -m broker.bench kube`` (issue #6).

The Kubernetes API fake of the tests (``tests/kubefake.py``, so this runs from
a source checkout) serves ``nodes`` GPU nodes over loopback to the real
``kubernetes_asyncio`` client. Figures (JSON, seconds): the first list and
mapping, the first ``Broker.sync_inventory`` into a SQLite broker, a cordon
seen through the watch and synced (event to broker), a relist after 410, a
full scheduling pass on that inventory with one 8-GPU slice per ten nodes
queued, and one :class:`~broker.kube.drain.DrainReporter` round.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

CLUSTER = """\
admins = ["root"]
[defaults.batch]
min_runtime = "1h"
[projects.lab]
[projects.vision]
parent = "lab"
users = ["alice"]
"""


def _fake():
    tests = Path(__file__).resolve().parents[2] / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    import kubefake

    return kubefake


async def _run(nodes: int, directory: str) -> dict[str, Any]:
    from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

    from broker.config import parse_config
    from broker.kube.drain import DrainReporter
    from broker.kube.inventory import InventoryWatcher
    from broker.rounds import Backoff
    from broker.store import Broker, Principal

    kubefake = _fake()
    kube = kubefake.FakeKube()
    for i in range(nodes):
        kube.add_node(kubefake.gpu_node(f"gpu-{i:04d}", 8))
    broker = Broker(f"sqlite:///{directory}/bench.sqlite", parse_config(tomllib.loads(CLUSTER)))
    loop = asyncio.get_running_loop()
    report: dict[str, Any] = {"nodes": nodes, "gpus": nodes * 8}
    synced: asyncio.Queue = asyncio.Queue()
    sync_seconds: list[float] = []

    async def sink(inventory):
        began = time.perf_counter()
        await loop.run_in_executor(None, broker.sync_inventory, inventory)
        sync_seconds.append(time.perf_counter() - began)
        await synced.put(inventory)

    try:
        async with kubefake.serving(kube) as url, ApiClient(Configuration(host=url)) as client:
            api = CoreV1Api(client)
            probe = InventoryWatcher(api, lambda _: None)
            began = time.perf_counter()
            await probe.relist()
            report["list_and_map_s"] = time.perf_counter() - began

            watcher = InventoryWatcher(api, sink, backoff=Backoff(initial=0.01))
            task = asyncio.create_task(watcher.run())
            began = time.perf_counter()
            await synced.get()
            report["first_sync_s"] = time.perf_counter() - began
            report["sync_inventory_s"] = sync_seconds[-1]

            began = time.perf_counter()
            kube.patch("nodes", "gpu-0000", {"spec": {"unschedulable": True}})
            await synced.get()
            report["cordon_to_broker_s"] = time.perf_counter() - began

            began = time.perf_counter()
            kube.compact()
            kube.patch("nodes", "gpu-0001", {"spec": {"unschedulable": True}})
            while True:
                inventory = await synced.get()
                if any(n.name == "gpu-0001" and n.state.value == "draining" for n in inventory):
                    break
            report["relist_after_410_s"] = time.perf_counter() - began

            for _ in range(nodes // 10):
                broker.submit(principal=Principal("alice"), project="vision", gpus=8, kind="batch")
            began = time.perf_counter()
            decisions = broker.run_pass()
            report["full_pass_s"] = time.perf_counter() - began
            report["grants"] = len(decisions.grants)

            reporter = DrainReporter(
                api, lambda: loop.run_in_executor(None, broker.nodes), interval=3600
            )
            began = time.perf_counter()
            await reporter.report_once()
            report["drain_report_round_s"] = time.perf_counter() - began
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        broker.close()
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}


def run(nodes: int = 1000) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        return asyncio.run(_run(nodes, directory))


if __name__ == "__main__":
    import json

    json.dump(run(), sys.stdout, indent=2)
    print()
