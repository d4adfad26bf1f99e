"""The local-process backend: notebook servers as processes on this machine (design.md §9).

:class:`SliceBrokerSpawner` (entry point ``slicebroker``) runs each server as
its user's system account, like JupyterHub's ``LocalProcessSpawner``;
:class:`SimpleSliceBrokerSpawner` runs every server as the hub's own user in
``/tmp/<name>``, like ``SimpleLocalProcessSpawner`` — for the embedded demo,
whose users have no system accounts.

The server sees only its granted GPUs: ``CUDA_VISIBLE_DEVICES`` lists them
(with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so that CUDA numbers GPUs as
``nvidia-smi`` does). This steers frameworks to the right devices; it is not
isolation — a user who unsets it can open the other GPUs. Use the Kubernetes
backend (or cgroups device rules) where users must be kept apart.

The broker's cluster must be this machine: the spawner refuses grants on
nodes it does not know when :attr:`local_nodes` is set, and maps each node's
GPU indices to this machine's with :attr:`node_gpus` (what
:mod:`spawner.inventory` writes for a machine with several GPU models).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Dict, List, Unicode

from .mixin import SliceBrokerMixin


class SliceBrokerSpawner(SliceBrokerMixin, LocalProcessSpawner):
    """A local process on the GPUs of a slice, as the user's system account."""

    local_nodes = List(
        Unicode(),
        help="""The broker node names that are this machine. A grant on another node
        is withdrawn with an error. Empty (the default): trust the broker's
        configuration to describe only this machine.""",
    ).tag(config=True)

    node_gpus = Dict(
        help="""Node name -> this machine's GPU indices (``nvidia-smi`` order) for the
        node's GPUs 0, 1, ... Needed only when the machine is split into several
        broker nodes (one per GPU model); a node not listed uses its indices as
        they are. :mod:`spawner.inventory` writes it with the cluster file.""",
    ).tag(config=True)

    gpu_env_var = Unicode(
        "CUDA_VISIBLE_DEVICES",
        help="The variable listing the granted GPUs (comma-separated indices).",
    ).tag(config=True)

    def placement_problem(self, slice_: Mapping[str, Any]) -> str | None:
        placements = slice_.get("placements") or []
        if len(placements) != 1:
            return f"a session needs its GPUs on one machine; the broker placed it on {placements}"
        node = placements[0]["node"]
        if self.local_nodes and node not in self.local_nodes:
            return (
                f"the broker granted GPUs on node {node!r}, which is not this machine "
                f"({', '.join(self.local_nodes)}); the hub admin must fix the broker's nodes"
            )
        return None

    def gpu_indices(self) -> list[int]:
        """This machine's indices of the granted GPUs."""
        indices: list[int] = []
        for placement in (self.slice or {}).get("placements") or ():
            mapping = self.node_gpus.get(placement["node"])
            for index in placement["gpu_indices"]:
                indices.append(int(mapping[index]) if mapping else int(index))
        return indices

    def slice_env(self) -> dict[str, str]:
        env = super().slice_env()
        if self.slice:
            env[self.gpu_env_var] = ",".join(str(i) for i in self.gpu_indices())
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        return env


class SimpleSliceBrokerSpawner(SliceBrokerSpawner, SimpleLocalProcessSpawner):
    """:class:`SliceBrokerSpawner` as the hub's own user, in ``home_dir_template``
    (default ``/tmp/{username}``): for demos and tests, not for shared machines."""
