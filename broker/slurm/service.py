"""The Slurm tasks of the broker service: the node inventory, drains, the slices' jobs.

Run by :class:`~broker.slurm.inventory.SlurmInventory`. Broker calls go through
the service's runner, so they share its database thread and wake a pass like
any other change.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.model import Node
from .commands import SlurmCommands
from .drain import DrainWriter
from .inventory import InventoryPoller
from .jobs import JobExecutor

if TYPE_CHECKING:
    from .inventory import SlurmInventory


class SlurmTasks:
    """The poller, the drain writer and the job executor against ``runner``'s broker,
    configured by ``options`` (the :class:`SlurmInventory`'s traits)."""

    def __init__(self, runner: Any, slurm: SlurmCommands, options: SlurmInventory):
        self.runner = runner
        self.slurm = slurm
        self.poller = InventoryPoller(
            slurm,
            self._sync,
            options.rules(),
            partition=options.partition,
            interval=options.poll_interval,
        )
        self.drains = DrainWriter(
            slurm, self._broker_nodes, interval=options.poll_interval, changed=self.poller.wake
        )
        scopes = {"batch": options.batch_signal_scope, "interactive": options.session_signal_scope}
        self.jobs = JobExecutor(
            slurm,
            self._live_slices,
            self._end_slice,
            partition=options.partition,
            signal=options.preempt_signal,
            full_signal=lambda s: scopes.get(str(s.get("kind")), "full") == "full",
            submit_users=options.submit_users,
            cancel_strays=options.cancel_strays and bool(options.partition),
            end_wait=options.end_wait,
            interval=options.job_interval,
        )
        self.tasks: list[asyncio.Task] = []

    async def _sync(self, nodes: list[Node]) -> None:
        await self.runner.run(self.runner.broker.sync_inventory, nodes)
        self.runner.request_pass()  # nodes came, went or changed state
        self.drains.wake()

    async def _broker_nodes(self) -> list[dict[str, Any]]:
        return await self.runner.read(self.runner.broker.nodes)

    async def _live_slices(self) -> list[Mapping[str, Any]]:
        return await self.runner.read(self.runner.broker.list_slices, state="live")

    async def _end_slice(self, slice_id: int, why: str) -> None:
        await self.runner.run(self.runner.broker.release, slice_id, why=why)
        self.runner.request_pass()  # its GPUs are free

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for part in (self.poller, self.drains, self.jobs):
            self.tasks.append(loop.create_task(part.run()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
