"""A real single-host Slurm for the Slurm backend's tests: munge, slurmctld and slurmd
from the distribution's packages, on 127.0.0.1, everything under one temporary folder.

:class:`SlurmCluster` writes a munge key, ``slurm.conf`` and ``gres.conf`` for one
node (:data:`NODE`) of :data:`GPUS` GPUs of type :data:`GPU_TYPE`, in one
partition (:data:`PARTITION`), the one the broker owns. The GPUs are stand-in
device files: character devices made with ``mknod`` (Slurm refuses plain files
in ``gres.conf``), numbered like ``/dev/nvidia0..3``, so Slurm counts and binds
them as it would real ones (``CUDA_VISIBLE_DEVICES`` in each job); nothing in a
job can use them as a GPU. Process tracking is by process group and tasks are
not bound (``proctrack/pgid``, ``task/none``): no cgroup is written. Ports are
free ones, state lives in the folder, the daemons run as this user (root in CI).

Start-up waits until the node is idle; tear-down cancels every job and stops the
daemons; each takes seconds and is bounded (:attr:`SlurmCluster.timings`).
:meth:`SlurmCluster.restart` stops and starts slurmctld and slurmd with their
saved state, the way an upgrade or a crash would: running jobs survive it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.hubfixtures import free_port, wait_until

NODE = "gpu-a"
GPU_TYPE = "h100"
GPUS = 4
PARTITION = "slicebroker"
CPUS = 8

DAEMONS = ("munged", "slurmctld", "slurmd")

_SLURM_CONF = """\
ClusterName=sbtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: processes are tracked by group, tasks are not bound.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
# A batch job is scheduled as it comes (Slurm may otherwise wait up to 3 s to batch them),
# and one the scheduler passed over at its submission (a busy controller defers it) is
# tried again within a second, not at the next periodic run (60 s, backfill 30 s).
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
# The node's CPUs as declared, whatever this machine has: jobs need one CPU each.
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=30
InactiveLimit=0
KillWait=1
MinJobAge=300
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 Gres=gpu:{gpu_type}:{gpus} \
State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

_GRES_CONF = "NodeName={node} Name=gpu Type={gpu_type} File={root}/dev/nvidia[0-{last}]\n"


def slurm_missing() -> str | None:
    """Why Slurm cannot run here (a program missing, not root for ``mknod``), or ``None``."""
    for program in (*DAEMONS, "sbatch", "squeue", "sinfo", "scontrol", "scancel"):
        if shutil.which(program) is None:
            return f"{program} is not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the stand-in GPU devices need root (mknod)"
    return None


class SlurmCluster:
    """One Slurm node on 127.0.0.1 with its controller and munge, under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.timings: dict[str, float] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    # ---- configuration ---------------------------------------------------------------

    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "dev", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        for index in range(GPUS):
            device = self.root / "dev" / f"nvidia{index}"
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # a character device
        values = {
            "root": self.root,
            "user": getpass.getuser(),
            "ctld_port": free_port(),
            "slurmd_port": free_port(),
            "node": NODE,
            "cpus": CPUS,
            "gpu_type": GPU_TYPE,
            "gpus": GPUS,
            "last": GPUS - 1,
            "partition": PARTITION,
        }
        self.conf.write_text(_SLURM_CONF.format(**values))
        (self.root / "gres.conf").write_text(_GRES_CONF.format(**values))

    # ---- life cycle ------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        began = time.monotonic()
        self.write_config()
        munge = self.root / "munge"
        self._daemon(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={munge / 'munge.key'}",
                f"--socket={munge / 'munge.socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
            ],
        )
        wait_until(lambda: (munge / "munge.socket").exists(), timeout, "munged's socket")
        self.start_slurm(timeout, clean=True)
        self.timings["start_s"] = time.monotonic() - began
        return self

    def start_slurm(self, timeout: float = 30.0, *, clean: bool = False) -> None:
        """slurmctld (``-c``: a fresh state, else the saved one) and slurmd, until the
        node answers."""
        self._daemon("slurmctld", ["slurmctld", "-D", *(["-c"] if clean else [])])
        self._daemon("slurmd", ["slurmd", "-D", "-N", NODE])
        wait_until(self.node_answers, timeout, f"Slurm node {NODE} to answer ({self.root}/log)")

    def stop_slurm(self, timeout: float = 15.0) -> None:
        """Stop slurmd and slurmctld (their jobs' processes go on, as in a real restart)."""
        for name in ("slurmd", "slurmctld"):
            self._stop(name, timeout)

    def restart(self, timeout: float = 30.0) -> float:
        """Stop and start slurmctld and slurmd from their saved state; the seconds it took."""
        began = time.monotonic()
        self.stop_slurm()
        self.start_slurm(timeout)
        took = time.monotonic() - began
        self.timings["restart_s"] = took
        return took

    def shutdown(self, timeout: float = 15.0) -> None:
        """Cancel every job, then stop the daemons; bounded by ``timeout`` per daemon."""
        began = time.monotonic()
        if "slurmctld" in self.procs:
            with contextlib.suppress(subprocess.SubprocessError, OSError, AssertionError):
                self.run("scancel", "--full", f"--partition={PARTITION}", check=False)
                wait_until(lambda: not self.active_jobs(), timeout, "every job to end")
        for name in ("slurmd", "slurmctld", "munged"):
            self._stop(name, timeout)
        self._kill_leftovers()
        self.timings["stop_s"] = time.monotonic() - began

    def _kill_leftovers(self) -> None:
        """SIGKILL what a failed test left of this cluster's jobs: each job step daemon
        and job process whose environment names this cluster's folder."""
        mark = str(self.root).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            job = cmdline.startswith(b"slurmstepd") or b"SLURM_JOB_ID=" in environ
            if job and mark in environ:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs[name] = proc

    def _stop(self, name: str, timeout: float) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # ---- asking Slurm --------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, input: str | None = None) -> str:
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=20, input=input
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def node(self) -> dict[str, Any]:
        return json.loads(self.run("sinfo", "--json"))["nodes"][0]

    def node_answers(self) -> bool:
        try:
            node = self.node()
        except (AssertionError, subprocess.SubprocessError, ValueError, IndexError):
            return False
        flags = set(node.get("state_flags") or ())
        return node.get("state") in ("idle", "mixed", "allocated") and not (
            flags & {"NOT_RESPONDING", "DRAIN", "DOWN"}
        )

    def jobs(self) -> list[dict[str, Any]]:
        return json.loads(self.run("squeue", "--json"))["jobs"]

    def job(self, job_id: int) -> dict[str, Any] | None:
        return next((j for j in self.jobs() if j["job_id"] == job_id), None)

    def active_jobs(self) -> list[dict[str, Any]]:
        done = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        return [j for j in self.jobs() if j["job_state"] not in done]

    def sbatch(self, *options: str, script: str) -> int:
        out = self.run(
            "sbatch", "--parsable", f"--chdir={self.root / 'jobs'}", *options, input=script
        )
        return int(out.strip().split(";")[0])


def slurm_cluster(root: Path) -> Iterator[SlurmCluster]:
    """A started :class:`SlurmCluster`, shut down afterwards."""
    cluster = SlurmCluster(root)
    try:
        yield cluster.start()
    finally:
        cluster.shutdown()
