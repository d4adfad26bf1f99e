"""``slicebroker run --slurm``: a batch slice's command as a Slurm job step on the grant.

The batch runner (:mod:`broker.batch`) holds the slice (queue, heartbeats,
requeue); with ``--slurm`` its command is this module, which replaces itself with
``srun`` pinned to the grant, as the notebook spawner pins its jobs:
``--partition`` (the broker's), ``--nodelist`` (the granted node), ``--gres``
(the granted GPU count), ``--comment=slicebroker:slice=<id>``. Slurm binds the
GPUs (``CUDA_VISIBLE_DEVICES`` in the job); the broker's service signals the job
at a preemption and cancels it at the grace period's end
(:mod:`broker.slurm.jobs`), and the runner's own SIGTERM reaches the job
through ``srun``, which passes it on to the job's tasks.

Run as ``python -m broker.slurm.srun [--partition P] -- CMD...`` under the runner,
which sets ``SLICEBROKER_SLICE_ID`` and ``SLICEBROKER_PLACEMENTS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .inventory import gres_request, slurm_node_name
from .jobs import job_comment

DEFAULT_PARTITION = "slicebroker"


def srun_argv(
    slice_id: int, placements: Sequence[Mapping[str, Any]], command: Sequence[str], partition: str
) -> list[str]:
    """``srun`` running ``command`` on the slice's one placement."""
    if len(placements) != 1:
        raise ValueError(
            f"--slurm runs a command on one node; the broker placed slice {slice_id} on "
            f"{len(placements)} nodes"
        )
    node, gpus = placements[0]["node"], len(placements[0]["gpu_indices"])
    return [
        "srun",
        f"--partition={partition}",
        f"--nodelist={slurm_node_name(node)}",
        f"--gres={gres_request(node, gpus)}",
        f"--comment={job_comment(slice_id)}",
        "--ntasks=1",
        f"--job-name=slicebroker-{slice_id}",
        *command,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m broker.slurm.srun",
        description="Run CMD with srun on the batch runner's slice (slicebroker run --slurm).",
    )
    parser.add_argument("--partition", default=DEFAULT_PARTITION, help="the broker's partition")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD")
    args = parser.parse_args(argv)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        slice_id = int(os.environ["SLICEBROKER_SLICE_ID"])
        placements = json.loads(os.environ["SLICEBROKER_PLACEMENTS"])
        if not command:
            raise ValueError("no command to run")
        argv_ = srun_argv(slice_id, placements, command, args.partition)
    except (KeyError, ValueError) as err:
        what = f"{err} is not set (run under slicebroker run)" if isinstance(err, KeyError) else err
        print(f"slicebroker run --slurm: {what}", file=sys.stderr)
        return 2
    try:
        os.execvp(argv_[0], argv_)
    except OSError as err:
        print(f"slicebroker run --slurm: cannot run srun: {err.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
