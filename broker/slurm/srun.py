"""``slicebroker run --slurm``: a batch slice's command as a Slurm job step on the grant.

The batch runner (:mod:`broker.batch`) holds the slice (queue, heartbeats,
requeue); with ``--slurm`` its command is this module, which runs ``srun`` pinned
to the grant, as the notebook spawner pins its jobs: ``--partition`` (the
broker's), ``--nodelist`` (the granted node), ``--gres`` (the granted GPU count),
``--comment=slicebroker:slice=<id>``, job name ``slicebroker-<id>``. Slurm binds the
GPUs (``CUDA_VISIBLE_DEVICES`` in the job) and the command's exit status is this
module's.

Signals: ``srun`` ends its step at once (SIGKILL) on a SIGTERM, so it runs in a
process group of its own, out of reach of the runner's group signals, and a
signal this module gets (the runner's SIGTERM at a preemption's start, an
interrupt) is passed on to the job's step with ``scancel --signal``,
so the command can checkpoint in its grace period. At the grace period's end the
broker's service cancels the job (:mod:`broker.slurm.jobs`).

Run as ``python -m broker.slurm.srun [--partition P] -- CMD...`` under the runner,
which sets ``SLICEBROKER_SLICE_ID`` and ``SLICEBROKER_PLACEMENTS``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .inventory import gres_request, slurm_node_name
from .jobs import job_comment

DEFAULT_PARTITION = "slicebroker"
#: Signals passed on to the job rather than to ``srun`` (which would kill the step).
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def job_name(slice_id: int) -> str:
    return f"slicebroker-{slice_id}"


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
        f"--job-name={job_name(slice_id)}",
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
    name = job_name(slice_id)
    for signum in PASSED_ON:
        signal.signal(signum, lambda signum, _frame: _pass_on(signum, name, args.partition))
    try:
        srun = subprocess.Popen(argv_, start_new_session=True)
    except OSError as err:
        print(f"slicebroker run --slurm: cannot run srun: {err.strerror}", file=sys.stderr)
        return 127
    return _exit_status(srun.wait())


def _pass_on(signum: int, job_name: str, partition: str) -> None:
    """Send ``signum`` to the slice's job step (the job found by its name)."""
    name = signal.Signals(signum).name.removeprefix("SIG")
    subprocess.run(
        ["scancel", f"--signal={name}", f"--name={job_name}", f"--partition={partition}"],
        check=False,
        timeout=30,
    )


def _exit_status(returncode: int) -> int:
    """``srun``'s status as a shell would report it (128 + N when killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
