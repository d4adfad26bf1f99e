"""Tell repair automation that a node is drained, on the Kubernetes node itself (design.md §6).

A cordoned (or tainted, or admin-drained) node receives no new slices; its
slices leave as their contracts end, and once it is empty the broker records
it ``drained``. :class:`DrainReporter` follows the broker's nodes and marks
each drained Kubernetes node with a label (``slicebroker.io/drained=true``)
and an annotation (``slicebroker.io/drained-at``, the broker's time of the
change, ISO 8601), which node-repair controllers can select on; it removes
both when the node is back in service. No human step.

A Kubernetes node split into several broker nodes (whole GPUs and MIG
profiles, see :mod:`broker.kube.inventory`) is marked once all of them are
drained. The reporter compares with the labels the nodes carry (one list of
nodes per round), so it keeps no state and a restart repeats nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from ..rounds import Backoff, Rounds
from .inventory import kube_node_name

log = logging.getLogger(__name__)

DRAINED_LABEL = "slicebroker.io/drained"
DRAINED_AT_ANNOTATION = "slicebroker.io/drained-at"

BrokerNodes = Callable[[], Awaitable[list[dict[str, Any]]]]


def drained_nodes(broker_nodes: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """Kubernetes node -> when it was drained (``None``: not drained), from the broker's
    ``GET /nodes``. A node is drained when all its broker nodes are."""
    parts: dict[str, list[Mapping[str, Any]]] = {}
    for node in broker_nodes:
        parts.setdefault(kube_node_name(node["name"]), []).append(node)
    result: dict[str, float | None] = {}
    for name, nodes in parts.items():
        if all(n.get("state") == "drained" for n in nodes):
            result[name] = max(float(n.get("state_changed_at") or 0.0) for n in nodes)
        else:
            result[name] = None
    return result


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class DrainReporter(Rounds):
    """Labels drained Kubernetes nodes for repair automation.

    ``api`` is a ``kubernetes_asyncio`` ``CoreV1Api`` (with ``list`` and
    ``patch`` on nodes); ``broker_nodes`` an async callable returning the
    broker's nodes (:meth:`broker.client.BrokerClient.nodes`, or
    ``Broker.nodes`` run in an executor). ``label``/``annotation`` name the
    marks; an empty ``annotation`` writes only the label. ``interval`` is the
    time between rounds of :meth:`run` (seconds).
    """

    def __init__(
        self,
        api: Any,
        broker_nodes: BrokerNodes,
        *,
        label: str = DRAINED_LABEL,
        annotation: str = DRAINED_AT_ANNOTATION,
        interval: float = 30.0,
        request_timeout: float = 30.0,
        backoff: Backoff | None = None,
    ):
        self.api = api
        self.broker_nodes = broker_nodes
        self.label = label
        self.annotation = annotation
        self.request_timeout = request_timeout
        self.rounds = 0
        super().__init__(interval, backoff or Backoff(), log)

    failure = "Drain report failed"

    async def report_once(self) -> list[str]:
        """One round: mark newly drained nodes, unmark nodes back in service; returns
        the Kubernetes nodes patched. A failed patch is logged and retried next round."""
        from kubernetes_asyncio.client.exceptions import ApiException

        wanted = drained_nodes(await self.broker_nodes())
        reply = await self.api.list_node(_request_timeout=self.request_timeout)
        patched = []
        for item in reply.items:
            name = item.metadata.name
            if name not in wanted:
                continue
            drained_at = wanted[name]
            has = (item.metadata.labels or {}).get(self.label) == "true"
            if has == (drained_at is not None):
                continue
            patch: dict[str, Any] = {
                "metadata": {"labels": {self.label: "true" if drained_at is not None else None}}
            }
            if self.annotation:
                value = _iso(drained_at) if drained_at is not None else None
                patch["metadata"]["annotations"] = {self.annotation: value}
            try:
                await self.api.patch_node(name, patch, _request_timeout=self.request_timeout)
            except ApiException as err:
                self.errors += 1
                if err.status != 404:  # 404: the node left the cluster meanwhile
                    log.warning("Marking node %s failed (%s %s)", name, err.status, err.reason)
                continue
            log.info("Node %s %s", name, "drained: marked" if drained_at else "back: unmarked")
            patched.append(name)
        self.rounds += 1
        return patched

    async def round_once(self) -> list[str]:
        return await self.report_once()


__all__ = ["DRAINED_AT_ANNOTATION", "DRAINED_LABEL", "DrainReporter", "drained_nodes"]
