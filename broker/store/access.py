"""Who may do what: a user sees, heartbeats and releases only their own slices and
charges only the projects they are a member of, unless they are an admin."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy.orm import Session

from ..errors import Forbidden, NotFound
from ..orm import SliceRow
from .journal import _Catalog


def _owned_row(session: Session, slice_id: int, user: str | None, admin: bool) -> SliceRow:
    row = session.get(SliceRow, slice_id)
    if row is None:
        raise NotFound(f"no slice {slice_id}")
    if user is not None and not admin and row.user != user:
        raise Forbidden(f"slice {slice_id} belongs to another user")
    return row


def _check_member(
    catalog: _Catalog, project: str, user: str, groups: Iterable[str], admin: bool
) -> None:
    """Only a member of ``project`` (``user`` or one of ``groups``) or an admin may
    charge it (:class:`Forbidden`)."""
    if not admin and not catalog.is_member(project, user, groups):
        raise Forbidden(f"{user!r} is not a member of project {project!r}")
