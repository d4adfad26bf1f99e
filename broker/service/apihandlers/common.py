"""Rules shared by the resource modules and the pages: acting for a user, charging a
project, membership of an account."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from ...errors import Forbidden
from ...store import Principal
from .base import bounded

#: How many of the groups a caller is not in a refusal names.
GROUPS_SHOWN = 5


def acting_identity(
    caller: Principal, user: str | None = None, groups: Iterable[str] | None = None
) -> Principal:
    """Who a request acts for: the caller, or the ``user`` (with ``groups``) it names.

    Agents and admins may name anyone; the identity they act for has only the
    named groups (none if left out) and no roles — an agent charges what the user
    may. Anyone else may only name themselves and groups of their own (a
    :class:`Forbidden` otherwise).
    """
    named_groups = None if groups is None else frozenset(groups)
    if user is None and named_groups is None:
        return caller
    if caller.acts_for_others:
        if user is None or user == caller.name:
            if named_groups is None:
                return caller
            return replace(caller, groups=named_groups)
        return Principal(user, named_groups or frozenset())
    if user is not None and user != caller.name:
        raise Forbidden("only agents and admins may act for another user")
    if named_groups is not None and not named_groups <= caller.groups:
        others = sorted(named_groups - caller.groups)
        # Name a few: the request may list thousands, and the answer must not echo them all.
        shown = ", ".join(bounded(group, 64) for group in others[:GROUPS_SHOWN])
        more = f" and {len(others) - GROUPS_SHOWN} more" if len(others) > GROUPS_SHOWN else ""
        raise Forbidden(f"{bounded(caller.name, 64)!r} is not in group(s) {shown}{more}")
    return caller if named_groups is None else replace(caller, groups=named_groups)


def is_member(identity: Principal, account: Mapping[str, Any]) -> bool:
    """Whether ``identity`` is among ``account``'s members (a row of the project tree),
    by name or by a group."""
    return identity.name in account["users"] or not identity.groups.isdisjoint(account["groups"])


def charging_principal(
    caller: Principal, user: str | None = None, groups: Iterable[str] | None = None
) -> Principal:
    """Whom a request that charges a project is for (:func:`acting_identity`), with the
    caller's admin right: an admin acting for a user may charge any project, an agent
    only what that user may."""
    return replace(acting_identity(caller, user, groups), admin=caller.admin)
