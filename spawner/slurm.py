"""The Slurm backend: notebook servers as Slurm jobs on the granted node (design.md §7, §9).

:class:`SlurmSliceBrokerSpawner` is batchspawner's ``SlurmSpawner`` behind
:class:`~spawner.mixin.SliceBrokerMixin`: it gets a slice first, then
``SlurmSpawner`` submits the job, with the grant written into its script
(:meth:`placement_subvars`):

- ``--partition``: the broker's own partition (:attr:`slurm_partition`), where
  nothing but the broker places work, so Slurm never reorders its decisions;
- ``--nodelist``: the granted node (a broker node ``<node>:<type>`` of a node
  with several GPU types runs on ``<node>``, see :mod:`broker.slurm.inventory`);
- ``--gres=gpu:<n>``: the granted GPU count (``gpu:<type>:<n>`` on such a node);
- ``--comment=slicebroker:slice=<id>``: the slice the job runs, which the broker
  reads to signal the job at a preemption, cancel it at the grace period's end,
  and end the slice when the job ends in Slurm (:mod:`broker.slurm.jobs`).

They are options of the ``sbatch`` command line (:attr:`batch_submit_cmd`), which
win over the script's ``#SBATCH`` lines and which ``user_options`` (put into the
script's variables by batchspawner) cannot change.

Slurm binds the job's GPUs itself (``CUDA_VISIBLE_DEVICES`` in the job): it
counts what the broker granted exactly, and picks which devices; the broker's
GPU indices on a node are its bookkeeping, as on Kubernetes.

The progress page shows the broker's events (queue position, fair-share
value, estimate, the grant) while the slice waits, instead of Slurm's ``PD``;
after the grant, ``SlurmSpawner``'s own (the job pending, then running). Its
form, progress and state are kept: the mixin adds to them. On preemption the
session's job script gets the broker's signal (it traps it; the server runs to
the grace period's end), then the server is stopped; ``poll()`` sees a job that
left Slurm as a stopped server and releases its slice at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchspawner import SlurmSpawner
from traitlets import Unicode, default

from broker.slurm.inventory import gres_request, slurm_node_name
from broker.slurm.jobs import job_comment

from .mixin import SliceBrokerMixin

#: The progress of the grant's event (:func:`spawner.notices.grant_event`): Slurm's
#: events come after it.
GRANT_PROGRESS = 60


class SlurmSliceBrokerSpawner(SliceBrokerMixin, SlurmSpawner):
    """A Slurm job on the granted node with the granted GPUs, in the broker's partition."""

    slurm_partition = Unicode(
        "slicebroker",
        help="""The Slurm partition the broker owns (`SlurmInventory.partition`); every
        session's job is submitted there (default `slicebroker`).""",
    ).tag(config=True)

    def placement_problem(self, slice_: Mapping[str, Any]) -> str | None:
        placements = slice_.get("placements") or []
        if len(placements) != 1:
            return f"a session needs its GPUs on one node; the broker placed it on {placements}"
        return None

    @default("batch_submit_cmd")
    def _batch_submit_cmd_default(self) -> str:
        # On the command line, the grant wins over the script's own #SBATCH lines.
        return (
            "sbatch --parsable --partition={{partition}} --nodelist={{nodelist}}"
            " --gres={{gres}} --comment={{comment}}"
        )

    def placement_subvars(self) -> dict[str, str]:
        """The variables that pin the job to the grant (none without a slice)."""
        s = self.slice or {}
        placements = s.get("placements") or []
        if len(placements) != 1:
            return {}
        node, gpus = placements[0]["node"], len(placements[0]["gpu_indices"])
        return {
            "partition": self.slurm_partition,
            "nodelist": slurm_node_name(node),
            "gres": gres_request(node, gpus),
            "comment": job_comment(s["id"]),
        }

    def get_req_subvars(self) -> dict[str, Any]:
        subvars = super().get_req_subvars()
        subvars.update(self.placement_subvars())
        return subvars

    async def progress(self) -> Any:
        """The broker's events up to the grant, then SlurmSpawner's (the job's state)."""
        async for event in super().progress():
            yield event
        if not self._launching:
            return  # no grant (the request failed), or the launch is already over
        async for event in SlurmSpawner.progress(self):
            yield {"progress": GRANT_PROGRESS + 20, **event}


__all__ = ["SlurmSliceBrokerSpawner"]
