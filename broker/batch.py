"""The batch runner behind ``slicebroker run``: a command on a granted slice, under its contract.

:func:`run_batch` requests a batch slice, waits in the queue (telling the
user their position, fair-share value and estimated start whenever these
change — by long-polling the broker, never by busy polling), runs the command
on the granted GPUs, heartbeats the slice, and follows the contract:

- preempted (state ``preempting``): the command gets SIGTERM at once and
  SIGKILL at the broker's ``preempt_deadline``; a resumable request then
  queues again and the command runs again from the start (it resumes from its
  own checkpoint);
- the slice ending under the command (``expired``, ``node_down``, ``lost``):
  SIGTERM, then SIGKILL ``grace_kill`` seconds later;
- the command exiting: the slice is released and its status is the runner's;
- SIGINT or SIGTERM to the runner: forwarded to the command (SIGKILL
  ``grace_kill`` seconds later), then the slice is released.

A broker that does not answer, or answers 5xx (a proxy's 503 while it
restarts, a database outage), is waited for: the submission (resent with its
``Idempotency-Key``, so never twice), the queue and the release are tried again
until ``patience`` runs out; a running command is not disturbed, its lease
guards it. Whenever the runner ends it releases what it asked for and says
what was charged.

The command runs in a process group of its own, so that a terminal's Ctrl-C
reaches it once (forwarded by the runner) and SIGKILL reaches its children
too. See ``docs/batch.md``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from .budget import kept_text, kept_to_end, preemptions_left
from .client import BrokerAPIError, BrokerClient, new_idempotency_key
from .config import format_duration
from .units import gpu_hours, share_used

T = TypeVar("T")

#: The project of the hub session a command runs in (the spawner sets it): ``slicebroker
#: run``'s default project, and what the runner gives the command it runs.
PROJECT_ENV = "SLICEBROKER_PROJECT"

#: Heartbeat interval when the broker does not say how long a lease lasts (seconds).
FALLBACK_HEARTBEAT_S = 30.0
#: Signals the runner forwards to the command.
FORWARDED = (signal.SIGINT, signal.SIGTERM)
#: Least time a release is tried for (seconds), even by a runner of little patience:
#: the release is what stops the charges.
RELEASE_PATIENCE_S = 60.0
#: Longest pause between two tries of a broker that is down or answering 5xx (seconds).
RETRY_PAUSE_S = 5.0


def transient(err: BrokerAPIError) -> bool:
    """Whether ``err`` may pass: no answer (status 0), a 5xx (a proxy's 502/503/504 while
    the broker restarts, the broker's 503 while its database is away), or an error that is
    not the broker's (no JSON error body: the hub's proxy answering 404 pages while a
    restarted hub has not yet put the service's route back)."""
    return err.status == 0 or err.status >= 500 or not_from_the_broker(err)


def not_from_the_broker(err: BrokerAPIError) -> bool:
    """An HTTP error without the broker's JSON error body: someone in between answered
    (the client names such errors ``http_<status>``)."""
    return err.code == f"http_{err.status}"


class BatchError(Exception):
    """The runner cannot go on (the slice ended before a grant, the command cannot be
    started); ``status`` is the exit status to report: 1, or a shell's 126/127."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """What ``slicebroker run`` asks for; durations in seconds. Terms left ``None`` are the
    broker's ``[defaults.batch]`` (the slice it makes says what they came to)."""

    project: str
    gpus: int = 1
    min_runtime: float | None = None
    max_runtime: float | None = None
    gpu_type: str | None = None
    priority: int | None = None
    resumable: bool | None = None

    def submit(
        self,
        client: BrokerClient,
        idempotency_key: str | None = None,
        restores: int | None = None,
    ) -> Awaitable[dict[str, Any]]:
        """Queue the request; ``restores``: the preempted slice whose place in the queue
        and count of preemptions it takes over."""
        return client.submit(
            self.project,
            self.gpus,
            "batch",
            min_runtime=self.min_runtime,
            max_runtime=self.max_runtime,
            gpu_type=self.gpu_type,
            priority=self.priority,
            resumable=self.resumable,
            idempotency_key=idempotency_key,
            restores=restores,
        )


class _Stop(enum.Enum):
    """Why a run of the command ended."""

    EXITED = "exited"  # on its own
    INTERRUPTED = "interrupted"  # the runner got SIGINT/SIGTERM
    PREEMPTED = "preempted"  # the slice was preempted (or requeued from a down node)
    ENDED = "ended"  # the slice ended under it (expired, node down, lost)


async def run_batch(
    client: BrokerClient,
    request: BatchRequest,
    command: Sequence[str],
    *,
    grace_kill: float = 10.0,
    poll: float = 10.0,
    patience: float = 300.0,
    say: Callable[[str], None] | None = None,
    environ: Mapping[str, str] | None = None,
    handle_signals: bool = True,
) -> int:
    """Run ``command`` on a batch slice of ``request``; return its exit status.

    The status is the command's (128 + N when signal N ended it), from its
    last run. ``grace_kill`` is the time, in seconds, between SIGTERM and
    SIGKILL when the broker sets no deadline; ``poll`` the longest a long-poll
    waits (how stale queue figures may get); ``patience`` how long, in seconds,
    the runner keeps trying a broker that does not answer or answers 5xx
    (submitting, waiting for a grant, releasing). ``say``
    receives the progress lines (default: stderr); ``environ`` is the
    command's base environment (default: the runner's). With
    ``handle_signals`` (main thread only) SIGINT and SIGTERM are forwarded.

    Raises :class:`~broker.client.BrokerAPIError` when the broker refuses the
    request, and :class:`BatchError` when the slice ends before a grant.
    """
    runner = _Runner(
        client,
        request,
        list(command),
        grace_kill=grace_kill,
        poll=poll,
        patience=patience,
        say=say or _stderr,
        environ=os.environ if environ is None else environ,
    )
    with runner.signals(handle_signals):
        return await runner.run()


def _stderr(line: str) -> None:
    print(f"slicebroker: {line}", file=sys.stderr, flush=True)


class _Runner:
    def __init__(
        self,
        client: BrokerClient,
        request: BatchRequest,
        command: list[str],
        *,
        grace_kill: float,
        poll: float,
        patience: float,
        say: Callable[[str], None],
        environ: Mapping[str, str],
    ):
        self.client = client
        self.request = request
        self.command = command
        self.grace_kill = grace_kill
        self.poll = poll
        self.patience = patience
        self.say = say
        self.environ = environ
        self.signum: int | None = None  # the last signal the runner got
        self.interrupted = asyncio.Event()
        self.process: asyncio.subprocess.Process | None = None
        self.runs = 0

    # ---- signals --------------------------------------------------------------

    @contextmanager
    def signals(self, enabled: bool) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        if enabled:
            for signum in FORWARDED:
                loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            yield
        finally:
            if enabled:
                for signum in FORWARDED:
                    loop.remove_signal_handler(signum)

    def _on_signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            if self.interrupted.is_set():  # a second Ctrl-C: no more waiting
                self._signal_command(signal.SIGKILL)
            else:
                self._signal_command(signum)
        self.signum = signum
        self.interrupted.set()

    def _signal_command(self, signum: int) -> None:
        if self.process is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    # ---- the whole run --------------------------------------------------------

    async def run(self) -> int:
        slice_ = await self._submit()
        self.say(f"slice {slice_['id']} requested: {_describe_request(slice_)}")
        try:
            while True:
                granted = await self._wait_for_grant(slice_)
                if granted is None:  # interrupted while waiting; the request is withdrawn
                    return 128 + (self.signum or signal.SIGINT)
                slice_ = granted
                status, stop, slice_ = await self._run_command(granted)
                # The slice's own term: the request's, or the broker's default for batch.
                resumable = bool(granted.get("resumable")) and not self.interrupted.is_set()
                if stop is _Stop.PREEMPTED and resumable:
                    slice_ = await self._requeue(granted)
                    continue
                await self._release(slice_)
                if stop is _Stop.PREEMPTED:
                    self.say(f"slice {slice_['id']} was preempted; not resumable, not requeued")
                return status
        except BaseException:
            await asyncio.shield(self._release(slice_))  # leave no request behind
            raise

    async def _submit(self, restores: int | None = None) -> dict[str, Any]:
        """Submit the request (in the place of the preempted slice ``restores``); one key
        for every try, so the broker makes one slice."""
        key = new_idempotency_key()
        return await self._patiently(
            "submitting", lambda: self.request.submit(self.client, key, restores)
        )

    async def _patiently(
        self, what: str, call: Callable[[], Awaitable[T]], patience: float | None = None
    ) -> T:
        """``call()``, tried again while the broker does not answer or answers 5xx,
        for up to ``patience`` seconds (default: the runner's); then its error."""
        patience = self.patience if patience is None else patience
        since = time.monotonic()
        told = False
        while True:
            try:
                return await call()
            except BrokerAPIError as err:
                waited = time.monotonic() - since
                if not transient(err) or waited > patience:
                    raise
                if not told:
                    self.say(f"{what}: {err.message}; trying again for up to "
                             f"{format_duration(patience)}")  # fmt: skip
                    told = True
                await asyncio.sleep(min(RETRY_PAUSE_S, self.poll, patience - waited + 0.01))

    # ---- waiting ----------------------------------------------------------------

    async def _wait_for_grant(self, slice_: dict[str, Any]) -> dict[str, Any] | None:
        """The slice once it holds GPUs; ``None`` (request withdrawn) if interrupted."""
        shown = ""
        failing_since: float | None = None
        while True:
            if self.interrupted.is_set():
                await self._release(slice_)
                self.say(f"slice {slice_['id']}: interrupted while waiting; request withdrawn")
                return None
            state = slice_["state"]
            if state in ("granted", "preempting"):
                return slice_
            if state == "ended" and slice_.get("replaced_by") is not None:
                # Its user took an alternative (slicebroker sooner --take): follow it.
                successor = slice_["replaced_by"]
                self.say(f"slice {slice_['id']} was replaced by slice {successor}; waiting for it")
                slice_ = await self.client.get_slice(successor)
                continue
            if state == "ended":
                raise BatchError(
                    f"slice {slice_['id']} ended before it was granted ({slice_['end_reason']})"
                )
            line = _describe_wait(slice_)
            if line != shown:
                self.say(f"slice {slice_['id']} {line}")
                shown = line
            try:
                latest = await self._unless_interrupted(
                    self.client.wait_for_change(slice_["id"], "pending", self.poll)
                )
            except BrokerAPIError as err:
                now = time.monotonic()
                if not transient(err):
                    raise
                if failing_since is None:
                    failing_since = now
                    self.say(f"slice {slice_['id']}: {err.message}; still waiting")
                elif now - failing_since > self.patience:
                    self.say(
                        f"slice {slice_['id']}: the broker has not answered for "
                        f"{now - failing_since:.0f} s; giving up"
                    )
                    raise
                await self._unless_interrupted(asyncio.sleep(min(RETRY_PAUSE_S, self.poll)))
                continue
            if failing_since is not None:
                self.say(f"slice {slice_['id']}: the broker answers again")
            failing_since = None
            if latest is not None:
                slice_ = latest

    async def _preemption_budget(self) -> int | None:
        """The broker's preemption budget (``GET /limits``); None where it has none, or
        cannot say now (the grant is then told without it)."""
        try:
            return (await self.client.limits()).get("preemption_budget")
        except BrokerAPIError:
            return None

    async def _unless_interrupted(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or ``None`` (``work`` cancelled) when the runner is interrupted."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.interrupted.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return None

    # ---- running ----------------------------------------------------------------

    async def _run_command(self, slice_: dict[str, Any]) -> tuple[int, _Stop, dict[str, Any]]:
        """Run the command on ``slice_``'s GPUs until it exits; its status, why, the slice."""
        self.runs += 1
        budget = await self._preemption_budget() if slice_.get("preemptions") else None
        self.say(f"slice {slice_['id']} granted: {_describe_grant(slice_, budget)}")
        try:
            self.process = process = await asyncio.create_subprocess_exec(
                *self.command, env=self._environment(slice_), process_group=0
            )
        except OSError as err:
            status = 127 if isinstance(err, FileNotFoundError) else 126
            raise BatchError(f"cannot run {self.command[0]!r}: {err.strerror}", status) from None
        lease = _lease(slice_)
        tasks = {
            "exited": asyncio.ensure_future(process.wait()),
            "interrupted": asyncio.ensure_future(self.interrupted.wait()),
            "changed": asyncio.ensure_future(self._watch(slice_)),
            "lost": asyncio.ensure_future(self._heartbeat(slice_["id"], lease)),
        }
        try:
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
            if tasks["exited"].done():
                return _exit_status(process.returncode), _Stop.EXITED, slice_
            if tasks["interrupted"].done():
                stop, deadline = _Stop.INTERRUPTED, time.time() + self.grace_kill
                self.say(f"signal {_signal_name(self.signum)}: passed on to the command")
            elif tasks["changed"].done():
                slice_ = tasks["changed"].result()
                stop, deadline = self._on_change(slice_)
                self._signal_command(signal.SIGTERM)
            else:
                stop, deadline = _Stop.ENDED, time.time() + self.grace_kill
                self.say(
                    f"slice {slice_['id']}: no heartbeat reached the broker for a whole lease; "
                    "its GPUs may be given away: stopping the command"
                )
                self._signal_command(signal.SIGTERM)
            await self._stop_by(deadline)  # heartbeats go on meanwhile
            return _exit_status(process.returncode), stop, slice_
        finally:
            for task in tasks.values():
                task.cancel()
            if process.returncode is None:  # cancelled from outside: leave nothing behind
                self._signal_command(signal.SIGKILL)
            self.process = None

    def _on_change(self, slice_: dict[str, Any]) -> tuple[_Stop, float]:
        """What a change of state under a running command means: why it stops, and by when."""
        state, slice_id = slice_["state"], slice_["id"]
        if state == "preempting":
            deadline = slice_.get("preempt_deadline") or time.time() + self.grace_kill
            self.say(
                f"slice {slice_id} preempted ({slice_.get('preempt_reason') or 'no reason given'}):"
                f" SIGTERM sent to the command, SIGKILL at {_clock(deadline)}"
            )
            return _Stop.PREEMPTED, deadline
        if state in ("pending", "granted"):  # requeued at once (its node went down), or
            # even granted again elsewhere between two looks
            self.say(f"slice {slice_id} lost its GPUs and was requeued: stopping the command")
            return _Stop.PREEMPTED, time.time() + self.grace_kill
        self.say(
            f"slice {slice_id} ended ({slice_.get('end_reason') or 'no reason given'}): "
            "stopping the command"
        )
        if slice_.get("end_reason") in ("preempted", "node_down"):
            return _Stop.PREEMPTED, time.time() + self.grace_kill
        return _Stop.ENDED, time.time() + self.grace_kill

    async def _stop_by(self, deadline: float) -> None:
        """Wait for the command (SIGTERMed) to exit; SIGKILL it at ``deadline`` (epoch seconds)."""
        process = self.process
        assert process is not None
        try:
            async with asyncio.timeout(max(deadline - time.time(), 0.0)):
                await process.wait()
        except TimeoutError:
            self.say("the command is still running at its deadline: SIGKILL")
            self._signal_command(signal.SIGKILL)
            await process.wait()

    def _environment(self, slice_: dict[str, Any]) -> dict[str, str]:
        env = dict(self.environ)
        placements = slice_["placements"]
        env["SLICEBROKER_SLICE_ID"] = str(slice_["id"])
        env[PROJECT_ENV] = slice_["project"]
        # ISO 8601 in UTC, as in notebook sessions (empty for a slice without protection).
        until = slice_.get("protected_until")
        env["SLICEBROKER_PROTECTED_UNTIL"] = (
            ""
            if until is None
            else datetime.fromtimestamp(until, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
        env["SLICEBROKER_PLACEMENTS"] = json.dumps(placements)
        env["SLICEBROKER_RUN"] = str(self.runs)
        local = _local_placement(placements)
        if local is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in local["gpu_indices"])
        return env

    async def _watch(self, slice_: dict[str, Any]) -> dict[str, Any]:
        """The slice as soon as it is no longer ``granted`` (long-polls)."""
        failing = False
        while True:
            try:
                latest = await self.client.wait_for_change(slice_["id"], "granted", self.poll)
            except BrokerAPIError as err:  # the command keeps running; the lease guards it
                if not failing:
                    self.say(f"slice {slice_['id']}: cannot watch it: {err.message}")
                failing = True
                await asyncio.sleep(self.poll)
                continue
            failing = False
            if latest["state"] != "granted" or latest["granted_at"] != slice_["granted_at"]:
                return latest  # also granted again elsewhere, between two looks

    async def _heartbeat(self, slice_id: int, lease: float | None) -> None:
        """Heartbeat every lease/3 seconds; return once a whole lease went without one."""
        interval = lease / 3 if lease else FALLBACK_HEARTBEAT_S
        held_until = time.monotonic() + (lease or float("inf"))
        while True:
            await asyncio.sleep(max(min(interval, held_until - time.monotonic()), 0.0))
            if time.monotonic() >= held_until:
                return
            sent = time.monotonic()
            try:
                latest = await self.client.heartbeat(slice_id)
            except BrokerAPIError as err:
                self.say(f"slice {slice_id}: heartbeat failed: {err.message}")
                continue
            if latest["state"] in ("granted", "preempting") and lease:
                held_until = sent + lease

    # ---- after a run ----------------------------------------------------------------

    async def _requeue(self, granted: dict[str, Any]) -> dict[str, Any]:
        """The request the command runs on next: the same slice if the broker requeued it,
        else a new one with the same terms (the old one released).

        ``granted`` is the slice as the command's run started on it.
        """
        try:
            latest = await self.client.get_slice(granted["id"])
        except BrokerAPIError:
            latest = granted
        requeued = latest["state"] == "pending" or (
            latest["state"] == "granted" and latest["granted_at"] != granted["granted_at"]
        )
        if requeued:
            self.say(f"slice {latest['id']} is back in the queue; the command will run again")
            return latest
        await self._release(latest)
        # The new request takes the preempted one's place in the queue and its count of
        # preemptions, as a slice the broker requeues keeps them: a command that gives its
        # GPUs back at once must not lose what one that waits for the deadline keeps.
        try:
            fresh = await self._submit(restores=latest["id"])
            kept = ", in its place in the queue"
        except BrokerAPIError as err:
            if err.status not in (404, 409):  # not restorable (say, not released in time)
                raise
            fresh, kept = await self._submit(), ""
        self.say(
            f"slice {latest['id']} given back; requested slice {fresh['id']} with the same "
            f"terms{kept}"
        )
        return fresh

    async def _release(self, slice_: dict[str, Any]) -> None:
        """Release the slice (patiently), and say what it was charged."""
        if slice_["state"] == "ended":
            return
        try:
            released = await self._patiently(
                f"slice {slice_['id']}: releasing",
                lambda: self.client.release(slice_["id"]),
                max(self.patience, RELEASE_PATIENCE_S),
            )
        except BrokerAPIError as err:
            self.say(
                f"slice {slice_['id']}: could not release it: {err.message}; release it with "
                f"'slicebroker release {slice_['id']}'"
            )
            return
        charged = gpu_hours(released.get("charged_gpu_seconds") or 0.0)
        self.say(f"slice {released['id']} released, charged {charged}")


# ---- helpers -------------------------------------------------------------------------


def _lease(slice_: Mapping[str, Any]) -> float | None:
    """How long a heartbeat keeps the slice (seconds), as its grant shows it."""
    expires, granted = slice_.get("lease_expires_at"), slice_.get("granted_at")
    if expires is None or granted is None or expires <= granted:
        return None
    return expires - granted


def _local_placement(placements: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The placement whose GPUs the command sees: the only one, or this host's in a gang."""
    if len(placements) == 1:
        return placements[0]
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    return next((p for p in placements if p["node"] in names), None)


def _exit_status(returncode: int | None) -> int:
    """A shell's view of a return code: 128 + N for a process killed by signal N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "?"


def _clock(epoch: float | None) -> str:
    if epoch is None:
        return "unknown"
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def _describe_request(slice_: Mapping[str, Any]) -> str:
    """The terms of a new slice (the broker's defaults filled in), as the user reads them."""
    gpus = slice_["gpus"]
    text = f"{gpus} GPU{'s' * (gpus != 1)}"
    if slice_.get("gpu_type"):
        text += f" of type {slice_['gpu_type']}"
    protected = format_duration(slice_.get("min_runtime") or 0)
    text += f" for project {slice_['project']}, protected {protected}"
    if slice_.get("resumable"):
        text += ", resumable"
    return text


def _describe_wait(slice_: Mapping[str, Any]) -> str:
    """A pending slice's place in the queue, as the user reads it; changes only when it does."""
    parts = ["waiting"]
    if slice_.get("queue_position") is not None:
        parts.append(f"position {slice_['queue_position']} in the queue")
    if slice_.get("fairshare_value") is not None:
        # As the pages, the spawner and the CLI's table write it: 1.08×, not 1.1.
        parts.append(f"project at {share_used(slice_['fairshare_value'])}")
    start = slice_.get("estimated_start")
    parts.append(f"estimated start {_clock(start)[:5]}" if start else "no estimated start yet")
    return ", ".join(parts)


def _describe_grant(slice_: Mapping[str, Any], budget: int | None = None) -> str:
    """Where a grant is and what protects it; past the preemption ``budget``, that it is
    kept to its end, else how much of the budget its preemptions have spent."""
    where = "; ".join(
        f"{p['node']} GPU{'s' * (len(p['gpu_indices']) != 1)} "
        + ",".join(str(i) for i in p["gpu_indices"])
        for p in slice_["placements"]
    )
    if kept_to_end(slice_, budget):
        return f"{where}; {kept_text(slice_)}"
    left = preemptions_left(slice_, budget)
    spent = "" if left is None else f"; preempted {slice_['preemptions']} of {budget} times"
    return f"{where}; protected until {_clock(slice_.get('protected_until'))}{spent}"
