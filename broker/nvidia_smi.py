"""This machine's GPUs as ``nvidia-smi`` lists them, grouped into broker nodes.

``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader`` prints
one line per GPU::

    0, NVIDIA H100 80GB HBM3, 81559 MiB

:func:`query_gpus` runs it, :func:`parse_gpus` reads its answer, and
:func:`local_nodes` groups the GPUs by model into nodes: one node named after
the host when all GPUs are alike, else ``<host>-<type>`` per model. MIG
instances are not listed by this query: declare MIG profiles in the cluster file.

Used by the broker's local inventory (:class:`broker.inventory.LocalInventory`)
and by the embedded default's cluster file (:mod:`spawner.inventory`).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
#: Seconds ``nvidia-smi`` may take.
QUERY_TIMEOUT_S = 20.0

_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_JOINED_PREFIXES = {"rtx", "gtx", "titan"}
_NAME_CHARS = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as ``nvidia-smi`` lists it."""

    index: int
    name: str
    memory_mib: int | None


@dataclass(frozen=True, slots=True)
class LocalNode:
    """A broker node made of this machine's GPUs of one type; ``indices`` are the
    machine's (``nvidia-smi``) indices of the node's GPUs 0, 1, ..."""

    name: str
    gpu_type: str
    indices: tuple[int, ...]


def run_query(
    arguments: Sequence[str],
    run: Callable[..., Any] = subprocess.run,
    *,
    program: str = QUERY[0],
) -> str | None:
    """``nvidia-smi``'s answer to ``arguments``, or ``None`` when it is missing or fails
    (no GPU, no driver).

    ``program``: the ``nvidia-smi`` to run (a name looked up on ``PATH``, or a path).
    """
    if run is subprocess.run and shutil.which(program) is None:
        return None
    try:
        done = run(
            [program, *arguments],
            capture_output=True,
            text=True,
            timeout=QUERY_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout


def query_gpus(run: Callable[..., Any] = subprocess.run, *, program: str = QUERY[0]) -> str | None:
    """The GPU list's answer (:data:`QUERY`), or ``None`` (see :func:`run_query`)."""
    return run_query(QUERY[1:], run, program=program)


def parse_gpus(text: str) -> list[Gpu]:
    """The GPUs in ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader``.

    Blank lines are skipped; a line that is not ``index, name, memory`` raises
    :class:`ValueError` naming it. Memory that is not ``<n> MiB`` (``[N/A]``) is ``None``.
    """
    gpus = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit():
            raise ValueError(
                f"line {number} of nvidia-smi's answer is not 'index, name, memory': {line!r}"
            )
        memory_text = fields[-1]
        name = ",".join(fields[1:-1]).strip()
        match = re.fullmatch(r"(\d+)\s*MiB", memory_text)
        gpus.append(Gpu(int(fields[0]), name, int(match.group(1)) if match else None))
    return gpus


def gpu_type_name(model: str) -> str:
    """A short GPU type for a model name: ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA A100-SXM4-40GB`` -> ``a100``, ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``."""
    words = [w for w in re.split(r"\s+", model.strip().lower()) if w and w not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    first = words[0]
    if first in _JOINED_PREFIXES and len(words) > 1:
        first += words[1]
    first = first.split("-")[0]
    return _NAME_CHARS.sub("", first) or "gpu"


def host_name(name: str | None = None) -> str:
    """A node name for this host: its short host name, in the broker's account characters."""
    raw = (name or socket.gethostname() or "localhost").split(".")[0].lower()
    return _NAME_CHARS.sub("-", raw).strip("-._") or "localhost"


def local_nodes(gpus: Sequence[Gpu], host: str | None = None) -> list[LocalNode]:
    """This machine's GPUs as nodes: one per GPU type, in order of first appearance."""
    host = host_name(host)
    by_type: dict[str, list[int]] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        by_type.setdefault(gpu_type_name(gpu.name), []).append(gpu.index)
    if len(by_type) == 1:
        ((gpu_type, indices),) = by_type.items()
        return [LocalNode(host, gpu_type, tuple(indices))]
    return [LocalNode(f"{host}-{t}", t, tuple(ix)) for t, ix in by_type.items()]
