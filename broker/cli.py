"""The ``slicebroker`` command: one argparse subcommand per job.

A subcommand is a function that adds its parser to the subparsers and sets
``handler`` — a function of the parsed arguments returning the exit status —
listed in :data:`SUBCOMMANDS`. Errors are one line on stderr (``error: ...``),
never a traceback: exit status 2 for a command line to fix, 1 for what the
broker (or the database) answered or a broker that cannot be reached.

Most commands talk to a broker over its HTTP API (design.md §8), so they work from
anywhere: ``--url`` and ``--token`` default to the ``SLICEBROKER_URL`` and
``SLICEBROKER_TOKEN`` environment variables. ``upgrade-db`` and ``token``
(``create``, ``revoke``) work on the database directly; ``serve`` runs the broker.
``docs/admin.md`` is the reference, with examples.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from .batch import PROJECT_ENV, BatchError, BatchRequest, run_batch
from .budget import kept_to_end, preemptions_left
from .client import TOKEN_ENV, URL_ENV, BrokerAPIError, BrokerClient
from .config import DEMO_CONFIG, ClusterConfig, format_duration, load_config, parse_duration
from .errors import InvalidConfig
from .sim.cli import add_parser as add_simulate
from .units import HOUR, gpu_hours, share_used

PROG = "slicebroker"
USAGE_ERROR = 2
API_ERROR = 1
#: The status after the reader of the output went away, as a shell reports SIGPIPE.
BROKEN_PIPE = 128 + 13
DB_URL_ENV = "SLICEBROKER_DB_URL"
#: Retries of a request after a connection failure (0.25 s, then 0.5 s apart).
CLI_RETRIES = 2


class _UsageError(Exception):
    """A command line argparse rejected, already phrased as one line."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and do not exit the process."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


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
        return _fail(f"{args.file}: {err}", USAGE_ERROR)
    print(f"{args.file}: ok")
    print("\n".join(summarise(config)))
    return 0


def add_demo_config(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo-config",
        help="print the demo cluster's configuration file (a starting point)",
        description="Print the demo cluster's configuration file, as installed with "
        "slicebroker: one node of 8 H100 GPUs and a small project tree. Save it, edit it, "
        "check it with 'slicebroker check-config FILE'.",
    )
    parser.add_argument(
        "--path", action="store_true", help="print where the installed file is instead"
    )
    parser.set_defaults(handler=demo_config)


def demo_config(args: argparse.Namespace) -> int:
    if args.path:
        print(DEMO_CONFIG)
    else:
        sys.stdout.write(DEMO_CONFIG.read_text())
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


# ---- talking to the broker --------------------------------------------------

ApiWork = Callable[[BrokerClient, argparse.Namespace], Awaitable[int]]


def _api_command(
    commands: argparse._SubParsersAction, name: str, work: ApiWork, **kwargs: Any
) -> argparse.ArgumentParser:
    """A subcommand running ``work`` with a client of the broker ``--url``/``--token`` name."""
    parser = commands.add_parser(name, **kwargs)
    api = parser.add_argument_group("broker")
    api.add_argument(
        "--url",
        help=f"the broker's base URL (default: ${URL_ENV})",
    )
    api.add_argument(
        "--token",
        default=None,
        help=f"API token (default: ${TOKEN_ENV}; prefer the variable: arguments show in ps)",
    )
    api.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="give up on an unanswered request after this long (default: 30)",
    )
    parser.set_defaults(handler=lambda args: _run_api(work, args))
    return parser


def _run_api(work: ApiWork, args: argparse.Namespace) -> int:
    try:
        _check_url(args.url or os.environ.get(URL_ENV, ""))
        client = BrokerClient(args.url, args.token, timeout=args.timeout, retries=CLI_RETRIES)
    except ValueError as err:
        return _fail(f"{err} (see '{PROG} {args.command} --help')", USAGE_ERROR)

    async def session() -> int:
        try:
            return await work(client, args)
        finally:
            client.close()

    try:
        return asyncio.run(session())
    except BrokerAPIError as err:
        return _fail(_describe_api_error(err), API_ERROR)
    except BatchError as err:
        return _fail(str(err), err.status)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _check_url(url: str) -> None:
    """Raise :class:`ValueError` unless ``url`` (if given) is an http(s) URL with a host."""
    if not url:
        return  # the client says which variable to set
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"invalid broker URL {url!r}: expected http://HOST:PORT/ or https://HOST/PATH/"
        )


def _describe_api_error(err: BrokerAPIError) -> str:
    if not err.status:
        return err.message
    return f"{err.message} (HTTP {err.status}, {err.code})"


# ---- argument types ---------------------------------------------------------


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    return parse


def _names(text: str) -> list[str]:
    """A comma-separated list of names; the empty string is the empty list."""
    return [name.strip() for name in text.split(",") if name.strip()]


_DATE = re.compile(r"\d{4}-\d{2}-\d{2}([ T]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?([+-]\d{2}:?\d{2}|Z)?")


def parse_time(text: str, now: float | None = None) -> float:
    """Epoch seconds in ``text``: ``now``, a date and time (ISO 8601, local time unless it
    has an offset: ``2025-03-01``, ``2025-03-01T09:30``), a duration ago (``7d``,
    ``90m``: a unit is needed) or epoch seconds (a bare number).

    Raises :class:`ValueError` with a message fit for a user.
    """
    now = time.time() if now is None else now
    text = text.strip()
    if text == "now":
        return now
    if _DATE.fullmatch(text):
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.astimezone()  # local time
        return moment.timestamp()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return now - parse_duration(text)
    except ValueError:
        raise ValueError(
            f"invalid time {text!r}: expected 'now', a date such as 2025-03-01 or "
            "2025-03-01T09:30, a duration ago such as 7d or 12h, or epoch seconds"
        ) from None


def _time_arg(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# ---- output -----------------------------------------------------------------


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """Lines of an aligned table, columns two spaces apart.

    ``align`` has a letter per column, ``l`` (left, the default for columns it
    leaves out) or ``r`` (right, for numbers). Cells are turned into text with
    ``str``; ``None`` prints as ``-``.
    """
    cells = [list(header)] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = []
        for i, cell in enumerate(row):
            right = align[i : i + 1] == "r"
            parts.append(cell.rjust(widths[i]) if right else cell.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return lines


def _print(lines: Iterable[str]) -> None:
    for line in lines:
        print(line)


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _hours(gpu_seconds: float | None) -> str | None:
    """GPU-seconds as GPU-hours with two decimals, for tables: a column lines up."""
    return None if gpu_seconds is None else f"{gpu_seconds / HOUR:.2f}"


def _clock(epoch: float | None, now: float | None = None) -> str | None:
    """Local time of ``epoch``: ``HH:MM:SS`` today, ``YYYY-MM-DD HH:MM`` otherwise."""
    if epoch is None:
        return None
    now = time.time() if now is None else now
    moment = time.localtime(epoch)
    if time.strftime("%Y-%m-%d", moment) == time.strftime("%Y-%m-%d", time.localtime(now)):
        return time.strftime("%H:%M:%S", moment)
    return time.strftime("%Y-%m-%d %H:%M", moment)


def _span(seconds: float) -> str:
    """A rounded duration for people: ``45s``, ``12m``, ``3h5m``, ``2d4h``."""
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{round(seconds)}s"
    if seconds < 2 * HOUR:
        return f"{round(seconds / 60)}m"
    if seconds < 2 * 86400:
        return format_duration(round(seconds / 60) * 60)
    return format_duration(round(seconds / HOUR) * HOUR)


def _when(epoch: float | None, now: float) -> str | None:
    """When a future moment comes: ``in 5m (14:05:00)``, or ``now`` if it has passed."""
    if epoch is None:
        return None
    if epoch <= now:
        return "now"
    return f"in {_span(epoch - now)} ({_clock(epoch, now)})"


def _placements(slice_: Mapping[str, Any]) -> str | None:
    parts = [
        f"{p['node']}[{','.join(str(i) for i in p['gpu_indices'])}]"
        for p in slice_.get("placements") or []
    ]
    return " ".join(parts) or None


# ---- projects ---------------------------------------------------------------


def add_projects(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "projects",
        projects,
        help="show the project tree: shares, entitlements, usage, fair share",
        description="Show the project tree with each account's share, entitlement (its "
        "fraction of the cluster), usage in the lookback window (weighted GPU-hours), "
        "share used (its part of all GPU time used in the window over its entitlement: "
        "1.00× is exactly its share; lower is served first) and "
        "each project's rank (1 is served first), GPUs held and slices pending.",
    )
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead")


async def projects(client: BrokerClient, args: argparse.Namespace) -> int:
    rows = await client.projects()
    if args.json:
        _print_json(rows)
    else:
        _print(project_table(rows))
    return 0


def project_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``projects`` table: the tree (children indented under their parent)."""
    depth: dict[str, int] = {}
    cells = []
    for row in rows:
        level = depth[row["name"]] = depth.get(row["parent"], -1) + 1  # parents come first
        leaf = row["is_project"]
        cells.append(
            [
                "  " * level + row["name"],
                f"{row['share']:g}",
                f"{100 * row['entitlement']:.1f}%",
                _hours(row["usage"]),
                share_used(row["fairshare_value"], words=False),
                row["rank"] if leaf else "",
                row["gpus_held"] if leaf else "",
                row["pending"] if leaf else "",
                _members(row) if leaf else "",
            ]
        )
    header = ["ACCOUNT", "SHARE", "ENTITLEMENT", "USAGE GPU-h", "SHARE USED", "RANK", "HELD"]
    return table([*header, "PENDING", "MEMBERS"], cells, "lrrrrrrrl")


def _members(row: Mapping[str, Any]) -> str:
    parts = []
    if row.get("users"):
        parts.append("users " + ",".join(row["users"]))
    if row.get("groups"):
        parts.append("groups " + ",".join(row["groups"]))
    return "; ".join(parts) or "(none)"


def add_project(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "project",
        help="change an account of the project tree (admin)",
        description="Change the project tree (admin). The broker's database keeps the "
        "tree: changes last across restarts, and each is recorded ('slicebroker history').",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    put = _api_command(
        actions,
        "set",
        project_set,
        help="create an account or change its share, parent or members",
        description="Create an account, or change its share, parent or members. Every "
        "option is optional: what is left out keeps its value (a new account needs "
        "--share and goes at the top of the tree unless --parent names one). A change "
        "of share or parent moves entitlements: the command shows each account's "
        "entitlement before and after and asks before applying it (--yes applies without "
        "asking; without a terminal, --yes is needed). A change of members only is "
        "applied at once.",
    )
    put.add_argument("name", metavar="NAME", help="the account")
    put.add_argument(
        "--share",
        type=_positive_float,
        help="weight among its siblings (a number > 0; default: unchanged)",
    )
    where = put.add_mutually_exclusive_group()
    where.add_argument(
        "--parent",
        metavar="PARENT",
        type=_parent_name,
        help="move the account under PARENT (default: where it is)",
    )
    where.add_argument(
        "--top-level",
        action="store_true",
        help="move the account to the top of the tree, beside the other top-level accounts",
    )
    put.add_argument(
        "--users",
        type=_names,
        metavar="A,B",
        help="users who may charge the project, replacing the list ('' for none)",
    )
    put.add_argument(
        "--groups",
        type=_names,
        metavar="G,H",
        help="JupyterHub groups whose members may charge it, replacing the list ('' for none)",
    )
    for option, metavar, what in (
        ("--add-user", "USER", "add users (repeat it, or A,B)"),
        ("--remove-user", "USER", "remove users (repeat it, or A,B)"),
        ("--add-group", "GROUP", "add JupyterHub groups (repeat it, or G,H)"),
        ("--remove-group", "GROUP", "remove JupyterHub groups (repeat it, or G,H)"),
    ):
        put.add_argument(option, type=_names, action="append", metavar=metavar, help=what)
    confirm = put.add_mutually_exclusive_group()
    confirm.add_argument(
        "--yes", "-y", action="store_true", help="apply a change of entitlements without asking"
    )
    confirm.add_argument(
        "--dry-run", action="store_true", help="show what would change, change nothing"
    )
    put.set_defaults(check_args=_check_project_set)
    remove = _api_command(
        actions,
        "delete",
        project_delete,
        help="delete an account and its members",
        description="Delete an account and its members; its slices and charges stay in the "
        "history. Refused while it has sub-accounts or live slices.",
    )
    remove.add_argument("name", metavar="NAME", help="the account")


def _parent_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "'' is not an account: pass --top-level to move the account to the top of the tree"
        )
    return text.strip()


def _check_project_set(args: argparse.Namespace) -> None:
    """Refuse member options that contradict each other; flatten the repeated ones."""
    for key in ("add_user", "remove_user", "add_group", "remove_group"):
        setattr(args, key, [name for names in getattr(args, key) or [] for name in names])
    for kind in ("user", "group"):
        listed = getattr(args, f"{kind}s")
        added, removed = getattr(args, f"add_{kind}"), getattr(args, f"remove_{kind}")
        if listed is not None and (added or removed):
            raise _UsageError(
                f"--{kind}s replaces the list: give it, or --add-{kind}/--remove-{kind}, "
                f"not both (see '{PROG} project set --help')"
            )
        both = sorted(set(added) & set(removed))
        if both:
            raise _UsageError(f"{', '.join(both)}: both added and removed")


@dataclasses.dataclass(frozen=True)
class _AccountState:
    """What ``project set`` may change about one account."""

    share: float
    parent: str | None
    users: tuple[str, ...]
    groups: tuple[str, ...]


class _Refused(Exception):
    """A ``project set`` that cannot be applied as asked, in one line; nothing changed."""


def planned_account(
    rows: Sequence[Mapping[str, Any]], args: argparse.Namespace
) -> tuple[_AccountState | None, _AccountState]:
    """The account ``args.name`` now (``None`` if new) and as ``args`` would make it.

    Raises :class:`_Refused` for a new account without a share, a member to
    remove who is not one, or an unknown parent.
    """
    current = {row["name"]: row for row in rows}
    row = current.get(args.name)
    before = None if row is None else _state(row)
    if before is None and args.share is None:
        raise _Refused(f"no account {args.name!r}: a new account needs --share")
    base = before or _AccountState(args.share, None, (), ())
    parent = None if args.top_level else args.parent or base.parent
    if parent is not None and parent not in current:
        raise _Refused(f"no account {parent!r} to put {args.name!r} under")
    members = {}
    for kind in ("users", "groups"):
        names = list(getattr(base, kind))
        if getattr(args, kind) is not None:
            names = getattr(args, kind)
        singular = kind[:-1]
        for name in getattr(args, f"remove_{singular}"):
            if name not in names:
                raise _Refused(f"{name} is not one of the {kind} of {args.name!r}")
            names.remove(name)
        names += [n for n in getattr(args, f"add_{singular}") if n not in names]
        members[kind] = tuple(sorted(set(names)))
    after = _AccountState(
        base.share if args.share is None else args.share,
        parent,
        members["users"],
        members["groups"],
    )
    return before, after


def entitlements_after(
    rows: Sequence[Mapping[str, Any]], name: str, after: _AccountState
) -> dict[str, float]:
    """Every account's entitlement once ``name`` is ``after``, computed as the broker does.

    Raises :class:`_Refused` if the tree would not be valid (a cycle, say).
    """
    from .core.fairshare import entitlements_with
    from .core.model import Account

    accounts = [Account(row["name"], row["share"], row["parent"]) for row in rows]
    try:
        return entitlements_with(accounts, Account(name, after.share, after.parent))
    except InvalidConfig as err:
        raise _Refused(f"cannot change {name!r}: {err}") from None


def entitlement_preview(
    rows: Sequence[Mapping[str, Any]], name: str, after: Mapping[str, float]
) -> list[str]:
    """A table of the entitlements of ``name`` and of every account whose entitlement
    changes: before, after, the difference in percentage points."""
    from .core.fairshare import entitlement_moves

    before = {row["name"]: row["entitlement"] for row in rows}
    changed = entitlement_moves(before, after)
    order = [name] + [row["name"] for row in rows if row["name"] in changed - {name}]
    cells = []
    for account in order:
        old = before.get(account)
        cells.append(
            [
                account,
                "-" if old is None else f"{100 * old:.1f}%",
                f"{100 * after[account]:.1f}%",
                f"{100 * (after[account] - (old or 0.0)):+.1f}",
            ]
        )
    lines = table(["ACCOUNT", "BEFORE", "AFTER", "CHANGE (points)"], cells, "lrrr")
    unchanged = len(after) - len(order)
    if unchanged:
        lines.append(f"({unchanged} other account{'s' * (unchanged != 1)} unchanged)")
    return lines


def _describe_change(name: str, before: _AccountState | None, after: _AccountState) -> str:
    """One line: what changes about the account (``name: share 1 -> 3; users a -> a,b``)."""
    if before is None:
        return f"{name}: new account, share {after.share:g} {_where(after.parent)}"
    parts = []
    if before.share != after.share:
        parts.append(f"share {before.share:g} -> {after.share:g}")
    if before.parent != after.parent:
        parts.append(f"parent {before.parent or '(top)'} -> {after.parent or '(top)'}")
    for kind in ("users", "groups"):
        old, new = getattr(before, kind), getattr(after, kind)
        if old != new:
            parts.append(f"{kind} {','.join(old) or '(none)'} -> {','.join(new) or '(none)'}")
    return f"{name}: " + ("; ".join(parts) if parts else "no change")


class _NeedsYes(Exception):
    """Entitlements would change, nobody can be asked, and ``--yes`` was not given."""


def _confirmed(args: argparse.Namespace) -> bool:
    """Whether to apply a change of entitlements: ``--yes``, or a 'y' typed at the terminal.

    Raises :class:`_NeedsYes` when there is no terminal to ask at.
    """
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise _NeedsYes
    print("apply? [y/N] ", end="", flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


async def project_set(client: BrokerClient, args: argparse.Namespace) -> int:
    rows = await client.projects()
    try:
        before, after = planned_account(rows, args)
        moves = before is None or (before.share, before.parent) != (after.share, after.parent)
        entitlements = entitlements_after(rows, args.name, after) if moves else {}
    except _Refused as err:
        return _fail(str(err), USAGE_ERROR)
    print(_describe_change(args.name, before, after))
    if before == after:
        return 0
    if moves:
        _print(entitlement_preview(rows, args.name, entitlements))
    if args.dry_run:
        print("not applied (--dry-run)")
        return 0
    if moves:
        try:
            if not _confirmed(args):
                return _fail("not applied", API_ERROR)
        except _NeedsYes:
            return _fail(
                "not applied: entitlements would change; pass --yes to apply without asking",
                USAGE_ERROR,
            )
    members = {}
    if before is None or before.users != after.users:
        members["users"] = list(after.users)
    if before is None or before.groups != after.groups:
        members["groups"] = list(after.groups)
    row = await client.put_project(args.name, share=after.share, parent=after.parent, **members)
    line = (
        f"{row['name']}: share {row['share']:g} {_where(row.get('parent'))}, "
        f"entitlement {100 * row['entitlement']:.1f}%"
    )
    if row.get("is_project"):
        line += f"; members: {_members(row)}"
    print(line)
    return 0


async def project_delete(client: BrokerClient, args: argparse.Namespace) -> int:
    event = await client.delete_project(args.name)
    print(f"deleted {event['account']}: {_describe_state(event['before'])}")
    return 0


def _state(state: Mapping[str, Any]) -> _AccountState:
    """An account (a row of the tree, or a state of a project event) as ``project set`` sees it."""
    return _AccountState(
        state["share"],
        state["parent"],
        tuple(state.get("users", ())),
        tuple(state.get("groups", ())),
    )


def _where(parent: str | None) -> str:
    """Where an account is in the tree: ``under org`` or ``at the top``."""
    return f"under {parent}" if parent else "at the top"


def _describe_state(state: Mapping[str, Any]) -> str:
    """``share 1 under org; users a,b`` for an account state of the API."""
    parts = [f"share {state['share']:g} {_where(state['parent'])}"]
    for kind in ("users", "groups"):
        if state[kind]:
            parts.append(f"{kind} {','.join(state[kind])}")
    return "; ".join(parts)


def describe_tree_change(
    name: str, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> str:
    """One line for a change of an account: ``+`` added, ``-`` removed, ``~`` changed."""
    if after is None:
        return f"- {name}: removed ({_describe_state(before or {})})"
    if before is None:
        return f"+ {name}: new account, {_describe_state(after)}"
    return "~ " + _describe_change(name, _state(before), _state(after))


# ---- apply-config, history ---------------------------------------------------


def add_apply_config(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "apply-config",
        apply_config,
        help="make the broker's project tree and members those of a cluster file (admin)",
        description="Compare the project tree and members of a cluster file with the "
        "broker's (its database keeps them; the file only seeds them on the first start), "
        "show every account added (+), removed (-) or changed (~), and apply them after "
        "asking. Without a terminal, --yes is needed. Each change is recorded "
        "('slicebroker history'). Nodes and GPU types are not touched: the broker reads "
        "those from its file at every start.",
    )
    parser.add_argument("file", metavar="FILE", help="the cluster configuration file")
    confirm = parser.add_mutually_exclusive_group()
    confirm.add_argument("--yes", "-y", action="store_true", help="apply without asking")
    confirm.add_argument(
        "--dry-run", action="store_true", help="show the difference, change nothing"
    )


def _file_projects(config: ClusterConfig) -> list[dict[str, Any]]:
    """The file's accounts and members as ``PUT /projects`` takes them."""
    projects = []
    for account in config.accounts:
        members = config.members.get(account.name)
        projects.append(
            {
                "name": account.name,
                "share": account.share,
                "parent": account.parent,
                "users": sorted(members.users) if members else [],
                "groups": sorted(members.groups) if members else [],
            }
        )
    return projects


async def apply_config(client: BrokerClient, args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except InvalidConfig as err:
        return _fail(f"{args.file}: {err}", USAGE_ERROR)
    projects = _file_projects(config)
    planned = await client.apply_projects(projects, dry_run=True)
    changes = planned["changes"]
    if not changes:
        print(f"the broker's project tree already matches {args.file}")
        return 0
    for change in changes:
        print(describe_tree_change(change["account"], change["before"], change["after"]))
    count = f"{len(changes)} account{'s' * (len(changes) != 1)}"
    if args.dry_run:
        print(f"{count} would change; not applied (--dry-run)")
        return 0
    try:
        if not _confirmed(args):
            return _fail("not applied", API_ERROR)
    except _NeedsYes:
        return _fail("not applied: no terminal to ask at; pass --yes to apply", USAGE_ERROR)
    done = await client.apply_projects(projects)
    if done["changes"] != changes:
        print("note: the tree changed meanwhile; applied:")
        for change in done["changes"]:
            print(describe_tree_change(change["account"], change["before"], change["after"]))
    print(f"applied: {len(done['changes'])} account{'s' * (len(done['changes']) != 1)} changed")
    return 0


def add_history(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "history",
        history,
        help="show the changes of the project tree: who, when, what (admin)",
        description="Show every change of the project tree and its members, oldest first: "
        "when, who (an admin, or the cluster file that seeded the tree), the action (seed, "
        "set, apply, delete) and what changed.",
    )
    parser.add_argument("--project", metavar="P", help="only this account's changes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


async def history(client: BrokerClient, args: argparse.Namespace) -> int:
    events = await client.project_events(args.project)
    if args.json:
        _print_json(events)
        return 0
    rows = (
        (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["at"])),
            e["who"],
            e["action"],
            describe_tree_change(e["account"], e["before"], e["after"]),
        )
        for e in events
    )
    _print(table(("AT", "WHO", "ACTION", "CHANGE"), rows))
    return 0


# ---- nodes ------------------------------------------------------------------


def add_nodes(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "nodes",
        nodes,
        help="show the nodes: GPUs, GPUs held, state",
        description="Show every node: GPU type, GPUs, GPUs held, cost weight, state "
        "(ready, draining, drained, down), since when and why.",
    )
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead")


async def nodes(client: BrokerClient, args: argparse.Namespace) -> int:
    rows = await client.nodes()
    if args.json:
        _print_json(rows)
        return 0
    now = time.time()
    cells = [
        [
            node["name"],
            node["gpu_type"],
            node["gpu_count"],
            node["gpus_held"],
            f"{node['weight']:g}",
            node["state"],
            node.get("drained_by") or "-",  # who must put it back: an admin or the inventory
            _clock(node.get("state_changed_at"), now),
            node.get("state_reason") or "",
        ]
        for node in rows
    ]
    header = ["NODE", "TYPE", "GPUS", "HELD", "WEIGHT", "STATE", "BY", "SINCE", "REASON"]
    _print(table(header, cells, "llrrrl"))
    return 0


def add_node_actions(commands: argparse._SubParsersAction) -> None:
    for name, work, what in (
        ("drain", drain, "stop new grants on a node; it empties as contracts end (admin)"),
        ("undrain", undrain, "put a drained, draining or down node back in service (admin)"),
        ("down", down, "mark a node down: its slices end at once (admin)"),
    ):
        parser = _api_command(
            commands, name, work, help=what, description=what[0].upper() + what[1:] + "."
        )
        parser.add_argument("node", metavar="NODE", help="the node")
        if name != "undrain":
            parser.add_argument("--reason", help="why, for the record and repair automation")


async def drain(client: BrokerClient, args: argparse.Namespace) -> int:
    _print_node(await client.drain(args.node, args.reason))
    return 0


async def undrain(client: BrokerClient, args: argparse.Namespace) -> int:
    _print_node(await client.undrain(args.node))
    return 0


async def down(client: BrokerClient, args: argparse.Namespace) -> int:
    _print_node(await client.down(args.node, args.reason))
    return 0


def _print_node(node: Mapping[str, Any]) -> None:
    line = f"node {node['name']}: {node['state']}"
    if node.get("state_reason"):
        line += f" ({node['state_reason']})"
    if node["state"] == "draining" and node.get("gpus_held"):
        line += f"; {node['gpus_held']} GPUs still held, drained once they are given back"
    print(line)


# ---- slices -----------------------------------------------------------------


def add_queue(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "queue",
        queue,
        help="show the pending slices in the order they will be served",
        description="Show the pending slices in queue order, with each one's position, "
        "its project's share used (1.00× is exactly its share; lower is served first) and "
        "estimated "
        "start when the broker knows one.",
    )
    parser.add_argument("--project", help="only this project's slices")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead")


async def queue(client: BrokerClient, args: argparse.Namespace) -> int:
    rows = await client.list_slices(state="pending", project=args.project)
    rows.sort(key=lambda s: (s["queue_position"] is None, s["queue_position"] or 0, s["id"]))
    if args.json:
        _print_json(rows)
        return 0
    now = time.time()
    cells = [
        [
            s["queue_position"],
            s["id"],
            s["project"],
            s["user"],
            s["gpus"],
            s.get("gpu_type") or "any",
            s["kind"],
            format_duration(s["min_runtime"]),
            s["priority"],
            share_used(s.get("fairshare_value"), words=False),
            _span(now - s["submitted_at"]),
            _when(s.get("estimated_start"), now),
        ]
        for s in rows
    ]
    header = ["POS", "SLICE", "PROJECT", "USER", "GPUS", "TYPE", "KIND", "CONTRACT", "PRIO"]
    _print(table([*header, "SHARE USED", "WAITING", "EST. START"], cells, "rrllrlllrrrl"))
    return 0


def add_slices(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "slices",
        slices,
        help="list slices (live ones by default)",
        description="List slices, oldest first: state, placement, contract, charge so far.",
    )
    parser.add_argument(
        "--state",
        default="live",
        help="pending, granted, preempting, ended, live (not ended; the default) or all",
    )
    parser.add_argument("--user", help="only this user's slices")
    parser.add_argument("--project", help="only this project's slices")
    parser.add_argument("--json", action="store_true", help="print the API's JSON instead")


async def slices(client: BrokerClient, args: argparse.Namespace) -> int:
    state = None if args.state == "all" else args.state
    rows = await client.list_slices(state=state, project=args.project, user=args.user)
    if args.json:
        _print_json(rows)
        return 0
    budget = (await client.limits()).get("preemption_budget")
    now = time.time()
    cells = [
        [
            s["id"],
            s["project"],
            s["user"],
            s["gpus"],
            s["kind"],
            s["state"],
            _placements(s),
            format_duration(s["min_runtime"]),
            _clock(s.get("granted_at"), now),
            "to its end" if kept_to_end(s, budget) else _clock(s.get("protected_until"), now),
            _preempted(s, budget),
            _hours(s.get("charged_gpu_seconds")),
            s.get("end_reason") or s.get("preempt_reason"),
        ]
        for s in rows
    ]
    header = ["SLICE", "PROJECT", "USER", "GPUS", "KIND", "STATE", "PLACEMENT", "CONTRACT"]
    header += ["GRANTED", "PROTECTED UNTIL", "PREEMPTED", "CHARGED GPU-h", "REASON"]
    _print(table(header, cells, "rllrllllllrrl"))
    return 0


def _preempted(slice_: dict[str, Any], budget: int | None) -> str:
    """Times preempted, out of the budget where one applies: ``2 of 5``."""
    times = str(slice_.get("preemptions") or 0)
    return times if preemptions_left(slice_, budget) is None else f"{times} of {budget}"


def add_release(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "release",
        release,
        help="release a slice (or cancel a pending one)",
        description="Release a held slice, or cancel a pending one. Users may release "
        "their own slices; admins any.",
    )
    parser.add_argument("slice_id", metavar="ID", type=_whole(1), help="the slice")


async def release(client: BrokerClient, args: argparse.Namespace) -> int:
    slice_ = await client.release(args.slice_id)
    line = f"slice {slice_['id']}: {slice_['state']}"
    if slice_.get("end_reason"):
        line += f" ({slice_['end_reason']})"
    line += f", charged {gpu_hours(slice_.get('charged_gpu_seconds') or 0.0)}"
    print(line)
    return 0


def add_checkpoint(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "checkpoint",
        checkpoint,
        help="report that a slice's work is saved now",
        description="Tell the broker that the job or session holding a slice has just "
        "saved its work. Among otherwise equal victims the broker preempts the one with "
        "the least work since its grant or its last checkpoint first. Run it from a job "
        "right after it saves: 'slicebroker run' gives the job $SLICEBROKER_SLICE_ID.",
    )
    parser.add_argument(
        "slice_id",
        metavar="ID",
        type=_whole(1),
        nargs="?",
        help="the slice (default: $SLICEBROKER_SLICE_ID)",
    )


async def checkpoint(client: BrokerClient, args: argparse.Namespace) -> int:
    slice_id = args.slice_id
    if slice_id is None:
        given = os.environ.get("SLICEBROKER_SLICE_ID", "")
        if not given.isdigit():
            raise _UsageError("no slice: give its ID or set SLICEBROKER_SLICE_ID")
        slice_id = int(given)
    slice_ = await client.checkpoint(slice_id)
    recorded = _clock(slice_["checkpointed_at"], time.time())
    print(f"slice {slice_['id']}: checkpoint recorded at {recorded}")
    return 0


def add_sooner(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "sooner",
        sooner,
        help="what would start a waiting slice sooner",
        description="For a pending slice: fewer GPUs, another GPU type, a shorter "
        "protected period, a debug-length session or another of your projects, each "
        "with when the broker would start it and the GPU-hours its protection commits.",
    )
    parser.add_argument("slice_id", metavar="ID", type=_whole(1), help="the slice")
    parser.add_argument(
        "--take",
        metavar="N",
        type=_whole(1),
        help="withdraw the slice for the Nth alternative listed, in one step (the new "
        "slice keeps its place in the queue; whoever holds the old one follows it)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


#: How each kind of alternative reads, from the request's fields and the changed ones.
_ALTERNATIVE_WORDS = {
    "gpus": lambda f: f"{f['gpus']} GPU{'s' if f['gpus'] != 1 else ''}",
    "gpu_type": lambda f: f"{f['gpu_type']} GPUs",
    "min_runtime": lambda f: f"{format_duration(f['min_runtime'])} protection",
    "debug": lambda f: f"a {format_duration(f['min_runtime'])} debug session",
    "project": lambda f: f"charged to {f['project']}",
}


def _about(seconds: float) -> str:
    """A wait as a person says it: to the minute, or the hour past three hours."""
    minutes = max(1, round(seconds / 60))
    if minutes < 180:
        return format_duration(60 * minutes)
    return format_duration(3600 * round(minutes / 60))


async def sooner(client: BrokerClient, args: argparse.Namespace) -> int:
    found = await client.alternatives(args.slice_id)
    if args.take is not None:
        return await _take_alternative(client, args, found["alternatives"])
    if args.json:
        _print_json(found)
        return 0
    now = found["now"]
    if not found["alternatives"]:
        print(f"slice {args.slice_id}: nothing would start it sooner")
        return 0
    cells = [
        [
            _ALTERNATIVE_WORDS[a["change"]](a["fields"]),
            "now" if a["starts_at"] <= now else f"in about {_about(a['starts_at'] - now)}",
            f"{a['gpu_hours']:.2f}",
        ]
        for a in found["alternatives"]
    ]
    _print(table(["#", "INSTEAD", "STARTS", "PROTECTED GPU-h"], numbered(cells), "rllr"))
    return 0


def numbered(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` with their number in front, from 1 (what ``--take N`` names)."""
    return [[str(n), *row] for n, row in enumerate(rows, start=1)]


async def _take_alternative(
    client: BrokerClient, args: argparse.Namespace, alternatives: list[dict[str, Any]]
) -> int:
    """Replace the slice with its ``--take``-th alternative; one line, or an error."""
    if not alternatives:
        raise _UsageError(f"slice {args.slice_id}: nothing would start it sooner; nothing taken")
    if args.take > len(alternatives):
        raise _UsageError(
            f"slice {args.slice_id} has {len(alternatives)} alternative"
            f"{'s' if len(alternatives) != 1 else ''}; --take {args.take} names none"
        )
    chosen = alternatives[args.take - 1]
    new = await client.replace(args.slice_id, chosen["fields"])
    if args.json:
        _print_json(new)
        return 0
    print(
        f"slice {args.slice_id} withdrawn for slice {new['id']}: "
        f"{_ALTERNATIVE_WORDS[chosen['change']](chosen['fields'])}, {new['state']}"
    )
    return 0


# ---- usage ------------------------------------------------------------------


def add_usage(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "usage",
        usage,
        help="report a project's charged usage over a period",
        description="Report the charged usage of a project (with its sub-accounts) over "
        "[since, until), per user or per project, in GPU-hours (plain and weighted by "
        "GPU type). Times are 'now', a date or date and time (2025-03-01, "
        "2025-03-01T09:30; local time unless an offset is given), a duration ago (7d, "
        "12h) or epoch seconds.",
    )
    parser.add_argument("project", metavar="PROJECT", help="a project or parent account")
    parser.add_argument(
        "--since", type=_time_arg, help="start of the period (default: the lookback window)"
    )
    parser.add_argument("--until", type=_time_arg, help="end of the period (default: now)")
    parser.add_argument(
        "--by", choices=("user", "project"), default="user", help="rows per (default: user)"
    )
    parser.add_argument(
        "--csv", action="store_true", help="print CSV (GPU-seconds, epoch times) as the API does"
    )


async def usage(client: BrokerClient, args: argparse.Namespace) -> int:
    if args.csv:
        text = await client.usage(
            args.project, since=args.since, until=args.until, by=args.by, format="csv"
        )
        sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        return 0
    # The period is fixed here so that the title can show it even when no row does.
    until = time.time() if args.until is None else args.until
    answer = await client.usage(args.project, since=args.since, until=until, by=args.by)
    _print(usage_table(answer, by=args.by, since=args.since, until=until))
    return 0


def usage_table(
    answer: Mapping[str, Any], *, by: str, since: float | None = None, until: float | None = None
) -> list[str]:
    """The ``usage`` report: a title line with the period, then one row per project (and user).

    The period is the rows' own; with no rows, ``since`` (``None``: the lookback
    window) and ``until``, the period asked for.
    """
    rows = answer["usage"]
    title = f"usage of {answer['project']}"
    if rows:
        since, until = rows[0]["since"], rows[0]["until"]
    if since is not None:
        title += f" from {_clock(since, 0)}"
    else:
        title += " in the lookback window"
    if until is not None:
        title += f" to {_clock(until, 0)}"
    lines = [title]
    names = ["project", "user"] if by == "user" else ["project"]
    cells = [
        [
            *(row[n] for n in names),
            row["slices"],
            _hours(row["gpu_seconds"]),
            _hours(row["weighted_gpu_seconds"]),
        ]
        for row in rows
    ]
    total = [
        sum(row["slices"] for row in rows),
        _hours(sum(row["gpu_seconds"] for row in rows)),
        _hours(sum(row["weighted_gpu_seconds"] for row in rows)),
    ]
    cells.append(["total", *[""] * (len(names) - 1), *total])
    header = [n.upper() for n in names] + ["SLICES", "GPU-h", "WEIGHTED GPU-h"]
    lines += table(header, cells, "l" * len(names) + "rrr")
    return lines


# ---- run --------------------------------------------------------------------


def add_run(commands: argparse._SubParsersAction) -> None:
    parser = _api_command(
        commands,
        "run",
        run,
        help="run a command on a batch slice: queue, run, heartbeat, requeue",
        description="Request a batch slice, wait in the queue (printing position, "
        "fair-share value and estimated start when they change), then run CMD with "
        "CUDA_VISIBLE_DEVICES set to the granted GPUs. On preemption CMD gets SIGTERM at "
        "once and SIGKILL at the deadline; with --resumable the request queues again and "
        "CMD runs again. Exits with CMD's status. Terms not given are the cluster's "
        "[defaults.batch]. See docs/batch.md.",
        usage=f"{PROG} run [--project P] [--gpus N] [--min-runtime DURATION] [options] -- CMD...",
    )
    parser.add_argument(
        "--project",
        default=os.environ.get(PROJECT_ENV) or None,
        help=f"the project to charge (default: ${PROJECT_ENV}, the project of the session "
        "you run in)",
    )
    parser.add_argument("--gpus", type=_whole(1), default=1, help="how many GPUs (default: 1)")
    parser.add_argument(
        "--min-runtime",
        type=_duration,
        metavar="DURATION",
        help="protected period: seconds or 15m, 2h, ... (0: free but preemptible any time; "
        "default: the cluster's [defaults.batch] min_runtime)",
    )
    parser.add_argument(
        "--max-runtime", type=_duration, metavar="DURATION", help="hard end (default: none)"
    )
    parser.add_argument("--gpu-type", help="the GPU type (default: any)")
    parser.add_argument(
        "--priority", type=int, help="order among your project's own requests (default: 0)"
    )
    parser.add_argument(
        "--resumable",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after a preemption, queue again and run CMD again (it resumes from its "
        "checkpoint); --no-resumable: never (default: the cluster's [defaults.batch])",
    )
    parser.add_argument(
        "--grace-kill",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="SIGTERM to SIGKILL when the broker sets no deadline: the runner interrupted, "
        "the slice ended (default: 10)",
    )
    parser.add_argument(
        "--poll",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="longest wait between two looks at the queue figures (default: 10)",
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="run CMD as a Slurm job step (srun) pinned to the granted node and GPUs, in the "
        "broker's partition; see docs/slurm.md",
    )
    parser.add_argument(
        "--slurm-partition",
        default="slicebroker",
        metavar="PARTITION",
        help="the Slurm partition the broker owns, for --slurm (default: slicebroker)",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command")
    parser.set_defaults(check_args=_check_run)


async def run(client: BrokerClient, args: argparse.Namespace) -> int:
    request = BatchRequest(
        project=args.project,
        gpus=args.gpus,
        min_runtime=args.min_runtime,
        max_runtime=args.max_runtime,
        gpu_type=args.gpu_type,
        priority=args.priority,
        resumable=args.resumable,
    )
    command = args.cmd
    if args.slurm:
        partition = f"--partition={args.slurm_partition}"
        srun = [sys.executable, "-m", "broker.slurm.srun", partition, "--"]
        command = [*srun, *command]
    return await run_batch(client, request, command, grace_kill=args.grace_kill, poll=args.poll)


def _check_run(args: argparse.Namespace) -> None:
    """Take CMD from after ``--``; a usage error if there is none, or no project."""
    if args.cmd[:1] == ["--"]:
        args.cmd = args.cmd[1:]
    if not args.cmd:
        raise _UsageError(f"no command to run (see '{PROG} run --help')")
    if not args.project:
        raise _UsageError(
            f"no project: pass --project P (in a hub session, ${PROJECT_ENV} names the "
            "session's project)"
        )


# ---- local commands: database, tokens, the service --------------------------


def add_upgrade_db(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "upgrade-db",
        help="create or migrate the broker's database schema",
        description="Create the broker's database schema, or migrate it to this version "
        "of slicebroker. Back the database up first. See docs/persistence.md.",
    )
    _db_option(parser)
    parser.set_defaults(handler=upgrade_db)


def _db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=os.environ.get(DB_URL_ENV),
        metavar="URL",
        help=f"database URL: sqlite:///FILE or postgresql://... (default: ${DB_URL_ENV})",
    )


def _need_db(args: argparse.Namespace) -> str:
    if not args.db:
        raise _UsageError(f"no database: pass --db URL or set {DB_URL_ENV}")
    return args.db


def _sqlite_file(url: str) -> Path | None:
    """The file of a SQLite database URL; ``None`` for other databases, in memory or a bad URL."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:
        return None  # opening it will say what is wrong
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)


def _database_problem(url: str, *, must_exist: bool, create_hint: bool = False) -> str | None:
    """Why the database at ``url`` should not be opened, in one line, or ``None``.

    SQLite creates a missing file on first use, so a mistyped path would
    silently become a new, empty database: with ``must_exist`` a missing file
    is refused (``create_hint``: say that ``--create`` makes one). A missing
    directory is refused always: SQLite's own message does not name it.
    """
    file = _sqlite_file(url)
    if file is None:
        return None
    if not file.parent.is_dir():
        return f"cannot open {_safe_url(url)}: the directory {file.parent} does not exist"
    if must_exist and not file.exists():
        hint = ", or pass --create to make a new one" if create_hint else ""
        return f"no database at {file}: check the path{hint}"
    return None


def _has_schema(url: str) -> bool:
    """Whether the database at ``url`` was ever migrated (holds a slicebroker schema)."""
    from .orm import current_revision, make_engine

    engine = make_engine(url)
    try:
        return current_revision(engine) is not None
    finally:
        engine.dispose()


def upgrade_db(args: argparse.Namespace) -> int:
    from .orm import DatabaseSchemaError, DatabaseTooNew, check_schema, head_revision, make_engine
    from .orm import upgrade_db as upgrade

    url = _need_db(args)
    problem = _database_problem(url, must_exist=False)
    if problem:
        return _fail(problem, USAGE_ERROR)
    try:
        engine = make_engine(url)
        try:
            check_schema(engine)
        except DatabaseTooNew as err:  # migrating would fail on a revision it cannot find
            return _fail(str(err), API_ERROR)
        except DatabaseSchemaError:
            pass  # blank or older: what upgrading is for
        finally:
            engine.dispose()
        upgrade(url)
    except Exception as err:  # a wrong URL, an unreachable server
        return _fail(f"cannot upgrade {_safe_url(url)}: {_first_line(err)}", API_ERROR)
    print(f"{_safe_url(url)}: schema at revision {head_revision()}")
    return 0


def add_token(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "token",
        help="manage the broker's own API tokens (standalone mode)",
        description="Manage the broker's own API tokens, in its database.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser(
        "create",
        help="create a token and print it",
        description="Create an API token for a user and print it (only the token, once: "
        "the database keeps a hash).",
    )
    create.add_argument("--user", required=True, help="whom the token speaks for")
    create.add_argument("--admin", action="store_true", help="an admin token")
    create.add_argument(
        "--agent",
        action="store_true",
        help="an agent token (a service acting for users, such as the spawner)",
    )
    create.add_argument(
        "--create",
        action="store_true",
        help="create the database (and its schema) if it does not exist; without it a "
        "missing database is refused, so that a mistyped path does not make a new one",
    )
    _db_option(create)
    create.set_defaults(handler=_token_action("create a token", token_create))
    listing = actions.add_parser(
        "list",
        help="list the tokens (never their secrets)",
        description="List the broker's own API tokens: number, user, kind (user or agent), "
        "whether admin, when created. The secrets are not stored, so never shown.",
    )
    listing.add_argument("--user", help="only this user's tokens")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _db_option(listing)
    listing.set_defaults(handler=_token_action("list tokens", token_list))
    revoke = actions.add_parser(
        "revoke",
        help="revoke a token, or every token of a user",
        description="Revoke one API token (by its text, or by the number 'token list' shows), "
        "or with --user every token of a user. A running broker stops accepting it within "
        "its token cache time (5 s by default). Exits 1 if there is no such token.",
        usage=f"{PROG} token revoke (TOKEN | --id N | --user USER) [--db URL]",
    )
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("token", nargs="?", metavar="TOKEN", help="the token, as created")
    which.add_argument("--id", type=_whole(1), help="the token numbered N in 'token list'")
    which.add_argument("--user", help="revoke every token of this user instead")
    _db_option(revoke)
    revoke.set_defaults(handler=_token_action("revoke tokens", token_revoke))


TokenWork = Callable[[ModuleType, argparse.Namespace, str], int]


def _token_action(doing: str, work: TokenWork) -> Callable[[argparse.Namespace], int]:
    """A handler running ``work(auth, args, url)`` on ``--db``; a failure is one line, status 1.

    ``auth`` is :mod:`broker.service.auth`; ``doing`` words the failure: ``cannot DOING in URL``.
    """

    def handler(args: argparse.Namespace) -> int:
        url = _need_db(args)
        create = getattr(args, "create", False)
        problem = _database_problem(url, must_exist=not create, create_hint=hasattr(args, "create"))
        if problem:
            return _fail(problem, USAGE_ERROR)
        try:
            from .service import auth
        except ImportError as err:
            return _fail(f"the broker service is not installed: {err}", API_ERROR)
        try:
            if not create and not _has_schema(url):
                hint = " or pass --create" if hasattr(args, "create") else ""
                return _fail(
                    f"{_safe_url(url)} is not a slicebroker database: check the URL, "
                    f"run '{PROG} upgrade-db'{hint}",
                    USAGE_ERROR,
                )
            return work(auth, args, url)
        except BrokenPipeError:
            raise  # the reader is gone: main() ends quietly
        except Exception as err:  # a wrong URL, an unmigrated database
            return _fail(f"cannot {doing} in {_safe_url(url)}: {_first_line(err)}", API_ERROR)

    return handler


def token_create(auth: ModuleType, args: argparse.Namespace, url: str) -> int:
    """Print a new token for ``--user``."""
    print(auth.create_token(url, args.user, admin=args.admin, agent=args.agent))
    return 0


def token_list(auth: ModuleType, args: argparse.Namespace, url: str) -> int:
    """Print the tokens (of ``--user``): number, user, kind, admin, created."""
    tokens = auth.list_tokens(url, args.user)
    if args.json:
        _print_json([dataclasses.asdict(t) for t in tokens])
        return 0
    rows = (
        (
            t.id,
            t.user,
            "agent" if t.agent else "user",
            "yes" if t.admin else "no",
            _clock(t.created_at),
        )
        for t in tokens
    )
    _print(table(("ID", "USER", "KIND", "ADMIN", "CREATED"), rows, "r"))
    return 0


def token_revoke(auth: ModuleType, args: argparse.Namespace, url: str) -> int:
    """Revoke TOKEN or token ``--id`` (status 1 if there is none such), or every
    token of ``--user``."""
    if args.user is not None:
        count = auth.revoke_user_tokens(url, args.user)
        print(f"revoked {count} token{'s' * (count != 1)} of {args.user}")
    elif args.id is not None:
        if not auth.revoke_token_id(url, args.id):
            return _fail(f"no token {args.id} in {_safe_url(url)}", API_ERROR)
        print(f"revoked token {args.id}")
    elif auth.revoke_token(url, args.token):
        print("revoked 1 token")
    else:
        return _fail(f"no such token in {_safe_url(url)}", API_ERROR)
    return 0


def add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        add_help=False,
        help="run the broker's HTTP service (options: slicebroker serve --help)",
        description="Run the broker's HTTP service; every argument goes to it.",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=serve, passes_unknown=True)


def serve(args: argparse.Namespace) -> int:
    try:
        from .service.app import main as service_main
    except ImportError as err:
        return _fail(f"the broker service is not installed: {err}", API_ERROR)
    return service_main(args.argv)


def add_generate_config(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate-config",
        add_help=False,
        help="write slicebroker_config.py, every option of serve with its help "
        "(options: slicebroker generate-config --help)",
        description="Write an options file for serve; every argument goes to it.",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=generate_config, passes_unknown=True)


def generate_config(args: argparse.Namespace) -> int:
    from .service.app import generate_config as write_options

    return write_options(args.argv)


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "the database"


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


# ---- the command ------------------------------------------------------------

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_check_config,
    add_demo_config,
    add_projects,
    add_project,
    add_apply_config,
    add_history,
    add_nodes,
    add_node_actions,
    add_queue,
    add_slices,
    add_release,
    add_checkpoint,
    add_sooner,
    add_usage,
    add_run,
    add_upgrade_db,
    add_token,
    add_serve,
    add_generate_config,
    add_simulate,
]


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


def _quiet_library_logs() -> None:
    """Keep the library's log lines (a retry, say) off stderr: errors are one line here."""
    logger = logging.getLogger("broker")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``slicebroker`` with ``argv`` (default: the process's arguments); return the status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_library_logs()
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if getattr(args, "passes_unknown", False):
            args.argv = argv[argv.index(args.command) + 1 :]
        elif unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if hasattr(args, "check_args"):
            args.check_args(args)
        status = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except _UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The status after the reader of standard output went away (``| head``): quiet.

    What is still buffered goes nowhere, as for any command killed by SIGPIPE.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # standard output is not a file (inside a test): nothing will flush to it
    return BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())
