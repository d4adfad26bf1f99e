"""What a pass's decisions do to the slices: the state machine of design.md §3–§6, on values.

:func:`requeued`, :func:`preempting` and :func:`granted` say which fields each
transition changes, for everyone: the pass (a slice it requeues may be granted
again at once), :func:`apply` (the simulator and the property tests keep their
cluster as plain values) and the store (which writes the result to its rows).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from .accounting import LedgerEntry, ledger_entry
from .model import Decisions, EndReason, Node, Placement, Policy, Slice, SliceKind, SliceState


@dataclass
class Applied:
    """The cluster after one pass: live slices, what ended, what was charged."""

    slices: dict[int, Slice]
    nodes: dict[str, Node]
    ended: list[tuple[Slice, EndReason]] = field(default_factory=list)
    requeued: list[Slice] = field(default_factory=list)
    charges: list[LedgerEntry] = field(default_factory=list)
    # The ids of the slices the decisions changed or ended (a kept index's update).
    changed: set[int] = field(default_factory=set)
    # The ids of the live slices that hold a promise (the next apply's promise_holders).
    promise_holders: set[int] = field(default_factory=set)


def requeued_when_ended(kind: SliceKind, resumable: bool, reason: EndReason) -> bool:
    """Whether the broker itself puts back in the queue work that ended for ``reason``:
    resumable batch work that was preempted or lost its node (design.md §5, phase 1); the
    rest ends, and its holder may ask again."""
    return (
        kind is SliceKind.BATCH
        and resumable
        and reason in (EndReason.PREEMPTED, EndReason.NODE_DOWN)
    )


def protected_after_preemption(min_runtime: float, policy: Policy) -> float | None:
    """A preempted job's next run is protected ``preemption_backoff`` times longer
    than ``min_runtime``, up to ``max_min_runtime`` (so that drains still end in
    time); None for free work, which stays free.

    Each preemption costs the job a restart and its work since its last
    checkpoint; without this, the same jobs were taken again and again (on
    Helios one 8-GPU job was preempted every hour, 60 times in 3 days).
    """
    if min_runtime <= 0:
        return None
    longer = min(min_runtime * policy.preemption_backoff, policy.max_min_runtime)
    return max(min_runtime, longer)


def requeued(slice_: Slice, now: float, protect_next: float | None = None) -> Slice:
    """``slice_`` back in the queue at ``now``, holding and promised nothing, with its
    place in it (``submitted_at``) kept; its lease starts again with its next
    heartbeat. ``protect_next`` is its next run's protected period, where the pass
    chose a new one (:attr:`~broker.core.model.Ending.protect_next`).

    Its wait for a preemption of its own starts again at ``now`` (``queued_at``):
    a victim that could take GPUs back at once would only swap seats.
    """
    contract = slice_.contract
    if protect_next is not None:
        contract = replace(contract, min_runtime=protect_next)
    return replace(
        slice_,
        contract=contract,
        state=SliceState.PENDING,
        placements=(),
        granted_at=None,
        preempt_deadline=None,
        promised=(),
        lease_expires_at=None,
        queued_at=now,
    )


def preempting(slice_: Slice, deadline: float) -> Slice:
    """``slice_`` preempted: it keeps its GPUs until ``deadline``, the end of its grace,
    and one more preemption counts against its budget."""
    return replace(
        slice_,
        state=SliceState.PREEMPTING,
        preempt_deadline=deadline,
        preemptions=slice_.preemptions + 1,
    )


def granted(slice_: Slice, placements: tuple[Placement, ...], now: float) -> Slice:
    """``slice_`` holding ``placements`` from ``now``; what was promised to it is its own."""
    return replace(
        slice_,
        state=SliceState.GRANTED,
        placements=placements,
        granted_at=now,
        preempt_deadline=None,
        promised=(),
    )


def end_slice(
    slice_: Slice,
    now: float,
    node_types: Mapping[str, str],
    weights: Mapping[str, float],
) -> LedgerEntry | None:
    """The ledger entry owed when ``slice_`` stops holding GPUs at ``now``."""
    if not slice_.holds_gpus:
        return None
    return ledger_entry(slice_, now, node_types, weights)


def apply(
    slices: Mapping[int, Slice],
    nodes: Mapping[str, Node],
    decisions: Decisions,
    now: float,
    weights: Mapping[str, float],
    promise_holders: Collection[int] | None = None,
    in_place: bool = False,
) -> Applied:
    """Apply ``decisions`` taken at ``now``; the inputs are left unchanged, unless
    ``in_place``: then ``slices`` and ``nodes``, where they are dicts, are changed
    themselves and returned, for a caller that keeps no other view of them
    (copying ten thousand live slices each pass was 4% of a large simulation).

    ``promise_holders``: the ids of the slices that hold a promise, where the caller
    keeps them (the last apply's :attr:`Applied.promise_holders`: only an apply gives
    a promise); without them every live slice is asked."""
    if in_place and isinstance(slices, dict) and isinstance(nodes, dict):
        live, nodes_after = slices, nodes
    else:
        live, nodes_after = dict(slices), dict(nodes)
    result = Applied(live, nodes_after)
    # What an ending's charge reads of the nodes; most passes end nothing.
    node_types = {name: node.gpu_type for name, node in nodes.items()} if decisions.endings else {}
    changed = result.changed
    for ending in decisions.endings:
        changed.add(ending.slice_id)
        slice_ = live.pop(ending.slice_id)
        entry = end_slice(slice_, now, node_types, weights)
        if entry is not None:
            result.charges.append(entry)
        if ending.requeue:
            live[slice_.id] = requeued(slice_, now, ending.protect_next)
            result.requeued.append(live[slice_.id])
        else:
            result.ended.append((slice_, ending.reason))
    for preemption in decisions.preemptions:
        slice_id = preemption.slice_id
        changed.add(slice_id)
        live[slice_id] = preempting(live[slice_id], preemption.deadline)
    promised = {r.slice_id: r.placements for r in decisions.reservations if r.promised}
    # Only a slice that holds a promise or is given one can change here; the rest
    # (most live slices) are only asked whether they hold one.
    if promise_holders is None:
        promise_holders = [slice_id for slice_id, slice_ in live.items() if slice_.promised]
    may_hold = {*promise_holders, *promised}
    for slice_id in may_hold:
        slice_ = live.get(slice_id)
        if (
            slice_ is not None
            and slice_.state is SliceState.PENDING
            and slice_.promised != promised.get(slice_id, ())
        ):
            live[slice_id] = replace(slice_, promised=promised.get(slice_id, ()))
            changed.add(slice_id)
    for grant in decisions.grants:
        changed.add(grant.slice_id)
        live[grant.slice_id] = granted(live[grant.slice_id], grant.placements, now)
    for change in decisions.node_changes:
        result.nodes[change.node] = replace(result.nodes[change.node], state=change.state)
    result.promise_holders = {
        slice_id for slice_id in may_hold if slice_id in live and live[slice_id].promised
    }
    return result
