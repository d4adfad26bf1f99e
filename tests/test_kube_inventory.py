"""Inventory from Kubernetes: the node mapping (tables), the watch against the API fake
(real kubernetes-asyncio over real HTTP, with faults), and drains reported on the node."""

from __future__ import annotations

import asyncio
import contextlib
import tomllib

import pytest
from kubefake import FakeKube, gpu_node, serving
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api

from broker.config import parse_config
from broker.core.model import Node, NodeState
from broker.kube.drain import DRAINED_LABEL, DrainReporter, drained_nodes
from broker.kube.inventory import (
    Backoff,
    InventoryRules,
    InventoryWatcher,
    gpu_resource,
    kube_node_name,
    nodes_from_kube,
)
from broker.store import Broker, Principal

READY, DRAINING, DOWN = NodeState.READY, NodeState.DRAINING, NodeState.DOWN
NO_SCHEDULE = {"key": "repair", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

MAPPING_CASES = [
    ("a ready H100 node is ready with its GPU count", gpu_node("g", 8), [("g", "h100", 8, READY)]),
    ("a node without GPUs is no broker node", gpu_node("c", 0), []),
    ("a cordoned node drains", gpu_node("g", 4, unschedulable=True), [("g", "h100", 4, DRAINING)]),
    (
        "a NoSchedule taint drains",
        gpu_node("g", 4, taints=[NO_SCHEDULE]),
        [("g", "h100", 4, DRAINING)],
    ),
    (
        "a NoExecute taint drains",
        gpu_node("g", 4, taints=[{"key": "x", "effect": "NoExecute"}]),
        [("g", "h100", 4, DRAINING)],
    ),
    (
        "a PreferNoSchedule taint does not drain",
        gpu_node("g", 4, taints=[{"key": "x", "effect": "PreferNoSchedule"}]),
        [("g", "h100", 4, READY)],
    ),
    (
        "the GPU operator's own taint does not drain",
        gpu_node("g", 4, taints=[GPU_TAINT]),
        [("g", "h100", 4, READY)],
    ),
    ("a NotReady node is down", gpu_node("g", 4, ready=False), [("g", "h100", 4, DOWN)]),
    (
        "NotReady wins over cordoned",
        gpu_node("g", 4, ready=False, unschedulable=True),
        [("g", "h100", 4, DOWN)],
    ),
    (
        "a B200 product label gives b200",
        gpu_node("g", 8, product="NVIDIA-B200"),
        [("g", "b200", 8, READY)],
    ),
    (
        "MIG profiles are GPU types of their own",
        gpu_node("g", 0, mig={"1g.10gb": 7}),
        [("g:1g.10gb", "h100-1g.10gb", 7, READY)],
    ),
    (
        "mixed MIG and whole GPUs give one broker node each",
        gpu_node("g", 4, mig={"3g.40gb": 2, "1g.10gb": 0}),
        [("g", "h100", 4, READY), ("g:3g.40gb", "h100-3g.40gb", 2, READY)],
    ),
    (
        "the single MIG strategy's product label names the profile",
        gpu_node("g", 7, product="NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
        [("g", "a100-1g.5gb", 7, READY)],
    ),
]


@pytest.mark.parametrize(
    ("obj", "expected"), [c[1:] for c in MAPPING_CASES], ids=[c[0] for c in MAPPING_CASES]
)
def test_node_mapping(obj, expected):
    assert [tuple(n.__getattribute__(f) for f in ("name", "gpu_type", "gpu_count", "state"))
            for n in nodes_from_kube(obj)] == expected  # fmt: skip


def test_rules_map_products_and_missing_labels():
    rules = InventoryRules(gpu_types={"NVIDIA-H100-80GB-HBM3": "h100-sxm"}, default_gpu_type="x")
    assert nodes_from_kube(gpu_node("g", 2), rules)[0].gpu_type == "h100-sxm"
    bare = gpu_node("g", 2)
    bare["metadata"]["labels"] = {}
    assert nodes_from_kube(bare, rules)[0].gpu_type == "x"


def test_broker_node_names_map_back_to_kubernetes():
    assert kube_node_name("g:1g.10gb") == "g" and kube_node_name("g") == "g"
    assert gpu_resource("g:1g.10gb") == "nvidia.com/mig-1g.10gb"
    assert gpu_resource("g") == "nvidia.com/gpu"


def test_drained_needs_every_part_drained():
    nodes = [
        {"name": "g", "state": "drained", "state_changed_at": 5.0},
        {"name": "g:1g.10gb", "state": "draining", "state_changed_at": 4.0},
        {"name": "h", "state": "drained", "state_changed_at": 3.0},
    ]
    assert drained_nodes(nodes) == {"g": None, "h": 3.0}


# ---- the watch against the fake API -------------------------------------------------


@contextlib.asynccontextmanager
async def kube_api(kube: FakeKube):
    async with serving(kube) as url, ApiClient(Configuration(host=url)) as client:
        yield CoreV1Api(client)


class Pushes:
    """A sink that records each inventory pushed, for tests to wait on."""

    def __init__(self):
        self.queue: asyncio.Queue[list[Node]] = asyncio.Queue()
        self.fail = 0

    async def __call__(self, nodes):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the broker is away")
        await self.queue.put(nodes)

    async def until(self, predicate, timeout=10.0):
        async with asyncio.timeout(timeout):
            while True:
                nodes = await self.queue.get()
                if predicate({n.name: n for n in nodes}):
                    return nodes


@contextlib.asynccontextmanager
async def watching(kube, **kwargs):
    async with kube_api(kube) as api:
        pushes = Pushes()
        kwargs.setdefault("backoff", Backoff(initial=0.01, maximum=0.05))
        kwargs.setdefault("request_timeout", 2.0)
        watcher = InventoryWatcher(api, pushes, **kwargs)
        task = asyncio.create_task(watcher.run())
        try:
            yield watcher, pushes
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_watch_lists_then_follows_changes():
    kube = FakeKube()
    kube.add_node(gpu_node("g0", 8))
    async with watching(kube) as (watcher, pushes):
        await pushes.until(lambda n: n["g0"].state is READY)
        kube.add_node(gpu_node("g1", 4))
        await pushes.until(lambda n: "g1" in n)
        kube.patch("nodes", "g0", {"spec": {"unschedulable": True}})
        await pushes.until(lambda n: n["g0"].state is DRAINING)
        kube.delete("nodes", "g1")
        await pushes.until(lambda n: "g1" not in n)
        assert watcher.lists == 1 and watcher.errors == 0


async def test_watch_survives_410_gone_by_listing_again():
    kube = FakeKube()
    kube.add_node(gpu_node("g0", 8))
    async with watching(kube) as (watcher, pushes):
        await pushes.until(lambda n: "g0" in n)
        kube.compact()  # the watch is cut; resuming from its version gets 410
        kube.add_node(gpu_node("g1", 8))
        kube.compact()
        await pushes.until(lambda n: "g1" in n)
        assert watcher.lists >= 2


async def test_watch_survives_500s_dropped_streams_and_timeouts():
    kube = FakeKube()
    kube.add_node(gpu_node("g0", 8))
    kube.fail("GET", r"/nodes\?(?!.*watch)", 500, count=2)  # the first lists fail
    async with watching(kube, watch_timeout=1, request_timeout=0.5) as (watcher, pushes):
        await pushes.until(lambda n: "g0" in n)
        assert watcher.errors == 2
        kube.fail("GET", r"watch=", None)  # the next watch hangs: the client times out
        kube.drop_watches()
        kube.add_node(gpu_node("g1", 2, ready=False))
        await pushes.until(lambda n: n.get("g1") and n["g1"].state is DOWN)
        kube.patch("nodes", "g1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        await pushes.until(lambda n: n["g1"].state is READY)


async def test_a_failing_sink_is_retried_until_the_inventory_lands():
    kube = FakeKube()
    kube.add_node(gpu_node("g0", 8))
    async with watching(kube) as (watcher, pushes):
        pushes.fail = 2
        nodes = await pushes.until(lambda n: "g0" in n)
        assert [n.name for n in nodes] == ["g0"] and watcher.errors == 2


# ---- a cordoned node drains and is reported, no human step ---------------------------

CLUSTER = """\
admins = ["root"]
[policy]
grace_period = "60s"
[defaults.interactive]
min_runtime = "1h"
[gpu_types]
h100 = 1.0
[projects.lab]
[projects.vision]
parent = "lab"
users = ["alice"]
"""


async def test_cordoned_node_drains_as_contracts_end_and_is_marked(tmp_path):
    now = [1_000_000.0]
    broker = Broker(
        f"sqlite:///{tmp_path}/b.sqlite",
        parse_config(tomllib.loads(CLUSTER)),
        clock=lambda: now[0],
        lease=7200.0,
    )
    kube = FakeKube()
    kube.add_node(gpu_node("g0", 2))
    kube.add_node(gpu_node("g1", 2))
    loop = asyncio.get_running_loop()

    async def broker_nodes():
        return await loop.run_in_executor(None, broker.nodes)

    def state(name):
        return next(n["state"] for n in broker.nodes() if n["name"] == name)

    try:
        async with kube_api(kube) as api:
            pushes = Pushes()

            async def sink(nodes):
                await loop.run_in_executor(None, broker.sync_inventory, nodes)
                await pushes(nodes)

            watcher = InventoryWatcher(api, sink, backoff=Backoff(initial=0.01))
            task = asyncio.create_task(watcher.run())
            await pushes.until(lambda n: "g1" in n)
            s = broker.submit(
                principal=Principal("alice"), project="vision", gpus=2, kind="interactive"
            )
            broker.run_pass()
            held = broker.get_slice(s["id"])["placements"][0]["node"]
            other = "g1" if held == "g0" else "g0"
            s2 = broker.submit(
                principal=Principal("alice"), project="vision", gpus=2, kind="interactive"
            )
            broker.run_pass()

            kube.patch("nodes", held, {"spec": {"unschedulable": True}})  # kubectl cordon
            await pushes.until(lambda n: n[held].state is DRAINING)
            assert state(held) == "draining"
            broker.run_pass()
            assert broker.get_slice(s["id"])["state"] == "granted"  # protected
            now[0] += 3600.0  # the contract's protected hour ends
            broker.run_pass()
            assert broker.get_slice(s["id"])["state"] == "preempting"
            now[0] += 61.0  # the grace period ends
            broker.run_pass()
            broker.run_pass()
            assert broker.get_slice(s["id"])["state"] == "ended"
            assert state(held) == "drained"
            assert broker.get_slice(s2["id"])["placements"][0]["node"] == other

            reporter = DrainReporter(api, broker_nodes)
            assert await reporter.report_once() == [held]
            labels = kube.get("nodes", held)["metadata"]["labels"]
            assert labels[DRAINED_LABEL] == "true"
            assert "slicebroker.io/drained-at" in kube.get("nodes", held)["metadata"]["annotations"]
            assert await reporter.report_once() == []  # nothing to repeat
            # The node stays drained while still cordoned (a relist included).
            kube.compact()
            await pushes.until(lambda n: held in n)
            assert state(held) == "drained"
            # Repaired and uncordoned: back in service, the mark goes.
            kube.patch("nodes", held, {"spec": {"unschedulable": None}})
            await pushes.until(lambda n: n[held].state is READY)
            kube.fail("PATCH", "/nodes/", 500)
            assert await reporter.report_once() == []  # a failed patch: retried next round
            assert await reporter.report_once() == [held]
            assert DRAINED_LABEL not in kube.get("nodes", held)["metadata"]["labels"]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        broker.close()
