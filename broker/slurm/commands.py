"""Slurm's own commands, run as subprocesses: what the broker reads and asks of Slurm.

:class:`SlurmCommands` reads the nodes (``sinfo --json``) and the jobs
(``squeue --json``), and changes them (``scontrol update``, ``scancel``). Every
command runs with a timeout and ``SLURM_CONF`` (when set) in its environment;
one that fails, times out or prints no JSON raises :class:`SlurmError` with
Slurm's own message, and the callers retry on their next round: Slurm's
controller may be restarting.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any


class SlurmError(Exception):
    """A Slurm command failed (Slurm's message), timed out, or is not installed."""


class SlurmCommands:
    """Runs Slurm's commands; ``slurm_conf`` (a path, empty: Slurm's default) and
    ``timeout`` (seconds per command) apply to each."""

    def __init__(self, slurm_conf: str = "", timeout: float = 20.0):
        self.env = {**os.environ, **({"SLURM_CONF": slurm_conf} if slurm_conf else {})}
        self.timeout = timeout

    async def run(self, *argv: str) -> str:
        """``argv``'s standard output; :class:`SlurmError` unless it exits 0 in time."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as err:
            raise SlurmError(f"cannot run {argv[0]}: {err}") from None
        try:
            async with asyncio.timeout(self.timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SlurmError(f"{argv[0]} did not answer within {self.timeout:g} s") from None
        if proc.returncode != 0:
            message = err.decode(errors="replace").strip() or f"exit status {proc.returncode}"
            raise SlurmError(f"{' '.join(argv[:2])}: {message}")
        return out.decode(errors="replace")

    async def _json(self, *argv: str) -> dict[str, Any]:
        text = await self.run(*argv)
        try:
            return json.loads(text)
        except ValueError:
            raise SlurmError(f"{argv[0]} --json printed no JSON: {text[:200]!r}") from None

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node as ``sinfo --json`` shows it."""
        return (await self._json("sinfo", "--json")).get("nodes") or []

    async def jobs(self, partition: str = "") -> list[dict[str, Any]]:
        """The jobs Slurm still shows (running, pending, and ended ones for ``MinJobAge``),
        of ``partition`` if given, as ``squeue --json`` shows them."""
        argv = ["squeue", "--json", "--states=all"]
        if partition:
            argv.append(f"--partition={partition}")
        return (await self._json(*argv)).get("jobs") or []

    async def drain(self, node: str, reason: str) -> None:
        await self.run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")

    async def resume(self, node: str) -> None:
        await self.run("scontrol", "update", f"nodename={node}", "state=RESUME")

    async def signal(self, job_id: int, signal: str, *, scope: str) -> None:
        """Send ``signal`` to the job: ``full`` every process of a batch job, ``batch`` its
        batch script only, ``steps`` its job steps (a job ``srun`` made has no script)."""
        scopes = {"full": ["--full"], "batch": ["--batch"], "steps": []}
        await self.run("scancel", f"--signal={signal}", *scopes[scope], str(job_id))

    async def cancel(self, job_id: int) -> None:
        await self.run("scancel", str(job_id))


__all__ = ["SlurmCommands", "SlurmError"]
