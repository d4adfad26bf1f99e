"""Inventories behind one interface: the entry points, the classes' own options, and each
backend filling a real broker's nodes (nvidia-smi through a stand-in program, Kubernetes
through the API fake)."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import time
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from kubefake import FakeKube, gpu_node, serving
from servicefixtures import TEST_CONFIG, make_service, service_env
from traitlets.config import Config

from broker.config import parse_config
from broker.inventory import (
    ENTRY_POINT_GROUP,
    Inventory,
    InventoryError,
    LocalInventory,
    StaticInventory,
)
from broker.kube.inventory import KubernetesInventory
from broker.service.runner import BrokerRunner
from broker.slurm.inventory import SlurmInventory
from broker.store import Broker

pytest.importorskip("kubernetes_asyncio")


def test_the_entry_points_name_the_four_backends():
    found = {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert found == {
        "static": StaticInventory,
        "nvidia-smi": LocalInventory,
        "kubernetes": KubernetesInventory,
        "slurm": SlurmInventory,
    }
    assert all(issubclass(cls, Inventory) for cls in found.values())


def test_kubernetes_options_are_the_inventorys_own_and_checked():
    inventory = KubernetesInventory()
    assert (inventory.watch_nodes, inventory.api_url, inventory.pod_namespace) == (True, "", "")
    assert (inventory.report_interval, inventory.reap_interval) == (30.0, 60.0)
    assert inventory.drained_label == "slicebroker.io/drained"
    config = Config()
    config.KubernetesInventory.pod_namespace = "jhub-2"
    config.KubernetesInventory.node_selector = "nvidia.com/gpu.present=true"
    config.KubernetesInventory.reap_min_age = 0.0
    configured = KubernetesInventory(config=config)
    assert configured.pod_namespace == "jhub-2"
    assert configured.node_selector == "nvidia.com/gpu.present=true"
    assert configured.reap_min_age == 0.0
    for bad, message in [
        ({"pod_namespace": "JHub"}, "namespace name"),
        ({"pod_namespace": "jhub-"}, "namespace name"),
        ({"pod_namespace": "j" * 64}, "namespace name"),
        ({"reap_interval": 0}, "must be > 0"),
        ({"report_interval": -1}, "must be > 0"),
        ({"reap_min_age": -1}, "must be >= 0"),
    ]:
        with pytest.raises(Exception, match=message):
            KubernetesInventory(**bad)


def fake_nvidia_smi(directory: Path, answer: str, status: int = 0) -> Path:
    """A program answering like ``nvidia-smi --query-gpu=...`` on a machine with ``answer``."""
    program = directory / "nvidia-smi"
    program.write_text(f"#!/bin/sh\ncat <<'EOF'\n{answer}EOF\nexit {status}\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program


def broker_nodes(broker: Broker) -> dict[str, tuple[str, int, str]]:
    return {n["name"]: (n["gpu_type"], n["gpu_count"], n["state"]) for n in broker.nodes()}


async def with_runner(tmp_path: Path, inventory: Inventory, check) -> None:
    """Set ``inventory`` up on a real broker's runner, start it, run ``check(broker)``, stop."""
    broker = Broker(
        f"sqlite:///{tmp_path / 'broker.sqlite'}", parse_config(tomllib.loads(TEST_CONFIG))
    )
    runner = BrokerRunner(broker, pass_interval=0.5)
    try:
        await inventory.setup(runner)
        inventory.start()
        runner.start()
        await check(runner)
    finally:
        await inventory.stop()
        await runner.stop()


async def test_the_local_inventory_makes_this_machines_gpus_the_nodes(tmp_path):
    program = fake_nvidia_smi(
        tmp_path,
        "0, NVIDIA H100 80GB HBM3, 81559 MiB\n"
        "1, NVIDIA H100 80GB HBM3, 81559 MiB\n"
        "2, NVIDIA A100-SXM4-40GB, 40960 MiB\n",
    )
    inventory = LocalInventory(nvidia_smi=str(program), host="box")

    async def check(runner: BrokerRunner) -> None:
        nodes = await runner.read(broker_nodes, runner.broker)
        assert nodes == {
            "box-h100": ("h100", 2, "ready"),
            "box-a100": ("a100", 1, "ready"),
            "n0": ("h100", 4, "down"),  # the file's own nodes
            "n1": ("h100", 4, "down"),
        }

    await with_runner(tmp_path, inventory, check)
    assert inventory.describe() == f"nodes from {program} (box-h100: 2 x h100, box-a100: 1 x a100)"


@pytest.mark.parametrize(
    ("answer", "status", "message"),
    [
        ("", 0, "no GPU found"),
        ("", 9, "no GPU found"),  # driver not loaded
        ("no devices were found\n", 0, "not 'index, name, memory'"),
    ],
)
async def test_the_local_inventory_refuses_to_start_without_gpus(tmp_path, answer, status, message):
    inventory = LocalInventory(nvidia_smi=str(fake_nvidia_smi(tmp_path, answer, status)))

    async def never(_runner: BrokerRunner) -> None:
        raise AssertionError("set up without a GPU")

    with pytest.raises(InventoryError, match=message):
        await with_runner(tmp_path, inventory, never)


async def test_the_kubernetes_inventory_fills_the_broker_from_the_api(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=4))
    async with serving(kube) as url:
        config = Config()
        config.KubernetesInventory.api_url = url
        config.KubernetesInventory.drained_label = ""
        inventory = KubernetesInventory(config=config)

        async def check(runner: BrokerRunner) -> None:
            deadline = time.monotonic() + 20
            while (await runner.read(broker_nodes, runner.broker)).get("gpu-0") != (
                "h100",
                4,
                "ready",
            ):
                assert time.monotonic() < deadline, "the Kubernetes node never came"
                await asyncio.sleep(0.05)
            assert inventory.tasks is not None and inventory.tasks.reporter is None

        await with_runner(tmp_path, inventory, check)
    assert inventory.describe() == "nodes from Kubernetes (selector '')"


async def test_the_kubernetes_inventory_can_leave_the_nodes_to_the_file(tmp_path):
    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=4))
    async with serving(kube) as url:
        inventory = KubernetesInventory(api_url=url, watch_nodes=False, pod_namespace="jhub")

        async def check(runner: BrokerRunner) -> None:
            assert inventory.tasks is not None
            assert inventory.tasks.watcher is None and inventory.tasks.reaper is not None
            nodes = await runner.read(broker_nodes, runner.broker)
            assert nodes == {"n0": ("h100", 4, "ready"), "n1": ("h100", 4, "ready")}

        await with_runner(tmp_path, inventory, check)
    assert inventory.describe() == (
        "nodes from the cluster file; deleting pods of ended slices in namespace jhub every 60 s"
    )


def test_the_service_takes_this_machines_gpus_by_the_inventorys_name(tmp_path):
    program = fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 81559 MiB\n" * 2)
    service = make_service(
        tmp_path,
        extra_args=[
            "--BrokerApp.inventory_class=nvidia-smi",
            f"--LocalInventory.nvidia_smi={program}",
            "--LocalInventory.host=box",
        ],
    )
    service.start()
    try:
        nodes = service.get("/nodes", token=service.admin_token).json()["nodes"]
    finally:
        service.stop()
    assert {n["name"]: (n["gpu_count"], n["state"]) for n in nodes} == {
        "box": (2, "ready"),
        "n0": (4, "down"),
        "n1": (4, "down"),
    }
    assert f"nodes from {program} (box: 2 x h100)" in service.log_text()


def test_a_service_whose_inventory_cannot_run_stops_with_one_line(tmp_path):
    program = fake_nvidia_smi(tmp_path, "", status=9)
    config = tmp_path / "cluster.toml"
    config.write_text(TEST_CONFIG)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "broker.service",
            f"--config-file={config}",
            f"--db-url=sqlite:///{tmp_path / 'broker.sqlite'}",
            "--port=0",
            "--BrokerApp.inventory_class=nvidia-smi",
            f"--LocalInventory.nvidia_smi={program}",
        ],
        capture_output=True,
        text=True,
        env=service_env(),
        timeout=60,
    )
    assert run.returncode == 2
    assert f"inventory: no GPU found with {program}" in run.stderr
    assert "Traceback" not in run.stderr
