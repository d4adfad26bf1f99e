"""Who may do what: a user sees, heartbeats and releases only their own slices and
charges only the projects they are a member of, unless they are an admin."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from ..errors import Forbidden, NotFound
from ..orm import SliceRow
from .journal import _Catalog


@dataclass(frozen=True)
class Caller:
    """Who asks about a slice: a user by ``name`` (with their ``groups``), or an
    ``admin``, who reaches every slice."""

    name: str
    groups: frozenset[str] = frozenset()
    admin: bool = False


class NotYours(Forbidden):
    """Another user's slice: the API answers as if there were none (404)."""


def _owned_row(session: Session, slice_id: int, caller: Caller | None) -> SliceRow:
    """The slice ``caller`` asks about (any slice with no ``caller``): :class:`NotFound`,
    or :class:`Forbidden` for another user's slice unless ``caller`` is an admin."""
    row = session.get(SliceRow, slice_id)
    if row is None:
        raise NotFound(f"no slice {slice_id}")
    _check_owner(slice_id, row.user, caller)
    return row


def _check_owner(slice_id: int, user: str, caller: Caller | None) -> None:
    """:class:`NotYours` unless ``caller`` (if any) is ``user`` or an admin."""
    if caller is not None and not caller.admin and user != caller.name:
        raise NotYours(f"slice {slice_id} belongs to another user")


def _check_member(
    catalog: _Catalog, project: str, user: str, groups: Iterable[str], admin: bool
) -> None:
    """Only a member of ``project`` (``user`` or one of ``groups``) or an admin may
    charge it (:class:`Forbidden`)."""
    if not admin and not catalog.is_member(project, user, groups):
        raise Forbidden(f"{user!r} is not a member of project {project!r}")
