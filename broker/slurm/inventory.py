"""GPU inventory from Slurm's nodes (design.md §6, §9).

:func:`nodes_from_slurm` maps one node as ``sinfo --json`` shows it to broker
:class:`~broker.core.model.Node` values — a pure function, tested on tables:

- GPUs: the node's ``gpu`` generic resources (``Gres=gpu:h100:4``). One GPU type
  gives a broker node of the Slurm node's name; several types on one node give
  one broker node per type, ``<node>:<type>`` (:func:`slurm_node_name` maps
  back). A count without a type (``gpu:4``) has :attr:`InventoryRules.default_gpu_type`.
  A node without GPUs is no broker node.
- state: Slurm's ``DOWN`` (and ``FUTURE``) is ``down``; a ``DRAIN``, ``FAIL``,
  ``MAINTENANCE`` or power-down flag is ``draining``, except a drain whose reason
  begins with :data:`BROKER_REASON_PREFIX`: that is the broker's own drain
  written back into Slurm (:mod:`broker.slurm.drain`), which the broker holds
  itself. ``NOT_RESPONDING`` alone changes nothing: Slurm decides when such a
  node is ``DOWN``. Any other node is ``ready``.

Only the nodes of the broker's partition are taken (:attr:`SlurmInventory.partition`).

:class:`InventoryPoller` keeps a sink (:meth:`broker.store.Broker.sync_inventory`)
current: Slurm has no watch a client can hold open, so it reads the nodes every
``interval`` seconds and pushes the inventory when it changed. A read that
fails (the controller restarting) pushes nothing: the broker keeps the nodes it
had, and no slice ends because Slurm was away.

:class:`SlurmInventory` is the broker service's inventory backend
(``--BrokerApp.inventory_class=slurm``): the poller, the broker's drains written
into Slurm, and the executor of slices as Slurm jobs (:mod:`broker.slurm.jobs`).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traitlets import Bool, Dict, Enum, Float, List, Unicode, validate

from broker.core.model import Node, NodeState
from broker.inventory import Inventory, InventoryError
from broker.rounds import Backoff, Rounds
from broker.traits import seconds_above_zero, seconds_not_negative

from .commands import SlurmCommands, SlurmError

if TYPE_CHECKING:
    from .service import SlurmTasks

log = logging.getLogger(__name__)

#: The start of the reason of every drain the broker sets in Slurm.
BROKER_REASON_PREFIX = "slicebroker:"
#: Separates a Slurm node's name from a GPU type in a broker node's name.
TYPE_SEPARATOR = ":"
#: Node flags that keep new work off a node (``draining`` in the broker).
DRAINING_FLAGS = frozenset(
    {"DRAIN", "FAIL", "MAINTENANCE", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN"}
)
DOWN_STATES = frozenset({"down", "future"})

_GRES_ITEM = re.compile(r"^(?P<name>[^:(]+)(?::(?P<type>[^:(]+))?(?::(?P<count>\d+))?")


@dataclass(frozen=True)
class InventoryRules:
    """How Slurm nodes become broker nodes."""

    #: Slurm gres type -> broker GPU type; types not listed are lower-cased.
    gpu_types: Mapping[str, str] = field(default_factory=dict)
    #: GPU type of GPUs declared without a type (``gpu:4``).
    default_gpu_type: str = "gpu"


def gpus_of(gres: str) -> dict[str | None, int]:
    """Slurm gres type (``None``: untyped) -> GPU count, from a node's ``gres`` text
    such as ``gpu:h100:4(S:0-1),gpu:a100:2`` or ``gpu:4``."""
    counts: dict[str | None, int] = {}
    for item in _split_gres(gres):
        match = _GRES_ITEM.match(item)
        if not match or match["name"] != "gpu":
            continue
        kind, count = match["type"], match["count"]
        if count is None and kind is not None and kind.isdigit():
            kind, count = None, kind  # gpu:4
        if count is None:
            continue
        counts[kind] = counts.get(kind, 0) + int(count)
    return {kind: n for kind, n in counts.items() if n > 0}


def _split_gres(gres: str) -> list[str]:
    """Split at the commas outside parentheses (``gpu:h100:4(S:0,1)``)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(gres):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            items.append(gres[start:i])
            start = i + 1
    items.append(gres[start:])
    return [item.strip() for item in items if item.strip() and item.strip() != "(null)"]


def node_state(obj: Mapping[str, Any]) -> NodeState:
    """``down``, ``draining`` or ``ready``, by the rules of the module's docstring."""
    state = str(obj.get("state") or "").lower()
    if state in DOWN_STATES:
        return NodeState.DOWN
    flags = set(obj.get("state_flags") or ())
    if flags & DRAINING_FLAGS:
        own = str(obj.get("reason") or "").startswith(BROKER_REASON_PREFIX)
        if not (own and flags & DRAINING_FLAGS == {"DRAIN"}):
            return NodeState.DRAINING
    return NodeState.READY


def nodes_from_slurm(obj: Mapping[str, Any], rules: InventoryRules | None = None) -> list[Node]:
    """The broker nodes of one Slurm node (none for a node without GPUs)."""
    rules = rules or InventoryRules()
    counts = gpus_of(str(obj.get("gres") or ""))
    state = node_state(obj)
    name = str(obj["name"])
    nodes = []
    for kind, count in sorted(counts.items(), key=lambda item: item[0] or ""):
        gpu_type = rules.gpu_types.get(kind or "", (kind or rules.default_gpu_type).lower())
        broker_name = name if len(counts) == 1 else f"{name}{TYPE_SEPARATOR}{kind or 'gpu'}"
        nodes.append(Node(broker_name, gpu_type, count, state))
    return nodes


def inventory(
    objs: Iterable[Mapping[str, Any]], rules: InventoryRules | None = None, partition: str = ""
) -> list[Node]:
    """The broker nodes of Slurm's nodes (those in ``partition`` if given), by name."""
    return sorted(
        (
            node
            for obj in objs
            if not partition or partition in (obj.get("partitions") or ())
            for node in nodes_from_slurm(obj, rules)
        ),
        key=lambda n: n.name,
    )


def slurm_node_name(broker_node: str) -> str:
    """The Slurm node a broker node is."""
    return broker_node.split(TYPE_SEPARATOR, 1)[0]


def gres_request(broker_node: str, gpus: int) -> str:
    """The ``--gres`` a job asks for ``gpus`` GPUs of ``broker_node``."""
    _, sep, kind = broker_node.partition(TYPE_SEPARATOR)
    return f"gpu:{kind}:{gpus}" if sep and kind != "gpu" else f"gpu:{gpus}"


# ---- the poll -------------------------------------------------------------------------

Sink = Callable[[list[Node]], Awaitable[None] | None]


class InventoryPoller(Rounds):
    """Reads Slurm's nodes every ``interval`` seconds and pushes the broker nodes of
    ``partition`` into ``sink`` when they changed (and after the first read)."""

    def __init__(
        self,
        slurm: SlurmCommands,
        sink: Sink,
        rules: InventoryRules | None = None,
        *,
        partition: str = "",
        interval: float = 5.0,
        backoff: Backoff | None = None,
    ):
        self.slurm = slurm
        self.sink = sink
        self.rules = rules or InventoryRules()
        self.partition = partition
        self.pushed: list[Node] | None = None
        self.reads = 0
        super().__init__(interval, backoff or Backoff(maximum=max(interval, 5.0)), log)

    failure = "Node inventory from Slurm failed"

    async def poll_once(self) -> list[Node]:
        """Read the nodes and push them if they changed; :class:`SlurmError` if Slurm
        does not answer."""
        nodes = inventory(await self.slurm.nodes(), self.rules, self.partition)
        self.reads += 1
        if nodes != self.pushed:
            result = self.sink(nodes)
            if inspect.isawaitable(result):
                await result
            self.pushed = nodes
        return nodes

    async def round_once(self) -> object:
        return await self.poll_once()


# ---- the service's inventory backend --------------------------------------------------


class SlurmInventory(Inventory):
    """Nodes from Slurm, read every ``poll_interval``; the broker's drains set in Slurm;
    slices run as Slurm jobs, signalled and cancelled as the broker decides.

    Give the broker a partition of its own (``partition``): its nodes are the
    broker's nodes, and jobs in it run only where the broker placed them. The
    cluster file still gives projects, members, weights and policy; its own
    ``[[nodes]]`` go ``down``. Needs Slurm's client commands (``sinfo``,
    ``squeue``, ``scontrol``, ``scancel``) on the broker's machine, as a Slurm
    operator (``scontrol update`` on nodes, ``scancel`` on others' jobs).
    """

    slurm_conf = Unicode(
        "",
        help="""The `slurm.conf` the commands read (`SLURM_CONF`). Default: empty, Slurm's
        own default (`/etc/slurm/slurm.conf`) or the broker's `SLURM_CONF`.""",
    ).tag(config=True)

    partition = Unicode(
        "slicebroker",
        help="""The Slurm partition the broker owns: its nodes are the broker's nodes, and
        the broker's jobs run in it (default `slicebroker`). Empty: every Slurm node
        with GPUs, and jobs of any partition.""",
    ).tag(config=True)

    gpu_types = Dict(
        key_trait=Unicode(),
        value_trait=Unicode(),
        help="""Slurm gres type -> broker GPU type, e.g. `{"a100_80g": "a100"}`. Types not
        listed are lower-cased (`gpu:H100:4` is `h100`).""",
    ).tag(config=True)

    default_gpu_type = Unicode(
        "gpu",
        help="""The broker GPU type of GPUs Slurm declares without a type (`gpu:4`).""",
    ).tag(config=True)

    command_timeout = Float(
        10.0,
        help="""Seconds a Slurm command may take (default 10); one that takes longer counts
        as Slurm not answering, and its round is tried again.""",
    ).tag(config=True)

    poll_interval = Float(
        5.0,
        help="""Seconds between two reads of Slurm's nodes (default 5): how soon a drain or
        a down node set in Slurm reaches the broker.""",
    ).tag(config=True)

    job_interval = Float(
        2.0,
        help="""Seconds between two reads of the broker's jobs in Slurm (default 2): how
        soon a preempted job gets its signal and a job that ended in Slurm ends its
        slice.""",
    ).tag(config=True)

    end_wait = Float(
        5.0,
        help="""Seconds after a job ends in Slurm before the broker ends its slice
        (default 5): the slice's holder (the spawner, the batch runner) usually
        releases it first, with its own reason; the broker ends the slices whose
        holder does not.""",
    ).tag(config=True)

    preempt_signal = Unicode(
        "TERM",
        help="""The signal a job gets when its slice is preempted, at the start of the grace
        period (`scancel --signal`; default TERM); the job is cancelled at its end.
        Empty: no signal, only the cancel.""",
    ).tag(config=True)

    batch_signal_scope = Enum(
        ["full", "batch"],
        "full",
        help="""Which processes of a batch slice's job get `preempt_signal`: `full` (default)
        every process of the job, as Slurm's own preemption does; `batch` the job's
        batch script only (`scancel --batch`), for scripts that trap the signal and
        pass it on themselves.""",
    ).tag(config=True)

    session_signal_scope = Enum(
        ["batch", "full"],
        "batch",
        help="""Which processes of a notebook session's job get `preempt_signal`: `batch`
        (default) the job script only, which traps it (the server goes on until the
        grace period ends and JupyterLab counts down); `full` every process,
        the server included, which then stops at once.""",
    ).tag(config=True)

    cancel_strays = Bool(
        True,
        help="""Cancel the jobs in `partition` that name no slice (submitted there by hand,
        past the broker), so that every GPU there is one the broker placed (default:
        yes). Has no effect without a `partition`.""",
    ).tag(config=True)

    submit_users = List(
        Unicode(),
        help="""Slurm users whose jobs may name any user's slice, e.g. the hub's account when
        the hub submits as itself. A job of anyone else ends a slice only if its Slurm
        user is the slice's user. Default: empty.""",
    ).tag(config=True)

    _check_not_negative = validate("end_wait")(seconds_not_negative)
    _check_positive = validate("poll_interval", "job_interval", "command_timeout")(
        seconds_above_zero
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tasks: SlurmTasks | None = None

    def rules(self) -> InventoryRules:
        return InventoryRules(dict(self.gpu_types), self.default_gpu_type)

    async def setup(self, runner: Any) -> None:
        """Read the nodes once: Slurm must answer before the service listens."""
        from .service import SlurmTasks

        slurm = SlurmCommands(self.slurm_conf, self.command_timeout)
        self.tasks = SlurmTasks(runner, slurm, self)
        try:
            nodes = await self.tasks.poller.poll_once()
        except SlurmError as err:
            raise InventoryError(f"cannot read the nodes from Slurm: {err}") from None
        if not nodes:
            where = f"partition {self.partition!r}" if self.partition else "Slurm"
            raise InventoryError(f"no node with GPUs (gres gpu) in {where}")

    def start(self) -> None:
        if self.tasks is not None:
            self.tasks.start()

    async def stop(self) -> None:
        if self.tasks is not None:
            await self.tasks.stop()

    def describe(self) -> str:
        where = f"partition {self.partition}" if self.partition else "every partition"
        found = ", ".join(
            f"{n.name}: {n.gpu_count} x {n.gpu_type}"
            for n in (self.tasks.poller.pushed if self.tasks else None) or ()
        )
        return f"nodes from Slurm ({where}: {found}); slices run as Slurm jobs there"


__all__ = [
    "BROKER_REASON_PREFIX",
    "InventoryPoller",
    "InventoryRules",
    "SlurmInventory",
    "gpus_of",
    "gres_request",
    "inventory",
    "node_state",
    "nodes_from_slurm",
    "slurm_node_name",
]
