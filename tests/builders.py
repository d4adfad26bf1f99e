"""Small builders for hand-made clusters, so that a test states only what it is about."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from broker.core.model import (
    Account,
    Contract,
    Node,
    Placement,
    Policy,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from broker.store import Principal

MIN = 60.0
HOUR = 3600.0
NOW = 1_000_000.0

_ids = itertools.count(1)


def by_principal(request: Mapping[str, Any]) -> dict[str, Any]:
    """A Broker request written with ``user``, ``groups`` and ``admin``, as its
    ``principal`` and the rest."""
    rest = dict(request)
    principal = Principal(
        rest.pop("user"), frozenset(rest.pop("groups", ())), admin=rest.pop("admin", False)
    )
    return {"principal": principal, **rest}


def nodes(count: int, gpus: int = 8, gpu_type: str = "h100", prefix: str = "n") -> list[Node]:
    return [Node(f"{prefix}{i}", gpu_type, gpus) for i in range(count)]


def flat_tree(*projects: str, shares: dict[str, float] | None = None) -> list[Account]:
    shares = shares or {}
    return [Account(p, shares.get(p, 1.0)) for p in projects]


def pending(
    project: str,
    gpus: int = 1,
    *,
    kind: SliceKind = SliceKind.BATCH,
    min_runtime: float = HOUR,
    resumable: bool = False,
    max_runtime: float | None = None,
    priority: int = 0,
    user: str = "u",
    gpu_type: str | None = None,
    # In the queue for an hour: past every class's preemption delay unless a test
    # says otherwise (design.md §5.7).
    submitted_at: float = NOW - HOUR,
    preemptions: int = 0,
    id: int | None = None,
) -> Slice:
    return Slice(
        id=id if id is not None else next(_ids),
        project=project,
        user=user,
        gpus=gpus,
        kind=kind,
        contract=Contract(min_runtime, resumable, max_runtime),
        gpu_type=gpu_type,
        priority=priority,
        submitted_at=submitted_at,
        preemptions=preemptions,
    )


def running(
    project: str,
    node: str,
    gpu_indices: tuple[int, ...],
    *,
    granted_ago: float = 2 * HOUR,
    **kwargs,
) -> Slice:
    """A granted slice holding ``gpu_indices`` on ``node`` since ``granted_ago`` seconds."""
    base = pending(project, len(gpu_indices), **kwargs)
    return replace(
        base,
        state=SliceState.GRANTED,
        placements=(Placement(node, tuple(gpu_indices)),),
        granted_at=NOW - granted_ago,
    )


def snapshot(
    nodes_: list[Node],
    accounts: list[Account],
    slices: list[Slice],
    *,
    usage: dict[str, float] | None = None,
    policy: Policy | None = None,
    now: float = NOW,
    weights: dict[str, float] | None = None,
) -> Snapshot:
    return Snapshot(
        now=now,
        nodes=tuple(nodes_),
        accounts=tuple(accounts),
        slices=tuple(slices),
        usage=usage or {},
        gpu_type_weights=weights or {},
        policy=policy or Policy(),
    )
