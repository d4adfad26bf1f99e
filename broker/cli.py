"""The ``slicebroker`` command: one argparse subcommand per job.

A subcommand is a function that adds its parser to the subparsers and sets
``handler`` — a function of the parsed arguments returning the exit status —
listed in :data:`SUBCOMMANDS`. Errors a user can fix are one line on stderr
(``error: ...``) and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .config import ClusterConfig, load_config
from .errors import InvalidConfig

PROG = "slicebroker"
USAGE_ERROR = 2


class _UsageError(Exception):
    """A command line argparse rejected, already phrased as one line."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and do not exit the process."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# ---- check-config -----------------------------------------------------------


def add_check_config(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check-config",
        help="check a cluster configuration file and summarise it",
        description="Check a cluster configuration file (TOML) and print a summary: "
        "the project tree with each account's entitlement, and the GPUs by type. "
        "Exits 0 if the file is valid, 2 with one line on stderr if not.",
    )
    parser.add_argument("file", metavar="FILE", help="the configuration file to check")
    parser.set_defaults(handler=check_config)


def check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except InvalidConfig as err:
        print(f"error: {args.file}: {err}", file=sys.stderr)
        return USAGE_ERROR
    print(f"{args.file}: ok")
    print("\n".join(summarise(config)))
    return 0


def summarise(config: ClusterConfig) -> list[str]:
    """Lines describing ``config``: the project tree with entitlements, then GPUs by type."""
    tree = config.tree
    lines = ["projects (entitlement = fraction of the cluster):"]
    stack = [(name, 0) for name in reversed(tree.children.get(None, []))]
    while stack:
        name, depth = stack.pop()
        label = "  " * (depth + 1) + name
        line = f"{label:<30} {100 * tree.entitlements[name]:6.1f}%"
        if tree.is_project(name):
            line += _describe_members(config, name)
        lines.append(line.rstrip())
        stack.extend((child, depth + 1) for child in reversed(tree.children.get(name, [])))
    total = sum(node.gpu_count for node in config.nodes)
    lines.append(f"nodes: {len(config.nodes)}, GPUs: {total}")
    for gpu_type, weight in config.gpu_type_weights.items():
        nodes = [n for n in config.nodes if n.gpu_type == gpu_type]
        gpus = sum(n.gpu_count for n in nodes)
        lines.append(
            f"  {gpu_type:<16} {gpus:4d} GPUs on {len(nodes)} node{'s' * (len(nodes) != 1)}"
            f" (weight {weight:g})"
        )
    cap_text = ", ".join(f"{p} {c}" for p, c in config.policy.project_gpu_caps.items())
    if cap_text:
        lines.append(f"GPU caps: {cap_text}")
    if config.admins:
        lines.append(f"admins: {', '.join(sorted(config.admins))}")
    return lines


def _describe_members(config: ClusterConfig, project: str) -> str:
    members = config.members[project]
    parts = []
    if members.users:
        parts.append("users: " + ", ".join(sorted(members.users)))
    if members.groups:
        parts.append("groups: " + ", ".join(sorted(members.groups)))
    return "  " + "; ".join(parts) if parts else "  (no members)"


# ---- the command ------------------------------------------------------------

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_check_config]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="GPU broker for JupyterHub: GPU-time budgets, hierarchical fair share "
        "and contract-bound GPU slices.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``slicebroker`` with ``argv`` (default: the process's arguments); return the status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
