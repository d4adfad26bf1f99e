"""The broker service with its nodes from Kubernetes: a real broker process
watching the Kubernetes API fake through the real kubernetes-asyncio client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubefake import FakeKube, gpu_node, serving
from servicefixtures import BrokerService, make_service, serving_in_process

from broker.kube.reaper import SLICE_LABEL
from broker.kube.service import KubernetesTasks, core_api
from broker.store import Principal

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


def kube_service(directory: Path, api_url: str, *options: str) -> BrokerService:
    """A broker service (not started) taking its nodes from the API fake at ``api_url``."""
    return make_service(
        directory,
        pass_interval=0.5,
        extra_args=[
            "--BrokerApp.inventory_class=kubernetes",
            f"--KubernetesInventory.api_url={api_url}",
            *options,
        ],
    )


def node_states(service: BrokerService) -> dict[str, tuple[str, str | None]]:
    """The broker's nodes as ``{name: (state, drained_by)}``."""
    nodes = service.get("/nodes", token=service.admin_token).json()["nodes"]
    return {n["name"]: (n["state"], n["drained_by"]) for n in nodes}


async def test_the_service_takes_its_nodes_from_kubernetes_and_marks_drained_ones(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=8))
    kube.add_node(gpu_node("gpu-1", gpus=8))
    async with serving(kube) as url:
        service = kube_service(tmp_path, url, "--KubernetesInventory.report_interval=0.2")
        try:
            await asyncio.to_thread(service.start)  # stopped below even if it never answers

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


async def test_an_admins_drain_outlives_cordons_and_uncordons(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=8))
    kube.add_node(gpu_node("gpu-1", gpus=8))
    async with serving(kube) as url:
        service = kube_service(tmp_path, url)
        try:
            await asyncio.to_thread(service.start)

            def seen() -> bool:
                """both Kubernetes nodes are ready in the broker"""
                states = node_states(service)
                return states.get("gpu-0") == states.get("gpu-1") == ("ready", None)

            await until(seen)
            drained = await asyncio.to_thread(
                service.post, "/nodes/gpu-0/drain", token=service.admin_token
            )
            assert drained.status_code == 200, drained.text
            for unschedulable in (True, False):
                # gpu-1 changes with gpu-0: once the broker shows gpu-1's change, it has
                # taken in the inventory that shows gpu-0 cordoned, then uncordoned.
                kube.patch("nodes", "gpu-0", {"spec": {"unschedulable": unschedulable}})
                kube.patch("nodes", "gpu-1", {"spec": {"unschedulable": unschedulable}})
                gpu_1 = ("drained", "inventory") if unschedulable else ("ready", None)

                def synced() -> bool:
                    """the broker took in gpu-1's change"""
                    return node_states(service)["gpu-1"] == gpu_1  # noqa: B023

                await until(synced)
                assert node_states(service)["gpu-0"] == ("drained", "admin")
            undrained = await asyncio.to_thread(
                service.post, "/nodes/gpu-0/undrain", token=service.admin_token
            )
            assert undrained.json()["state"] == "ready"
        finally:
            await asyncio.to_thread(service.stop)


def notebook_pod(name: str, slice_id: int, created: str | None = None) -> dict[str, Any]:
    """A pod as the spawner makes it, labelled with its slice; ``created`` (RFC 3339)
    stands for its age (the fake stamps it now when left out)."""
    metadata: dict[str, Any] = {"name": name, "labels": {SLICE_LABEL: str(slice_id)}}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {"metadata": metadata, "spec": {"containers": [{"name": "notebook"}]}}


async def test_the_service_deletes_pods_of_ended_slices_and_keeps_live_ones(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=8))
    async with serving(kube) as url:
        service = kube_service(
            tmp_path,
            url,
            "--KubernetesInventory.pod_namespace=jhub",
            "--KubernetesInventory.reap_interval=0.2",
            "--KubernetesInventory.reap_min_age=600",
        )
        try:
            await asyncio.to_thread(service.start)
            alice = service.token("alice")

            def ready() -> bool:
                """the Kubernetes node is ready in the broker"""
                return node_states(service).get("gpu-0") == ("ready", None)

            await until(ready)

            def submit() -> int:
                request = {"project": "vision", "gpus": 1, "kind": "interactive"}
                reply = service.post("/slices", token=alice, json=request)
                assert reply.status_code == 201, reply.text
                return reply.json()["id"]

            live = await asyncio.to_thread(submit)
            ended = await asyncio.to_thread(submit)

            def granted() -> bool:
                """both slices are granted"""
                slices = service.get("/slices", token=alice).json()["slices"]
                return [s["state"] for s in slices] == ["granted", "granted"]

            await until(granted)
            released = await asyncio.to_thread(service.delete, f"/slices/{ended}", token=alice)
            assert released.json()["state"] == "ended"

            an_hour_ago = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
            kube.create("pods", notebook_pod("jupyter-live", live, an_hour_ago), "jhub")
            kube.create("pods", notebook_pod("jupyter-new", ended), "jhub")  # under min_age
            kube.create("pods", notebook_pod("jupyter-elsewhere", ended, an_hour_ago), "other")
            # Created last: a round that sees it has seen the others too.
            kube.create("pods", notebook_pod("jupyter-ended", ended, an_hour_ago), "jhub")

            def reaped() -> bool:
                """the pod of the ended slice is deleted"""
                return all(p["metadata"]["name"] != "jupyter-ended" for p in kube.pods("jhub"))

            await until(reaped)
            assert [p["metadata"]["name"] for p in kube.pods("jhub")] == [
                "jupyter-live",
                "jupyter-new",
            ]
            assert [p["metadata"]["name"] for p in kube.pods("other")] == ["jupyter-elsewhere"]
        finally:
            await asyncio.to_thread(service.stop)


async def test_pods_are_reaped_without_the_inventory_and_the_files_nodes_stay(tmp_path):
    kube = FakeKube()
    async with (
        serving(kube) as url,
        serving_in_process(f"sqlite:///{tmp_path}/b.sqlite") as api,
    ):
        made = api.broker.submit(
            principal=Principal("alice"), project="vision", gpus=1, kind="interactive"
        )
        api.broker.release(made["id"])
        tasks = KubernetesTasks(
            api.runner,
            await core_api(url),
            inventory=False,
            pod_namespace="jhub",
            reap_interval=0.05,
            reap_min_age=0,
        )
        assert (tasks.watcher, tasks.reporter) == (None, None)
        tasks.start()
        try:
            kube.create("pods", notebook_pod("jupyter-ended", made["id"]), "jhub")

            def reaped() -> bool:
                """the pod of the ended slice is deleted"""
                return not kube.pods("jhub")

            await until(reaped)
        finally:
            await tasks.stop()
        assert [(n["name"], n["state"]) for n in api.broker.nodes()] == [
            ("n0", "ready"),
            ("n1", "ready"),
        ]
        assert not any(path.startswith("/api/v1/nodes") for _, path in kube.requests)
