"""The project tree's record: accounts and members as given checked, two trees
compared, and a tree written with a project event for each change."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from ..core.fairshare import ProjectTree
from ..core.model import Account
from ..errors import InvalidConfig, InvalidRequest
from ..orm import AccountRow, MemberRow, ProjectEventRow
from ..validation import CONTROL_CHARACTERS, NAME_MAX_LENGTH

#: The longest user or group name a project's members may have (the free-text rule's).
MAX_MEMBER_NAME = NAME_MAX_LENGTH


def _wanted_states(accounts: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Accounts as given to :meth:`Broker.apply_tree`, checked (:class:`InvalidRequest`)."""
    states: dict[str, dict[str, Any]] = {}
    for given in accounts:
        name = given.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > NAME_MAX_LENGTH:
            raise InvalidRequest(f"an account needs a name, got {name!r:.80}")
        if name in states:
            raise InvalidRequest(f"account {name!r} is listed twice")
        states[name] = {
            "share": float(given.get("share", 1.0)),
            "parent": given.get("parent"),
            "users": sorted(set(_member_names(given.get("users") or [], "users"))),
            "groups": sorted(set(_member_names(given.get("groups") or [], "groups"))),
        }
    try:
        tree = ProjectTree(Account(n, s["share"], s["parent"]) for n, s in states.items())
    except InvalidConfig as err:
        raise InvalidRequest(err.message) from None
    for name, state in states.items():
        if (state["users"] or state["groups"]) and not tree.is_project(name):
            raise InvalidRequest(f"{name!r} has sub-accounts; members belong on projects")
    return states


def _tree_changes(
    current: Mapping[str, dict[str, Any]], wanted: Mapping[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """What turns ``current`` into ``wanted``, by account name: added, removed, changed."""
    changes = []
    for name in sorted(set(current) | set(wanted)):
        before, after = current.get(name), wanted.get(name)
        if before == after:
            continue
        change = "added" if before is None else "removed" if after is None else "changed"
        changes.append({"account": name, "change": change, "before": before, "after": after})
    return changes


def _write_tree(
    session: Session,
    current: Mapping[str, dict[str, Any]],
    wanted: Mapping[str, dict[str, Any]],
    who: str,
    now: float,
    action: str = "seed",
) -> None:
    """Turn the accounts and members ``current`` into ``wanted``, recording each change."""
    changes = _tree_changes(current, wanted)
    changed = [c["account"] for c in changes]
    session.execute(delete(MemberRow).where(MemberRow.project.in_(changed)))
    removed = [c["account"] for c in changes if c["after"] is None]
    session.execute(delete(AccountRow).where(AccountRow.name.in_(removed)))
    session.flush()
    for change in changes:
        name, after = change["account"], change["after"]
        if after is None:
            continue
        row = session.get(AccountRow, name) or AccountRow(name=name)
        row.share, row.parent = after["share"], after["parent"]
        session.add(row)
    session.flush()
    for change in changes:
        name, after = change["account"], change["after"]
        if after is not None:
            _add_members(session, name, after["users"], after["groups"])
        _record(session, name, who, now, action, change["before"], after)


def _record(
    session: Session,
    account: str,
    who: str,
    at: float,
    action: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> ProjectEventRow:
    """Add a project event (see :class:`~broker.orm.ProjectEventRow`)."""
    row = ProjectEventRow(
        account=account, who=who[:255], at=at, action=action, before=before, after=after
    )
    session.add(row)
    return row


def _add_members(
    session: Session, project: str, users: Iterable[str], groups: Iterable[str]
) -> None:
    session.add_all(MemberRow(project=project, kind="user", name=u) for u in sorted(set(users)))
    session.add_all(MemberRow(project=project, kind="group", name=g) for g in sorted(set(groups)))


def _member_names(names: Iterable[str], key: str) -> list[str]:
    """``names`` if each is a possible user or group name; :class:`InvalidRequest` otherwise.

    Control characters are refused: a name with one matches no account a login
    makes (the member would silently lose access), and PostgreSQL refuses NUL in text.
    """
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_MEMBER_NAME:
            raise InvalidRequest(
                f"{key}: a name of 1 to {MAX_MEMBER_NAME} characters, got {name!r:.80}"
            )
        if CONTROL_CHARACTERS.search(name):
            raise InvalidRequest(f"{key}: {name!r:.80} has control characters")
    return names
