"""The cluster configuration file (design.md §2–§6): GPU types, nodes, the project tree, policy.

The file is TOML, read with the standard library. :func:`load_config` reads a
file and :func:`parse_config` checks an already-parsed mapping; both answer with
a :class:`ClusterConfig` or raise :class:`~broker.errors.InvalidConfig` whose
``where`` is the dotted key path of the first mistake (``projects.nlp.share``,
``nodes[2].gpus``) and whose message says what was expected. Unknown keys are
errors, so typos never pass silently.

``docs/configuration.md`` describes every key; ``broker/demo.toml`` is a worked example.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .core.fairshare import ProjectTree
from .core.model import DAY, HOUR, Account, Contract, Node, Policy, SliceKind
from .errors import InvalidConfig

log = logging.getLogger(__name__)

DEMO_CONFIG = Path(__file__).with_name("demo.toml")
"""The demo cluster shipped with the package: one node of 8 H100s and a 3-level tree."""


# ---- durations ------------------------------------------------------------

_UNITS = {"s": 1.0, "m": 60.0, "h": HOUR, "d": DAY, "w": 7 * DAY}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_SECONDS_TEXT = re.compile(rf"\s*{_NUMBER}\s*")
_DURATION_TEXT = re.compile(rf"(?:\s*{_NUMBER}\s*[smhdw])+\s*", re.IGNORECASE)
_DURATION_PART = re.compile(rf"({_NUMBER})\s*([smhdw])", re.IGNORECASE)
_DURATION_HELP = (
    "expected seconds (a number) or a string such as '90s', '15m', '2h', '7d' or '1h30m'"
)


def parse_duration(value: object) -> float:
    """Seconds in ``value``: a number of seconds, or text such as ``"90s"``, ``"15m"``, ``"1h30m"``.

    Units: ``s`` seconds, ``m`` minutes, ``h`` hours, ``d`` days, ``w`` weeks;
    a bare number (or numeric text) is seconds. Raises :class:`ValueError`, with a
    message fit to show a user, for anything else, negative or infinite values
    included; callers turn it into their own named error.
    """
    if isinstance(value, str):
        if _SECONDS_TEXT.fullmatch(value):
            seconds = float(value)
        elif _DURATION_TEXT.fullmatch(value):
            seconds = sum(
                float(number) * _UNITS[unit.lower()]
                for number, unit in _DURATION_PART.findall(value)
            )
        else:
            raise ValueError(f"invalid duration {value!r}: {_DURATION_HELP}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"expected a duration, got {_describe(value)}: {_DURATION_HELP}")
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be finite, got {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration must not be negative, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """``seconds`` as :func:`parse_duration` reads it: 28800 -> ``"8h"``, 5400 -> ``"1h30m"``."""
    if not math.isfinite(seconds) or seconds < 0 or seconds != int(seconds):
        return f"{seconds:g}s"
    rest = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


# ---- the parsed configuration -----------------------------------------------


@dataclass(frozen=True, slots=True)
class Members:
    """Who may charge a project: named users, and members of named JupyterHub groups."""

    users: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()

    def admits(self, user: str, groups: Iterable[str] = ()) -> bool:
        """Whether ``user``, a member of ``groups``, may charge the project."""
        return user in self.users or not self.groups.isdisjoint(groups)


@dataclass(frozen=True, slots=True)
class KindDefaults:
    """The contract a slice of one kind gets when its request leaves a term out (design.md §3)."""

    min_runtime: float
    resumable: bool
    max_runtime: float | None = None

    def contract(self) -> Contract:
        return Contract(self.min_runtime, self.resumable, self.max_runtime)


BUILTIN_DEFAULTS: Mapping[SliceKind, KindDefaults] = MappingProxyType(
    {
        SliceKind.INTERACTIVE: KindDefaults(min_runtime=HOUR, resumable=False),
        SliceKind.BATCH: KindDefaults(min_runtime=2 * HOUR, resumable=True),
    }
)
"""Contract defaults per kind when the file has no ``[defaults.<kind>]`` table (or key)."""


@dataclass(frozen=True)
class ClusterConfig:
    """A checked cluster configuration. ``members`` has an entry for every project (leaf)."""

    accounts: tuple[Account, ...]
    tree: ProjectTree = field(compare=False)
    members: Mapping[str, Members]
    nodes: tuple[Node, ...]
    gpu_type_weights: Mapping[str, float]
    policy: Policy
    defaults: Mapping[SliceKind, KindDefaults]
    admins: frozenset[str] = frozenset()
    source: str = "<config>"

    def projects_for(self, user: str, groups: Iterable[str] = ()) -> tuple[str, ...]:
        """The projects ``user`` (a member of ``groups``) may charge, by name."""
        groups = frozenset(groups)
        return tuple(name for name in self.tree.projects if self.members[name].admits(user, groups))

    def is_admin(self, user: str) -> bool:
        return user in self.admins


# ---- reading ----------------------------------------------------------------

_TOP_KEYS = ("admins", "policy", "defaults", "gpu_types", "nodes", "projects")
_POLICY_KEYS = (
    "window",
    "half_life",
    "max_min_runtime",
    "grace_period",
    "debug_max_gpus",
    "debug_max_min_runtime",
    "debug_lane_fraction",
    "debug_headroom",
    "debug_first",
    "max_reservations",
    "preemption_backoff",
    "preemption_budget",
    "fair_share_margin",
    "batch_preemption_delay",
    "interactive_preemption_delay",
    "debug_preemption_delay",
    "debug_grace_period",
    "lease_lapse_floor",
    "lease_lapse_fraction",
    "project_gpu_caps",
)
# Policy durations and whether zero is allowed.
_POLICY_DURATIONS = {
    "window": False,
    "half_life": False,
    "max_min_runtime": False,
    "grace_period": True,
    "debug_max_min_runtime": False,
    "batch_preemption_delay": True,
    "interactive_preemption_delay": True,
    "debug_preemption_delay": True,
    "debug_grace_period": True,
}
# Policy numbers up to 1: what each is, what is expected of one above 1, and
# whether zero is allowed.
_POLICY_UP_TO_ONE = {
    "fair_share_margin": (
        "a margin in shares",
        "a margin in shares from 0 to 1 (0: off, 0.5: half a share)",
        True,
    ),
    "debug_lane_fraction": (
        "a fraction in (0, 1]",
        "a fraction of the cluster in (0, 1] (0.05 is 5%)",
        False,
    ),
    "lease_lapse_fraction": (
        "a fraction in [0, 1]",
        "a fraction of the leased slices per minute in [0, 1] (0.05 is 5%)",
        True,
    ),
}
# Keys an earlier release read and this one ignores, with why: a file that has
# them still loads, with a warning.
_RETIRED_POLICY_KEYS = {
    "fairshare_horizon": "fair-share preemption is now judged on the GPUs projects hold "
    "now (docs/policy.md); the key has no effect",
}
_DEFAULTS_KEYS = ("min_runtime", "resumable", "max_runtime")
_NODE_KEYS = ("name", "gpu_type", "gpus")
_PROJECT_KEYS = ("share", "parent", "users", "groups")
_ACCOUNT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TOML_ERROR = re.compile(
    r"(?P<message>.*?)\s*\(at (?P<where>line \d+, column \d+|end of document)\)"
)


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and check the TOML file at ``path``.

    Raises :class:`InvalidConfig` for a file that cannot be read, a TOML syntax
    error (``where`` is ``line L, column C``) and every mistake :func:`parse_config` finds.
    """
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise InvalidConfig("no such file") from None
    except OSError as err:
        raise InvalidConfig(f"cannot read the file: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise InvalidConfig(f"the file is not UTF-8 text ({err.reason})") from None
    except tomllib.TOMLDecodeError as err:
        text = str(err)
        found = _TOML_ERROR.fullmatch(text)
        if found:
            raise InvalidConfig(f"invalid TOML: {found['message']}", found["where"]) from None
        raise InvalidConfig(f"invalid TOML: {text}") from None
    return parse_config(data, source=os.fspath(path))


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> ClusterConfig:
    """Check a parsed configuration (as :func:`tomllib.loads` returns it).

    ``source`` names where it came from, for logs. Raises :class:`InvalidConfig`
    at the first mistake.
    """
    root = _table(data, "")
    _check_keys(root, _TOP_KEYS, "")
    weights = _parse_gpu_types(root.get("gpu_types", {}), "gpu_types")
    nodes = _parse_nodes(root.get("nodes", []), "nodes", weights)
    accounts, declared = _parse_projects(root.get("projects"), "projects")
    tree = ProjectTree(accounts)
    members = _parse_members(tree, declared)
    policy = _parse_policy(root.get("policy", {}), "policy", tree)
    defaults = _parse_defaults(root.get("defaults", {}), "defaults", policy)
    admins = frozenset(_strings(root.get("admins", []), "admins"))
    return ClusterConfig(
        accounts=accounts,
        tree=tree,
        members=MappingProxyType(members),
        nodes=nodes,
        gpu_type_weights=MappingProxyType(weights),
        policy=policy,
        defaults=MappingProxyType(defaults),
        admins=admins,
        source=source,
    )


def _parse_gpu_types(value: object, where: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for name, weight in _table(value, where).items():
        at = _at(where, name)
        if isinstance(weight, dict):
            raise InvalidConfig(
                "expected a weight (a number), got a table; a GPU type with a dot in its "
                f'name (a MIG profile) must be quoted: "{name}.{next(iter(weight), "...")}" = 1.0',
                at,
            )
        if not name or any(c.isspace() for c in name):
            raise InvalidConfig("a GPU type name must be non-empty and without spaces", at)
        weights[name] = _positive_number(weight, at, "a weight (cost units per GPU-second)")
    return weights


def _parse_nodes(value: object, where: str, weights: Mapping[str, float]) -> tuple[Node, ...]:
    if not isinstance(value, list):
        raise InvalidConfig(
            f"expected an array of tables ([[{where}]] blocks), got {_describe(value)}", where
        )
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(value):
        at = f"{where}[{index}]"
        table = _table(item, at)
        _check_keys(table, _NODE_KEYS, at)
        for key in _NODE_KEYS:
            if key not in table:
                raise InvalidConfig(f"missing key {key!r}; a node needs {_list(_NODE_KEYS)}", at)
        name = _string(table["name"], f"{at}.name")
        if name in seen:
            raise InvalidConfig(
                f"node {name!r} is declared twice (first as {where}[{seen[name]}])", f"{at}.name"
            )
        seen[name] = index
        gpu_type = _string(table["gpu_type"], f"{at}.gpu_type")
        if gpu_type not in weights:
            raise InvalidConfig(
                f"GPU type {gpu_type!r} is not declared in [gpu_types]"
                f"{_suggest(gpu_type, weights)}; declare it with its weight, "
                f"e.g. {_key(gpu_type)} = 1.0",
                f"{at}.gpu_type",
            )
        gpus = _whole(table["gpus"], f"{at}.gpus", minimum=1, what="a number of GPUs")
        nodes.append(Node(name=name, gpu_type=gpu_type, gpu_count=gpus))
    return tuple(nodes)


def _parse_projects(
    value: object, where: str
) -> tuple[tuple[Account, ...], dict[str, tuple[str, Members]]]:
    """Accounts in file order, and the members declared on each with the key declaring them."""
    if value is None:
        raise InvalidConfig(
            "no projects declared; add at least one, e.g. [projects.my-project]", where
        )
    table = _table(value, where)
    if not table:
        raise InvalidConfig("no projects declared; add at least one", where)
    accounts: list[Account] = []
    declared: dict[str, tuple[str, Members]] = {}
    for name, body in table.items():
        at = _at(where, name)
        if not _ACCOUNT_NAME.fullmatch(name):
            raise InvalidConfig(
                "an account name must start with a letter or digit and contain only "
                "letters, digits, '.', '_' and '-'",
                at,
            )
        body = _table(body, at)
        for key, item in body.items():
            if key not in _PROJECT_KEYS and isinstance(item, dict):
                raise InvalidConfig(
                    f"unknown key {key!r}; a sub-account is its own table: "
                    f'[{where}.{_key(key)}] with parent = "{name}"',
                    _at(at, key),
                )
        _check_keys(body, _PROJECT_KEYS, at)
        share = _positive_number(body.get("share", 1.0), _at(at, "share"), "a share")
        parent = body.get("parent")
        if parent is not None:
            parent = _string(parent, _at(at, "parent"))
        accounts.append(Account(name=name, share=share, parent=parent))
        if "users" in body or "groups" in body:
            key = "users" if "users" in body else "groups"
            users = frozenset(_strings(body.get("users", []), _at(at, "users")))
            groups = frozenset(_strings(body.get("groups", []), _at(at, "groups")))
            declared[name] = (_at(at, key), Members(users, groups))
    return tuple(accounts), declared


def _parse_members(
    tree: ProjectTree, declared: Mapping[str, tuple[str, Members]]
) -> dict[str, Members]:
    for name, (at, _members) in declared.items():
        if not tree.is_project(name):
            raise InvalidConfig(
                f"{name!r} has sub-accounts ({', '.join(tree.children[name])}); members "
                "belong on projects (accounts without sub-accounts)",
                at,
            )
    return {name: declared.get(name, ("", Members()))[1] for name in tree.projects}


def _parse_policy(value: object, where: str, tree: ProjectTree) -> Policy:
    table = _table(value, where)
    _check_keys(table, (*_POLICY_KEYS, *_RETIRED_POLICY_KEYS), where)
    for key, why in _RETIRED_POLICY_KEYS.items():
        if key in table:
            log.warning("%s is retired: %s", _at(where, key), why)
    settings: dict[str, Any] = {}
    for key, zero_ok in _POLICY_DURATIONS.items():
        if key in table:
            settings[key] = _duration(table[key], _at(where, key), zero_ok=zero_ok)
    for key in ("debug_max_gpus", "debug_headroom", "max_reservations"):
        if key in table:
            settings[key] = _whole(table[key], _at(where, key), minimum=0)
    if "debug_first" in table:
        settings["debug_first"] = _bool(table["debug_first"], _at(where, "debug_first"))
    if "preemption_budget" in table:
        # 0 turns the budget off: a job may be preempted any number of times.
        at = _at(where, "preemption_budget")
        budget = _whole(table["preemption_budget"], at, minimum=0, what="a number of preemptions")
        settings["preemption_budget"] = budget or None
    if "preemption_backoff" in table:
        at = _at(where, "preemption_backoff")
        backoff = _positive_number(table["preemption_backoff"], at, "a factor ≥ 1")
        if backoff < 1:
            raise InvalidConfig(
                f"expected a factor ≥ 1 (1 keeps a preempted job's protection as it was, "
                f"2 doubles it), got {backoff!r}",
                at,
            )
        settings["preemption_backoff"] = backoff
    for key, (what, at_most_one, zero_ok) in _POLICY_UP_TO_ONE.items():
        if key in table:
            settings[key] = _up_to_one(
                table[key], _at(where, key), what, at_most_one, zero_ok=zero_ok
            )
    if "lease_lapse_floor" in table:
        # At least 1: a holder that is gone must end some time.
        at = _at(where, "lease_lapse_floor")
        settings["lease_lapse_floor"] = _whole(
            table["lease_lapse_floor"], at, minimum=1, what="a number of slices per minute"
        )
    caps: dict[str, int] = {}
    caps_at = _at(where, "project_gpu_caps")
    for name, cap in _table(table.get("project_gpu_caps", {}), caps_at).items():
        at = _at(caps_at, name)
        if name not in tree.accounts:
            raise InvalidConfig(
                f"no project {name!r}{_suggest(name, tree.projects)}; caps name projects", at
            )
        if not tree.is_project(name):
            raise InvalidConfig(
                f"{name!r} has sub-accounts; caps apply to projects (accounts without "
                "sub-accounts)",
                at,
            )
        caps[name] = _whole(cap, at, minimum=1, what="a number of GPUs")
    settings["project_gpu_caps"] = MappingProxyType(caps)
    policy = Policy(**settings)
    if policy.debug_max_min_runtime > policy.max_min_runtime:
        raise InvalidConfig(
            f"{format_duration(policy.debug_max_min_runtime)} is above max_min_runtime "
            f"({format_duration(policy.max_min_runtime)}); a debug contract is a short one",
            _at(where, "debug_max_min_runtime"),
        )
    return policy


def _parse_defaults(value: object, where: str, policy: Policy) -> dict[SliceKind, KindDefaults]:
    table = _table(value, where)
    _check_keys(table, [kind.value for kind in SliceKind], where, what="slice kind")
    defaults: dict[SliceKind, KindDefaults] = {}
    for kind in SliceKind:
        builtin = BUILTIN_DEFAULTS[kind]
        at = _at(where, kind.value)
        body = _table(table.get(kind.value, {}), at)
        _check_keys(body, _DEFAULTS_KEYS, at)
        min_runtime = builtin.min_runtime
        if "min_runtime" in body:
            min_runtime = _duration(body["min_runtime"], _at(at, "min_runtime"), zero_ok=True)
        if min_runtime > policy.max_min_runtime:
            raise InvalidConfig(
                f"{format_duration(min_runtime)} is above the cap policy.max_min_runtime "
                f"({format_duration(policy.max_min_runtime)})",
                _at(at, "min_runtime"),
            )
        resumable = builtin.resumable
        if "resumable" in body:
            resumable = _bool(body["resumable"], _at(at, "resumable"))
        max_runtime = builtin.max_runtime
        if "max_runtime" in body:
            max_runtime = _duration(body["max_runtime"], _at(at, "max_runtime"), zero_ok=False)
        if max_runtime is not None and max_runtime < min_runtime:
            raise InvalidConfig(
                f"{format_duration(max_runtime)} is below min_runtime "
                f"({format_duration(min_runtime)}); the hard end cannot come before the "
                "protected period ends",
                _at(at, "max_runtime"),
            )
        defaults[kind] = KindDefaults(min_runtime, resumable, max_runtime)
    return defaults


# ---- value checks -----------------------------------------------------------


def _at(where: str, key: str) -> str:
    """``where`` extended by ``key``, quoted as TOML would need it."""
    return f"{where}.{_key(key)}" if where else _key(key)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else f'"{key}"'


def _list(names: Iterable[str]) -> str:
    return ", ".join(names)


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(value: object) -> str:
    """A TOML reader's name for the type of ``value``."""
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if value is None:
        return "nothing"
    return f"a {type(value).__name__} ({value})"


def _check_keys(table: Mapping[str, Any], allowed: Iterable[str], where: str, what="key") -> None:
    allowed = list(allowed)
    for key in table:
        if key not in allowed:
            raise InvalidConfig(
                f"unknown {what} {key!r}{_suggest(key, allowed)}; expected one of: "
                f"{_list(allowed)}",
                _at(where, key),
            )


def _table(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidConfig(f"expected a table, got {_describe(value)}", where)
    return dict(value)


def _string(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidConfig(f"expected a non-empty string, got {_describe(value)}", where)
    return value


def _strings(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise InvalidConfig(f"expected an array of strings, got {_describe(value)}", where)
    return [_string(item, f"{where}[{index}]") for index, item in enumerate(value)]


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidConfig(f"expected true or false, got {_describe(value)}", where)
    return value


def _positive_number(value: object, where: str, what: str, *, zero_ok: bool = False) -> float:
    bound = "≥ 0" if zero_ok else "> 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidConfig(f"expected {what}, a number {bound}, got {_describe(value)}", where)
    if not ((value >= 0 if zero_ok else value > 0) and math.isfinite(value)):
        raise InvalidConfig(f"expected {what}, a number {bound}, got {value!r}", where)
    return float(value)


def _up_to_one(
    value: object, where: str, what: str, at_most_one: str, *, zero_ok: bool = False
) -> float:
    """A number above 0 (or from 0, ``zero_ok``) up to 1; ``at_most_one`` says what is
    expected of one above 1."""
    number = _positive_number(value, where, what, zero_ok=zero_ok)
    if number > 1:
        raise InvalidConfig(f"expected {at_most_one}, got {number!r}", where)
    return number


def _whole(value: object, where: str, *, minimum: int, what: str = "a whole number") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(
            f"expected {what}, a whole number >= {minimum}, got {_describe(value)}", where
        )
    if value < minimum:
        raise InvalidConfig(f"expected {what}, a whole number >= {minimum}, got {value}", where)
    return value


def _duration(value: object, where: str, *, zero_ok: bool) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as err:
        raise InvalidConfig(str(err), where) from None
    if seconds == 0 and not zero_ok:
        raise InvalidConfig(f"expected a duration > 0, got {value!r}", where)
    return seconds
