"""Where the broker's nodes come from: one interface, a class per backend.

``slicebroker serve`` runs one :class:`Inventory`, chosen by
``BrokerApp.inventory_class``: a class, a dotted ``module.Class`` name, or the
name of an entry point in the ``slicebroker.inventories`` group. The package
registers four:

- ``static`` (:class:`StaticInventory`, the default): the cluster file's
  ``[[nodes]]``, changed by editing the file and restarting, or by admins
  (drain, undrain, down);
- ``nvidia-smi`` (:class:`LocalInventory`): this machine's GPUs, found with
  ``nvidia-smi`` at start;
- ``kubernetes`` (:class:`broker.kube.inventory.KubernetesInventory`): the
  cluster's GPU nodes, kept current with a watch;
- ``slurm`` (:class:`broker.slurm.inventory.SlurmInventory`): the GPU nodes of
  the broker's Slurm partition, read every few seconds, with slices run as Slurm jobs.

An inventory is a traitlets ``Configurable``: its options are its own traits,
set as ``c.LocalInventory.nvidia_smi = ...`` in the options file or
``--LocalInventory.nvidia_smi=...`` on the command line. The service calls
:meth:`Inventory.setup` before it listens (slow imports and a first sync
belong there), :meth:`Inventory.start` once it serves, and
:meth:`Inventory.stop` when it stops. A live inventory pushes the whole node
list with :meth:`broker.store.Broker.sync_inventory` on the runner's database
thread, then asks for a pass; the cluster file's own nodes go ``down`` then.
"""

from __future__ import annotations

import asyncio
from typing import Any

from traitlets import Unicode
from traitlets.config import LoggingConfigurable

from .core.model import Node
from .nvidia_smi import local_nodes, parse_gpus, query_gpus

#: The entry point group inventories are registered in.
ENTRY_POINT_GROUP = "slicebroker.inventories"


class InventoryError(Exception):
    """The inventory cannot run (a missing extra, no API credentials, no GPU found);
    the service stops with this one-line message."""


class Inventory(LoggingConfigurable):
    """The base of every inventory: as it is, the cluster file's nodes and nothing more.

    ``runner`` is the service's :class:`~broker.service.runner.BrokerRunner`:
    ``await runner.run(runner.broker.sync_inventory, nodes)`` replaces the
    broker's nodes, ``runner.request_pass()`` wakes the scheduler.
    """

    async def setup(self, runner: Any) -> None:
        """Prepare before the service listens; raise :class:`InventoryError` to refuse to start."""

    def start(self) -> None:
        """Begin keeping the nodes current (on the running event loop)."""

    async def stop(self) -> None:
        """Stop every task :meth:`start` began and release connections."""

    def describe(self) -> str:
        """What the inventory does, for the start-up log line."""
        return "nodes from the cluster file"


class StaticInventory(Inventory):
    """The nodes the cluster file declares (``[[nodes]]``); admins drain, undrain and
    down them with ``slicebroker``; a changed file takes effect at the next start."""


class LocalInventory(Inventory):
    """This machine's GPUs, found with ``nvidia-smi`` when the service starts.

    All GPUs of one model make one node named after the host (``<host>-<type>``
    per model when models differ); their GPU types get weight 1.0 unless the
    cluster file's ``[gpu_types]`` says otherwise. The file still gives projects
    and policy; its own ``[[nodes]]`` go ``down``. The service refuses to start
    when ``nvidia-smi`` finds no GPU.
    """

    nvidia_smi = Unicode(
        "nvidia-smi",
        help="""The nvidia-smi program: a name looked up on PATH, or a path
        (default: nvidia-smi).
        """,
    ).tag(config=True)

    host = Unicode(
        "",
        help="""The node name (with several GPU models, the prefix of the node names).
        Default: empty, this machine's short host name.
        """,
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.nodes: list[Node] = []

    async def setup(self, runner: Any) -> None:
        text = await asyncio.to_thread(query_gpus, program=self.nvidia_smi)
        try:
            gpus = parse_gpus(text) if text else []
        except ValueError as err:
            raise InventoryError(str(err)) from None
        if not gpus:
            raise InventoryError(f"no GPU found with {self.nvidia_smi}")
        self.nodes = [
            Node(node.name, node.gpu_type, len(node.indices))
            for node in local_nodes(gpus, self.host or None)
        ]
        await runner.run(runner.broker.sync_inventory, self.nodes)
        runner.request_pass()

    def describe(self) -> str:
        found = ", ".join(f"{n.name}: {n.gpu_count} x {n.gpu_type}" for n in self.nodes)
        return f"nodes from {self.nvidia_smi} ({found})"
