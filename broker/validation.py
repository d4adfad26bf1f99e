"""Checks on a slice request before it enters the queue (design.md §2–§3).

A request that can never be granted — wrong types, a contract over the
policy's caps, a project nobody can charge, more GPUs than the cluster has of
that type — is refused at once with :class:`~broker.errors.InvalidRequest`
rather than left waiting forever. The first mistake found is reported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from .config import format_duration
from .core.fairshare import ProjectTree
from .core.model import Node, Policy, SliceKind
from .errors import InvalidRequest

PRIORITY_MIN = -100
PRIORITY_MAX = 100

# ---- free text -----------------------------------------------------------------------
# One rule for every free-text field (names of users, groups, projects and GPU types;
# a node's reason), held by the API's schemas and by the store alike, so that what one
# database keeps the other does not refuse with an error of its own: PostgreSQL refuses
# NUL in text, and the other controls hide in logs, terminals and CSV files.

#: The longest name, in characters.
NAME_MAX_LENGTH = 255
#: The longest reason (a node's state reason), in characters.
REASON_MAX_LENGTH = 1000
#: Text without control characters (C0, DEL, C1), as a JSON schema pattern.
TEXT_PATTERN = r"^[^\u0000-\u001f\u007f-\u009f]*$"
#: The control characters themselves.
CONTROL_CHARACTERS = re.compile("[\u0000-\u001f\u007f-\u009f]")


def check_text(value: object, what: str, max_length: int) -> str:
    """``value`` if it is free text under the rule above, else :class:`InvalidRequest`."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > max_length:
        raise InvalidRequest(f"{what} is longer than {max_length} characters")
    control = CONTROL_CHARACTERS.search(value)
    if control is not None:
        raise InvalidRequest(
            f"{what} holds a control character ({ord(control.group()):#04x} at {control.start()})"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} is not valid Unicode text") from None
    return value


def validate_slice_request(
    *,
    gpus: object,
    kind: object,
    min_runtime: object,
    max_runtime: object = None,
    gpu_type: object = None,
    priority: object = 0,
    project: object,
    tree: ProjectTree,
    nodes: Iterable[Node],
    policy: Policy,
    known_gpu_types: Iterable[str],
) -> None:
    """Raise :class:`InvalidRequest` if the request cannot be a valid slice; return otherwise.

    ``min_runtime`` and ``max_runtime`` are seconds (parse text with
    :func:`broker.config.parse_duration` first); ``max_runtime`` and ``gpu_type``
    may be ``None``. Size is judged against every declared node, whatever its
    state, since a draining node comes back: an interactive slice must fit on one
    node (of ``gpu_type`` when given), a batch slice may span nodes and must fit
    in the GPUs of that type together (in all GPUs when no type is given).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidRequest(f"gpus must be a whole number >= 1, got {gpus!r}")
    kind = _kind(kind)
    min_runtime = _seconds(min_runtime, "min_runtime")
    if min_runtime > policy.max_min_runtime:
        raise InvalidRequest(
            f"min_runtime {format_duration(min_runtime)} is above the cap of "
            f"{format_duration(policy.max_min_runtime)} (policy max_min_runtime)"
        )
    if max_runtime is not None:
        max_runtime = _seconds(max_runtime, "max_runtime")
        if max_runtime <= 0:
            raise InvalidRequest("max_runtime must be > 0 (leave it out for no hard end)")
        if max_runtime < min_runtime:
            raise InvalidRequest(
                f"max_runtime {format_duration(max_runtime)} is below min_runtime "
                f"{format_duration(min_runtime)}"
            )
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise InvalidRequest(
            f"priority must be a whole number from {PRIORITY_MIN} to {PRIORITY_MAX}, "
            f"got {priority!r}"
        )
    _check_project(project, tree)
    if gpu_type is not None:
        known = set(known_gpu_types)
        if not isinstance(gpu_type, str) or gpu_type not in known:
            raise InvalidRequest(
                f"unknown gpu_type {gpu_type!r}; known types: {', '.join(sorted(known)) or 'none'}"
            )
    _check_size(gpus, kind, gpu_type, list(nodes))
    cap = policy.project_gpu_caps.get(project)
    if cap is not None and gpus > cap:
        raise InvalidRequest(f"project {project!r} may hold at most {cap} GPUs at once")


def _kind(kind: object) -> SliceKind:
    try:
        return SliceKind(kind)
    except ValueError:
        choices = " or ".join(k.value for k in SliceKind)
        raise InvalidRequest(f"unknown kind {kind!r}; expected {choices}") from None


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number of seconds, got {value!r}")
    if value < 0:
        raise InvalidRequest(f"{name} must not be negative, got {value!r}")
    return float(value)


def _check_project(project: object, tree: ProjectTree) -> None:
    if not isinstance(project, str) or project not in tree.accounts:
        raise InvalidRequest(f"unknown project {project!r}")
    if not tree.is_project(project):
        raise InvalidRequest(
            f"{project!r} is an account with sub-projects ({', '.join(tree.children[project])}); "
            "charge one of those"
        )


def _check_size(gpus: int, kind: SliceKind, gpu_type: str | None, nodes: list[Node]) -> None:
    eligible = [n for n in nodes if gpu_type is None or n.gpu_type == gpu_type]
    of_type = f"{gpu_type} " if gpu_type else ""
    if not eligible:
        raise InvalidRequest(f"the cluster has no {of_type}GPUs")
    if kind is SliceKind.INTERACTIVE:
        largest = max(n.gpu_count for n in eligible)
        if gpus > largest:
            raise InvalidRequest(
                f"an interactive slice must fit on one node; the largest node has "
                f"{largest} {of_type}GPUs, asked for {gpus}"
            )
    else:
        total = sum(n.gpu_count for n in eligible)
        if gpus > total:
            raise InvalidRequest(f"the cluster has {total} {of_type}GPUs in all, asked for {gpus}")
