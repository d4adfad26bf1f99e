"""Who may do what: a user sees, heartbeats and releases only their own slices and
charges only the projects they are a member of, unless they are an admin."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session

from ..errors import Forbidden, NotFound
from ..orm import SliceRow
from .journal import Journal, _Catalog


@dataclass(frozen=True)
class Principal:
    """Who makes a request, or whom it acts for: a user or a hub service by ``name``,
    with their ``groups``. An ``agent`` may act for any user (JupyterHub's spawner is
    one) and reaches every slice; an ``admin`` may do everything, charging any project
    included. ``kind`` is ``user`` or ``service`` (a hub service)."""

    name: str
    groups: frozenset[str] = frozenset()
    admin: bool = False
    agent: bool = False
    kind: str = "user"

    @property
    def acts_for_others(self) -> bool:
        """Whether it may act for any user and reach their slices."""
        return self.admin or self.agent


class NotYours(NotFound, Forbidden):
    """Another user's slice: forbidden to the caller, and answered as if there were
    none (404 ``not_found``, "no slice N"), so that a user learns nothing of others'
    slices, not even that they exist."""

    def __init__(self, slice_id: int):
        super().__init__(f"no slice {slice_id}")


def _owned_row(
    journal: Journal, session: Session, slice_id: int, caller: Principal | None
) -> SliceRow:
    """The slice ``caller`` asks about (any slice with no ``caller``), as the journal
    finds it (:meth:`Journal.row`): :class:`NotFound`, or :class:`NotYours` for
    another user's slice unless ``caller`` acts for others."""
    row = journal.row(session, slice_id)
    if row is None:
        raise NotFound(f"no slice {slice_id}")
    _check_owner(slice_id, row.user, caller)
    return row


def _check_owner(slice_id: int, user: str, caller: Principal | None) -> None:
    """:class:`NotYours` unless ``caller`` (if any) is ``user``, an agent or an admin."""
    if caller is not None and not caller.acts_for_others and user != caller.name:
        raise NotYours(slice_id)


def _check_member(catalog: _Catalog, project: str, principal: Principal) -> None:
    """Only a member of ``project`` (the principal's name or one of its groups) or an
    admin may charge it (:class:`Forbidden`)."""
    if not principal.admin and not catalog.is_member(project, principal.name, principal.groups):
        raise Forbidden(f"{principal.name!r} is not a member of project {project!r}")
