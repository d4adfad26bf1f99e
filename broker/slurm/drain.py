"""The broker's drains, written into Slurm (design.md §6).

A drain the broker decides (an admin's ``slicebroker drain``, ``POST
/nodes/{name}/drain``) is set on the Slurm node too, so that nothing else
Slurm runs starts there: ``scontrol update state=DRAIN reason="slicebroker:
draining (...)"``. The broker's slices leave as their contracts end; once the
broker has the node ``drained``, the reason says so (``slicebroker: drained, repair
may proceed``) and Slurm, with no job left, shows the node ``DRAINED``: repair
automation that reads Slurm proceeds, with no human step. When the broker
undrains the node, the Slurm drain it set is lifted (``state=RESUME``); a drain
someone set in Slurm is never lifted by the broker.

:func:`drain_updates` compares the broker's nodes with Slurm's — a pure
function; :class:`DrainWriter` applies it every round. It keeps no state: the
reasons in Slurm say which drains are the broker's, so a restart repeats nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from broker.rounds import Backoff, Rounds

from .commands import SlurmCommands
from .inventory import BROKER_REASON_PREFIX, slurm_node_name

log = logging.getLogger(__name__)

DRAINED_REASON = f"{BROKER_REASON_PREFIX} drained, repair may proceed"


@dataclass(frozen=True)
class DrainUpdate:
    node: str
    #: ``"drain"`` (with ``reason``) or ``"resume"``.
    action: str
    reason: str = ""


def _broker_drains(node: Mapping[str, Any]) -> bool:
    """Whether the broker itself keeps the node out of service (not because Slurm does)."""
    return node.get("state") in ("draining", "drained") and node.get("drained_by") == "admin"


def drain_updates(
    broker_nodes: Iterable[Mapping[str, Any]], slurm_nodes: Iterable[Mapping[str, Any]]
) -> list[DrainUpdate]:
    """The Slurm node updates that make Slurm show the broker's drains."""
    parts: dict[str, list[Mapping[str, Any]]] = {}
    for node in broker_nodes:
        parts.setdefault(slurm_node_name(node["name"]), []).append(node)
    updates = []
    for obj in slurm_nodes:
        name = str(obj.get("name"))
        nodes = parts.get(name)
        if not nodes:
            continue
        reason = str(obj.get("reason") or "")
        drained_in_slurm = "DRAIN" in set(obj.get("state_flags") or ())
        ours = drained_in_slurm and reason.startswith(BROKER_REASON_PREFIX)
        if any(_broker_drains(n) for n in nodes):
            if all(n.get("state") == "drained" for n in nodes):
                wanted = DRAINED_REASON
            else:
                why = next((n.get("state_reason") for n in nodes if _broker_drains(n)), "")
                wanted = f"{BROKER_REASON_PREFIX} draining ({why or 'set by the broker'})"
            if not drained_in_slurm or (ours and reason != wanted):
                updates.append(DrainUpdate(name, "drain", wanted))
        elif ours:
            updates.append(DrainUpdate(name, "resume"))
    return updates


BrokerNodes = Callable[[], Awaitable[list[dict[str, Any]]]]


class DrainWriter(Rounds):
    """Applies :func:`drain_updates` every ``interval`` seconds (or on :meth:`wake`);
    ``changed()`` is called after an update (the inventory reads Slurm again)."""

    def __init__(
        self,
        slurm: SlurmCommands,
        broker_nodes: BrokerNodes,
        *,
        interval: float = 5.0,
        changed: Callable[[], None] = lambda: None,
        backoff: Backoff | None = None,
    ):
        self.slurm = slurm
        self.broker_nodes = broker_nodes
        self.changed = changed
        self.rounds = 0
        super().__init__(interval, backoff or Backoff(maximum=max(interval, 5.0)), log)

    failure = "Writing drains into Slurm failed"

    async def write_once(self) -> list[DrainUpdate]:
        updates = drain_updates(await self.broker_nodes(), await self.slurm.nodes())
        for update in updates:
            if update.action == "drain":
                await self.slurm.drain(update.node, update.reason)
            else:
                await self.slurm.resume(update.node)
            log.info("Slurm node %s: %s %s", update.node, update.action, update.reason)
        if updates:
            self.changed()
        self.rounds += 1
        return updates

    async def round_once(self) -> list[DrainUpdate]:
        return await self.write_once()


__all__ = ["DRAINED_REASON", "DrainUpdate", "DrainWriter", "drain_updates"]
