"""Slices as Slurm jobs: the broker's decisions carried out on the jobs (design.md §5, §6, §7).

A job runs a slice when it carries the slice's id in its comment
(:func:`job_comment`, ``slicebroker:slice=<id>``); the spawner
(:mod:`spawner.slurm`) and ``slicebroker run --slurm`` set it, with the node and
the GPU count of the grant (``--nodelist``, ``--gres``) in the broker's
partition. :func:`plan` compares the broker's slices with those jobs and says
what to do — a pure function, tested on tables:

- a job of a slice being preempted gets the preemption signal once, at the start
  of the grace period (``scancel --signal``), and is cancelled at its end;
- a job whose slice has ended (or is unknown to the broker) is cancelled, and so
  is one that is not on its slice's grant: its slice waits (not granted yet, or
  requeued), or the job asks for another node or more GPUs than were granted;
- with ``cancel_strays``, a job in the broker's partition that names no slice is
  cancelled: nothing runs there that the broker did not place;
- a job that ended in Slurm (completed, failed, cancelled, timed out, its node
  failed) ends its slice at once, with Slurm's state and exit code as the
  reason, ``end_wait`` seconds after the job's end (its holder, the spawner or
  the batch runner, usually releases it first), unless another job of the
  slice still runs. Only a job submitted for
  the slice's current grant (not one before a requeue) whose Slurm user is the
  slice's user, or one of ``submit_users``, may end a slice.

:class:`JobExecutor` runs a plan every ``interval`` seconds. When Slurm does not
answer it does nothing (no slice ends because the controller restarts); a job
already signalled is remembered, so a signal is sent once per job (a broker
restart may send it again).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from broker.rounds import Backoff, Rounds

from .commands import SlurmCommands
from .inventory import slurm_node_name

log = logging.getLogger(__name__)

COMMENT_PREFIX = "slicebroker:slice="
#: Seconds Slurm's clock may run behind the broker's (Slurm stamps submit times).
CLOCK_SLACK_S = 2.0
_COMMENT = re.compile(r"(?:^|[\s,;])slicebroker:slice=(\d+)\b")

#: Slurm job states of a job that has ended.
ENDED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)


SCOPE_WORDS = {"full": "every process", "batch": "the batch script", "steps": "its steps"}


def job_comment(slice_id: int) -> str:
    """The comment that makes a job the job of ``slice_id``."""
    return f"{COMMENT_PREFIX}{slice_id}"


def slice_of_job(job: Mapping[str, Any]) -> int | None:
    """The slice id a job's comment names, or ``None``."""
    match = _COMMENT.search(str(job.get("comment") or ""))
    return int(match.group(1)) if match else None


def job_gpus(job: Mapping[str, Any]) -> int:
    """The GPUs a job asks for per node (``--gres=gpu:[type:]N``, ``--gpus=N``)."""
    total = 0
    for field_ in ("tres_per_node", "tres_per_job"):
        for item in str(job.get(field_) or "").split(","):
            parts = item.replace("/", ":").split(":")
            if parts[:2] == ["gres", "gpu"] and parts[-1].isdigit():
                total += int(parts[-1])
    return total


def on_grant(job: Mapping[str, Any], s: Mapping[str, Any]) -> bool:
    """Whether ``job`` runs inside slice ``s``'s grant: on its node, with at most its GPUs."""
    node = str(job.get("nodes") or job.get("required_nodes") or "")
    return any(
        slurm_node_name(p["node"]) == node and job_gpus(job) <= len(p["gpu_indices"])
        for p in s.get("placements") or ()
    )


def of_this_grant(job: Mapping[str, Any], s: Mapping[str, Any]) -> bool:
    """Whether ``job`` was submitted for slice ``s``'s current grant, not an earlier one
    (a requeued slice granted again): jobs are submitted after their grant."""
    granted, submitted = s.get("granted_at"), job.get("submit_time")
    if not isinstance(granted, int | float) or not isinstance(submitted, int | float):
        return True
    return submitted >= granted - CLOCK_SLACK_S


def ended(job: Mapping[str, Any]) -> bool:
    return str(job.get("job_state") or "") in ENDED_STATES


def end_reason(job: Mapping[str, Any]) -> str:
    """Why a job ended, in Slurm's words: ``job 12 FAILED in Slurm (exit code 3)``."""
    state = str(job.get("job_state") or "ended")
    text = f"job {job.get('job_id')} {state} in Slurm"
    code = job.get("exit_code")
    if isinstance(code, int) and state != "COMPLETED":
        # squeue's exit_code is the wait status: the exit code, or the killing signal.
        text += f" (exit code {code >> 8})" if code >= 256 or code == 0 else f" (signal {code})"
    reason = str(job.get("state_reason") or "")
    if reason not in ("", "None", "NonZeroExitCode"):  # the exit code says that one
        text += f": {reason}"
    return text


@dataclass(frozen=True)
class Signal:
    job_id: int
    slice_id: int
    #: ``full``, ``batch`` or ``steps``: see :meth:`SlurmCommands.signal`.
    scope: str


@dataclass(frozen=True)
class Cancel:
    job_id: int
    slice_id: int
    why: str


@dataclass(frozen=True)
class EndSlice:
    slice_id: int
    why: str


@dataclass
class Plan:
    signals: list[Signal] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    ends: list[EndSlice] = field(default_factory=list)


def plan(
    live: Mapping[int, Mapping[str, Any]],
    jobs: Iterable[Mapping[str, Any]],
    now: float,
    *,
    signalled: Collection[int] = (),
    submit_users: Collection[str] = (),
    signal: bool = True,
    full_signal: Callable[[Mapping[str, Any]], bool] = lambda s: True,
    cancel_strays: bool = False,
    end_wait: float = 0.0,
) -> Plan:
    """What to do with the slices' jobs. ``live``: the broker's live slices by id
    (``state``, ``placements``, ``preempt_deadline``, ``user``, ``kind``); ``jobs``:
    Slurm's jobs (of the broker's partition); ``signalled``: jobs already signalled;
    ``full_signal(slice)``: whether the signal goes to every process of its job;
    ``end_wait``: seconds after a job's end before its slice is ended (its holder
    may release it first)."""
    result = Plan()
    running: dict[int, list[Mapping[str, Any]]] = {}
    finished: dict[int, list[Mapping[str, Any]]] = {}
    for job in jobs:
        slice_id = slice_of_job(job)
        if slice_id is not None:
            (finished if ended(job) else running).setdefault(slice_id, []).append(job)
        elif cancel_strays and not ended(job):
            result.cancels.append(Cancel(int(job["job_id"]), 0, "it names no slice"))
    for slice_id, slice_jobs in running.items():
        s = live.get(slice_id)
        for job in slice_jobs:
            job_id = int(job["job_id"])
            if s is None:
                result.cancels.append(Cancel(job_id, slice_id, "its slice has ended"))
            elif s.get("state") == "pending":
                result.cancels.append(Cancel(job_id, slice_id, "its slice is not granted"))
            elif not on_grant(job, s):
                result.cancels.append(Cancel(job_id, slice_id, "it is not on its slice's grant"))
            elif s.get("state") == "preempting":
                if now >= float(s.get("preempt_deadline") or 0):
                    result.cancels.append(Cancel(job_id, slice_id, "its grace period is over"))
                elif signal and job_id not in signalled:
                    scope = "full" if full_signal(s) else "batch"
                    if job.get("batch_flag") is False:
                        scope = "steps"  # srun's own job: no script, its steps are the job
                    result.signals.append(Signal(job_id, slice_id, scope))
    for slice_id, slice_jobs in finished.items():
        s = live.get(slice_id)
        if s is None or s.get("state") not in ("granted", "preempting") or slice_id in running:
            continue
        job = max(slice_jobs, key=lambda j: int(j["job_id"]))
        if not (on_grant(job, s) and of_this_grant(job, s)):
            continue  # a job of an earlier grant (before a requeue), or one never on it
        if str(job.get("user_name") or "") not in (*submit_users, s.get("user")):
            continue
        end_time = job.get("end_time")
        if isinstance(end_time, int | float) and now < end_time + end_wait:
            continue  # its holder (the spawner, the batch runner) may release it first
        result.ends.append(EndSlice(slice_id, end_reason(job)))
    return result


LiveSlices = Callable[[], Awaitable[list[dict[str, Any]]]]
EndSliceFn = Callable[[int, str], Awaitable[None]]


class JobExecutor(Rounds):
    """Carries out :func:`plan` on Slurm every ``interval`` seconds.

    ``live_slices`` returns the broker's live slices; ``end_slice(id, why)`` ends
    one whose job ended. ``signal`` is the preemption signal (empty: none);
    ``full_signal(slice)`` says whether it goes to every process of the job.
    """

    def __init__(
        self,
        slurm: SlurmCommands,
        live_slices: LiveSlices,
        end_slice: EndSliceFn,
        *,
        partition: str = "",
        signal: str = "TERM",
        full_signal: Callable[[Mapping[str, Any]], bool] = lambda s: True,
        submit_users: Collection[str] = (),
        cancel_strays: bool = False,
        end_wait: float = 5.0,
        interval: float = 2.0,
        clock: Callable[[], float] | None = None,
        backoff: Backoff | None = None,
    ):
        self.slurm = slurm
        self.live_slices = live_slices
        self.end_slice = end_slice
        self.partition = partition
        self.signal = signal
        self.full_signal = full_signal
        self.submit_users = tuple(submit_users)
        self.cancel_strays = cancel_strays
        self.end_wait = end_wait
        self.clock = clock or time.time
        #: Jobs given the preemption signal (job id -> slice id), for tests and logs.
        self.signalled: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self.rounds = 0
        super().__init__(interval, backoff or Backoff(maximum=max(interval, 5.0)), log)

    failure = "Slurm jobs round failed"

    async def run_once(self) -> Plan:
        """One round; :class:`~broker.slurm.commands.SlurmError` if Slurm does not answer."""
        jobs = await self.slurm.jobs(self.partition)
        live = {s["id"]: s for s in await self.live_slices()}
        todo = plan(
            live,
            jobs,
            self.clock(),
            signalled=self.signalled,
            submit_users=self.submit_users,
            signal=bool(self.signal),
            full_signal=self.full_signal,
            cancel_strays=self.cancel_strays,
            end_wait=self.end_wait,
        )
        for step in todo.signals:
            await self.slurm.signal(step.job_id, self.signal, scope=step.scope)
            self.signalled[step.job_id] = step.slice_id
            log.info(
                "Job %s of slice %s: SIG%s sent (%s), its slice is preempted",
                step.job_id,
                step.slice_id,
                self.signal,
                SCOPE_WORDS[step.scope],
            )
        for step in todo.cancels:
            if step.job_id in self.cancelled:
                continue  # ending already (Slurm's KillWait)
            await self.slurm.cancel(step.job_id)
            self.cancelled.add(step.job_id)
            log.info("Job %s (slice %s) cancelled: %s", step.job_id, step.slice_id or "-", step.why)
        for step in todo.ends:
            await self.end_slice(step.slice_id, step.why)
            log.info("Slice %s ended: its %s", step.slice_id, step.why)
        active = {int(j["job_id"]) for j in jobs if not ended(j)}
        self.cancelled &= active
        self.signalled = {j: s for j, s in self.signalled.items() if j in active}
        self.rounds += 1
        return todo

    async def round_once(self) -> object:
        return await self.run_once()


__all__ = [
    "COMMENT_PREFIX",
    "ENDED_STATES",
    "Cancel",
    "EndSlice",
    "JobExecutor",
    "Plan",
    "Signal",
    "end_reason",
    "job_comment",
    "job_gpus",
    "on_grant",
    "plan",
    "slice_of_job",
]
