"""This machine's GPUs as broker nodes, found with ``nvidia-smi`` (SPEC §9, embedded default).

``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader`` prints
one line per GPU::

    0, NVIDIA H100 80GB HBM3, 81559 MiB

:func:`parse_gpus` reads that text; :func:`local_nodes` groups the GPUs by
model into nodes (one node named after the host when all GPUs are alike, else
``<host>-<type>`` per model, with :func:`node_gpu_map` saying which of the
machine's GPUs each node's indices stand for); :func:`cluster_toml` writes a
broker configuration: the project tree and policy of a template file (the
demo's by default) with these nodes. MIG instances are not listed by this
query: declare MIG profiles in your own configuration file.

``python -m spawner.inventory [--template FILE]`` prints the configuration,
or says that no GPU was found (exit status 1).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.config import DEMO_CONFIG, parse_config

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"]
#: Seconds ``nvidia-smi`` may take.
QUERY_TIMEOUT_S = 20.0

_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_JOINED_PREFIXES = {"rtx", "gtx", "titan"}
_NAME_CHARS = re.compile(r"[^a-z0-9._-]+")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


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


def query_gpus(run: Callable[..., Any] = subprocess.run) -> str | None:
    """``nvidia-smi``'s answer, or ``None`` when it is missing or fails (no GPU, no driver)."""
    if run is subprocess.run and shutil.which(QUERY[0]) is None:
        return None
    try:
        done = run(QUERY, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout


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


def node_gpu_map(nodes: Sequence[LocalNode]) -> dict[str, list[int]]:
    """``SliceBrokerSpawner.node_gpus`` for ``nodes``: only nodes whose GPUs are not 0..n-1."""
    return {
        node.name: list(node.indices)
        for node in nodes
        if list(node.indices) != list(range(len(node.indices)))
    }


def cluster_toml(nodes: Sequence[LocalNode], template: str | Path = DEMO_CONFIG) -> str:
    """A broker configuration: ``template``'s projects and policy, with ``nodes`` as its nodes.

    GPU types of ``nodes`` missing from the template's ``[gpu_types]`` get
    weight 1.0. The result is checked with :func:`broker.config.parse_config`.
    """
    with open(template, "rb") as file:
        data = tomllib.load(file)
    weights = dict(data.get("gpu_types", {}))
    for node in nodes:
        weights.setdefault(node.gpu_type, 1.0)
    data["gpu_types"] = weights
    data["nodes"] = [
        {"name": node.name, "gpu_type": node.gpu_type, "gpus": len(node.indices)} for node in nodes
    ]
    parse_config(data, source="generated")  # raises InvalidConfig on a bad result
    header = (
        "# Generated by spawner.inventory from nvidia-smi: this machine's GPUs as broker nodes,\n"
        f"# with the projects and policy of {Path(template).name}.\n"
    )
    return header + dumps_toml(data)


def dumps_toml(data: Mapping[str, Any]) -> str:
    """TOML for the plain data of a configuration (tables, arrays of tables, scalars, lists)."""
    lines: list[str] = []
    _emit_table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _emit_table(table: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not _is_table(v) and not _is_table_array(v)}
    for key, value in scalars.items():
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in table.items():
        if _is_table(value):
            has_scalars = any(not _is_table(v) and not _is_table_array(v) for v in value.values())
            if has_scalars or not value:  # a table of tables only needs no header of its own
                lines.append("")
                lines.append(f"[{'.'.join(_key(p) for p in [*path, key])}]")
            _emit_table(value, [*path, key], lines)
        elif _is_table_array(value):
            for item in value:
                lines.append("")
                lines.append(f"[[{'.'.join(_key(p) for p in [*path, key])}]]")
                _emit_table(item, [*path, key], lines)


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML here has no place for {value!r}")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


@dataclass(frozen=True)
class Inventory:
    """What the embedded default runs on: a configuration file and the GPU map."""

    config_path: Path
    nodes: tuple[LocalNode, ...]  # empty: the declared demo inventory
    node_gpus: dict[str, list[int]]

    @property
    def discovered(self) -> bool:
        return bool(self.nodes)

    def describe(self) -> str:
        if not self.nodes:
            return (
                f"no GPU found with nvidia-smi: using the declared inventory in {self.config_path}"
            )
        parts = [
            f"{n.name}: {len(n.indices)} x {n.gpu_type} (GPUs {list(n.indices)})"
            for n in self.nodes
        ]
        return "GPUs found with nvidia-smi: " + "; ".join(parts)


def discover(
    out: str | Path,
    *,
    template: str | Path = DEMO_CONFIG,
    query: Callable[[], str | None] = query_gpus,
    host: str | None = None,
) -> Inventory:
    """Write the configuration for this machine's GPUs to ``out``, or fall back on ``template``.

    With no GPU (or no ``nvidia-smi``), nothing is written and the template
    itself (the demo's declared inventory by default) is the configuration.
    """
    text = query()
    gpus = parse_gpus(text) if text else []
    if not gpus:
        return Inventory(Path(template), (), {})
    nodes = local_nodes(gpus, host)
    out = Path(out)
    out.write_text(cluster_toml(nodes, template))
    return Inventory(out, tuple(nodes), node_gpu_map(nodes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spawner.inventory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--template", default=str(DEMO_CONFIG), help="projects and policy to keep")
    args = parser.parse_args(argv)
    text = query_gpus()
    gpus = parse_gpus(text) if text else []
    if not gpus:
        print("no GPU found with nvidia-smi", file=sys.stderr)
        return 1
    sys.stdout.write(cluster_toml(local_nodes(gpus), args.template))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
