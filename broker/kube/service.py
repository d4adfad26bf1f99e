"""The Kubernetes tasks of the broker service: the node inventory, drain reports, pod cleanup.

Run by :class:`~broker.kube.inventory.KubernetesInventory`: with
``watch_nodes``, nodes come from the cluster (watched) and drained nodes are
labelled for repair automation; with a ``pod_namespace``, notebook pods of
ended slices in that namespace are deleted. Broker calls go through the service's runner, so
they share its database thread and wake a pass like any other change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..core.model import Node
from .drain import DrainReporter
from .inventory import InventoryRules, InventoryWatcher
from .reaper import PodReaper

log = logging.getLogger("slicebroker.kube")


async def core_api(api_url: str = "") -> Any:
    """A ``CoreV1Api``: for ``api_url`` as given (tests, a local proxy), else the
    pod's service account in a cluster, else the local kubeconfig."""
    from kubernetes_asyncio import client, config

    if api_url:
        return client.CoreV1Api(client.ApiClient(client.Configuration(host=api_url)))
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    return client.CoreV1Api(client.ApiClient())


class KubernetesTasks:
    """Runs against ``runner``'s broker: the inventory watcher and the drain reporter
    (``inventory``; the reporter only with a ``drained_label``), and the pod reaper
    (with a ``pod_namespace``). Intervals and ages are in seconds."""

    def __init__(
        self,
        runner: Any,
        api: Any,
        *,
        inventory: bool = True,
        node_selector: str = "",
        drained_label: str = "",
        report_interval: float = 30.0,
        rules: InventoryRules | None = None,
        pod_namespace: str = "",
        reap_interval: float = 60.0,
        reap_min_age: float = 120.0,
    ):
        self.runner = runner
        self.api = api
        self.watcher = (
            InventoryWatcher(api, self._sync, rules, label_selector=node_selector)
            if inventory
            else None
        )
        self.reporter = (
            DrainReporter(api, self._broker_nodes, label=drained_label, interval=report_interval)
            if inventory and drained_label
            else None
        )
        self.reaper = (
            PodReaper(
                api,
                pod_namespace,
                self._live_slice_ids,
                min_age=reap_min_age,
                interval=reap_interval,
            )
            if pod_namespace
            else None
        )
        self.tasks: list[asyncio.Task] = []

    async def _sync(self, nodes: list[Node]) -> None:
        await self.runner.run(self.runner.broker.sync_inventory, nodes)
        self.runner.request_pass()  # nodes came, went or changed state
        if self.reporter is not None:
            self.reporter.wake()

    async def _broker_nodes(self) -> list[dict[str, Any]]:
        return await self.runner.read(self.runner.broker.nodes)

    async def _live_slice_ids(self) -> set[int]:
        return await self.runner.read(self.runner.broker.live_slice_ids)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for part in (self.watcher, self.reporter, self.reaper):
            if part is not None:
                self.tasks.append(loop.create_task(part.run()))

    async def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        api_client = getattr(self.api, "api_client", None)
        if api_client is not None:
            await api_client.close()
