"""The broker service with its nodes from Kubernetes: a real broker process
watching the Kubernetes API fake through the real kubernetes-asyncio client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from kubefake import FakeKube, gpu_node, serving
from servicefixtures import make_service

pytest.importorskip("kubernetes_asyncio")


async def until(check: Callable[[], object], timeout: float = 20.0) -> object:
    """Poll ``check`` (run in a thread: it may block) until it answers truthy."""
    deadline = time.monotonic() + timeout
    while True:
        answer = await asyncio.to_thread(check)
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {check.__doc__}")
        await asyncio.sleep(0.05)


async def test_the_service_takes_its_nodes_from_kubernetes_and_marks_drained_ones(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=8))
    kube.add_node(gpu_node("gpu-1", gpus=8))
    async with serving(kube) as url:
        service = make_service(
            tmp_path,
            pass_interval=0.5,
            extra_args=[
                "--BrokerApp.kubernetes_inventory=True",
                f"--BrokerApp.kubernetes_api_url={url}",
                "--BrokerApp.kubernetes_report_interval=0.2",
            ],
        )
        await asyncio.to_thread(service.start)
        try:

            def states() -> dict[str, str]:
                """the broker's node states"""
                nodes = service.get("/nodes", token=service.admin_token).json()["nodes"]
                return {n["name"]: n["state"] for n in nodes}

            def seen() -> bool:
                """the Kubernetes nodes are the broker's, the file's gone"""
                return states() == {"gpu-0": "ready", "gpu-1": "ready", "n0": "down", "n1": "down"}

            await until(seen)
            kube.patch("nodes", "gpu-1", {"spec": {"unschedulable": True}})

            def drained() -> bool:
                """the cordoned, empty node is drained"""
                return states()["gpu-1"] == "drained"

            await until(drained)

            def labelled() -> bool:
                """the drained node carries the label"""
                labels = kube.get("nodes", "gpu-1")["metadata"].get("labels", {})
                return labels.get("slicebroker.io/drained") == "true"

            await until(labelled)
            assert "slicebroker.io/drained" not in kube.get("nodes", "gpu-0")["metadata"].get(
                "labels", {}
            )
        finally:
            await asyncio.to_thread(service.stop)
