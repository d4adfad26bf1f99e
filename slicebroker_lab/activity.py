"""What a session last did, as the hub's idle rule reads it (design.md §3 idleness).

A session is active while it works and idle while it only waits:

- **active**: a kernel executing (``busy``), a kernel's or a terminal's last
  message, one of the session's GPUs busy (:mod:`slicebroker_lab.gpu`), or the
  user's "Keep my session" in Lab's idle warning;
- **not activity**: the server's API requests. An open Lab tab polls the server
  every few seconds, so the server's own ``last_activity`` (which counts them)
  never lets a session with a tab open look idle, and a training loop in a quiet
  notebook with no tab open looks idle to it only when its kernel prints nothing.

The GPU's busy time and the user's keep are also published as server settings
named ``*_last_activity``, which jupyter_server counts in its own
``last_activity``: what the server reports to the hub follows the GPU too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from .gpu import GpuReading, load_nvml, read_session_gpus

#: Server settings jupyter_server counts in ``last_activity`` (its ``*_last_activity`` rule).
GPU_SETTING = "slicebroker_gpu_last_activity"
KEPT_SETTING = "slicebroker_kept_last_activity"


def _timestamp(moment: datetime | None) -> float | None:
    if moment is None:
        return None
    if moment.tzinfo is None:  # jupyter_server's times are UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def last_active(
    started: float, now: float, kernels_busy: int, activity: Iterable[float | None]
) -> float:
    """When the session last did something: ``now`` while a kernel executes, else the
    latest of ``started`` and the ``activity`` times (epoch seconds; ``None`` ignored)."""
    if kernels_busy:
        return now
    return max([started, *(moment for moment in activity if moment is not None)])


class SessionActivity:
    """The session's activity, kept by the server extension: a periodic GPU sample, the
    kernels and terminals read when asked.

    ``settings`` is the server's web application settings (read for the kernel and
    terminal managers, written for :data:`GPU_SETTING` and :data:`KEPT_SETTING`).
    """

    def __init__(
        self,
        settings: dict[str, Any],
        *,
        busy_percent: float,
        nvidia_smi: str = "nvidia-smi",
        nvml: ModuleType | None = None,
    ) -> None:
        self.settings = settings
        self.busy_percent = busy_percent
        self.nvidia_smi = nvidia_smi
        self.nvml = nvml
        self.reading: GpuReading | None = None
        self.sampled_at: float | None = None

    @classmethod
    def for_server(cls, settings: dict[str, Any], config: Any) -> SessionActivity:
        """The activity of a server configured by ``config`` (a ``SliceBrokerLab``)."""
        return cls(
            settings,
            busy_percent=config.gpu_busy_percent,
            nvidia_smi=config.nvidia_smi,
            nvml=load_nvml() if config.use_nvml else None,
        )

    async def sample_gpus(self, now: float) -> GpuReading:
        """Read the session's GPUs once (in a thread: the reading blocks)."""
        reading = await asyncio.to_thread(
            read_session_gpus, dict(os.environ), nvml=self.nvml, program=self.nvidia_smi
        )
        self.reading, self.sampled_at = reading, now
        if reading.busy(self.busy_percent):
            self.settings[GPU_SETTING] = datetime.fromtimestamp(now, UTC)
        return reading

    def keep(self, now: float) -> None:
        """The user asked to keep the session: activity now."""
        self.settings[KEPT_SETTING] = datetime.fromtimestamp(now, UTC)

    def _kernels(self) -> tuple[int, int, float | None]:
        """(kernels, of them executing, the latest kernel message) of the server."""
        manager = self.settings.get("kernel_manager")
        if manager is None:
            return 0, 0, None
        kernels = [manager.get_kernel(kid) for kid in manager.list_kernel_ids()]
        busy = sum(getattr(k, "execution_state", None) == "busy" for k in kernels)
        return len(kernels), busy, _timestamp(getattr(manager, "last_kernel_activity", None))

    def _terminal_times(self) -> list[float | None]:
        """The last input to any terminal and the last output of each."""
        times = [_timestamp(self.settings.get("terminal_last_activity"))]
        manager = self.settings.get("terminal_manager")
        for terminal in getattr(manager, "terminals", {}).values():
            times.append(_timestamp(getattr(terminal, "last_activity", None)))
        return times

    def view(self, now: float) -> dict[str, Any]:
        """The session's activity as the ``slicebroker/activity`` route answers it."""
        started = _timestamp(self.settings.get("started")) or now
        kernels, busy, kernel_at = self._kernels()
        gpu_at = _timestamp(self.settings.get(GPU_SETTING))
        kept_at = _timestamp(self.settings.get(KEPT_SETTING))
        times = [kernel_at, gpu_at, kept_at, *self._terminal_times()]
        last = last_active(started, now, busy, times)
        reading = self.reading
        return {
            "now": now,
            "last_active": last,
            "idle_seconds": max(now - last, 0.0),
            "kernels": kernels,
            "kernels_busy": busy,
            "gpu_busy": reading is not None and reading.busy(self.busy_percent),
            "gpu_busy_at": gpu_at,
            "gpu_busy_percent": self.busy_percent,
            "gpu_sampled_at": self.sampled_at,
            "gpu": None if reading is None else reading.as_json(),
            "kept_at": kept_at,
        }


__all__ = ["GPU_SETTING", "KEPT_SETTING", "SessionActivity", "last_active"]
