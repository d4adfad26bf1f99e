"""Background work done in rounds: every ``interval`` seconds, or at once when woken,
and after a failure again only after an exponential backoff.

The Kubernetes drain reporter and the Slurm inventory, drain writer and job
executor all run this way; one round is their own, the loop around it is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass


@dataclass
class Backoff:
    """Exponential backoff between failed attempts (seconds)."""

    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0
    current: float = 0.0

    def next(self) -> float:
        self.current = (
            self.initial if not self.current else min(self.current * self.factor, self.maximum)
        )
        return self.current

    def reset(self) -> None:
        self.current = 0.0


class Rounds:
    """Runs :meth:`round_once` every :attr:`interval` seconds (or on :meth:`wake`) until
    cancelled. A round that raises is counted in :attr:`errors` and logged on ``log``
    as ``failure``; the next one waits :attr:`backoff` instead of the interval."""

    #: What the log says when a round fails, before the error and the pause.
    failure = "Round failed"

    def __init__(self, interval: float, backoff: Backoff, log: logging.Logger):
        self.interval = interval
        self.backoff = backoff
        self.errors = 0
        self._log = log
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Run the next round now (within the pause of a failure's backoff, too)."""
        self._wake.set()

    async def round_once(self) -> object:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            try:
                await self.round_once()
                self.backoff.reset()
                pause = self.interval
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.errors += 1
                pause = self.backoff.next()
                self._log.warning("%s (%s); retrying in %.1fs", self.failure, err, pause)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._wake.wait()
