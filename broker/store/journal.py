"""How the Broker's state reaches the database: transactions under the write lock,
group commit, and what a single writer keeps in memory between them.

Every write transaction holds one database-wide lock (an advisory lock on
PostgreSQL, the write lock on SQLite), so any number of Broker objects, in any
number of processes, can share a database: passes and requests are applied
one after another, never on a stale view, and a GPU is never granted twice.
The service's Broker is its database's single writer (``single_writer``, behind
the leader lock): it keeps the catalog — nodes, GPU types, the project tree and
members — and the live slices in memory instead of reading them for every
request and pass; the database is their journal (design.md §8).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy import bindparam, event, inspect, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import ORMExecuteState, Session, make_transient_to_detached, sessionmaker
from sqlalchemy.orm.util import identity_key

from ..core.accounting import ClosedCharges, LedgerEntry, usage_by_project
from ..core.fairshare import ProjectTree
from ..core.model import Slice, SliceState
from ..orm import (
    NOT_DURABLE_OPTION,
    READ_ONLY_OPTION,
    AccountRow,
    DatabaseNotInitialized,
    DatabaseOutOfDate,
    GpuTypeRow,
    LedgerRow,
    MemberRow,
    NodeRow,
    SliceRow,
    check_schema,
    make_engine,
    migrate,
    take_write_lock,
)
from .rows import (
    HELD_STATES,
    LIVE_STATES,
    _accounts,
    _Costs,
    _ledger_entry,
    _members,
    _node,
    _to_slice,
    _weights,
)
from .views import _node_dict, _row_view

#: The rows the catalog is read from: writing any of them changes it.
CATALOG_ROWS = (AccountRow, MemberRow, GpuTypeRow, NodeRow)

#: A slice row's columns, by attribute name, and those the database leaves NULL when
#: an insert gives no value (no default of the database's own).
_SLICE_COLUMNS = tuple(column.key for column in inspect(SliceRow).column_attrs)
_NULL_UNLESS_GIVEN = frozenset(
    column.key
    for column in inspect(SliceRow).column_attrs
    if column.columns[0].server_default is None
)

#: How many ids one ``IN`` list holds (SQLite allows a few thousand parameters).
IDS_PER_QUERY = 1000

#: The live slices' rows, oldest first.
LIVE_ROWS = select(SliceRow).where(SliceRow.state.in_(LIVE_STATES)).order_by(SliceRow.id)


Write = TypeVar("Write", bound=Callable[..., Any])

#: One lease renewed: a statement compiled once and sent for many slices at once
#: (executemany), past the ORM, whose bulk update costs more than the database's
#: work here (the journal follows it itself: :meth:`Journal.renew_leases`).
_RENEW_LEASE = (
    update(SliceRow.__table__)
    .where(SliceRow.__table__.c.id == bindparam("slice_id"))
    .values(lease_expires_at=bindparam("expires_at"))
)

#: Whether the write under way is flushed to disk (see :func:`not_durable`).
_DURABLE: ContextVar[bool] = ContextVar("durable", default=True)


def not_durable(method: Write) -> Write:
    """Declare a Broker write whose loss in a power failure harms nothing (a heartbeat):
    it commits without a flush to disk (:data:`~broker.orm.NOT_DURABLE_OPTION`), alone
    or in a group commit of such writes. The one place a write's durability is said:
    its transactions follow it, and the service's runner reads it (``durable``)."""

    @functools.wraps(method)
    def write(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _DURABLE.set(False)
        try:
            return method(self, *args, **kwargs)
        finally:
            _DURABLE.reset(token)

    write.durable = False  # type: ignore[attr-defined]
    return write  # type: ignore[return-value]


def is_durable(write: Callable[..., Any]) -> bool:
    """Whether ``write`` (a Broker method, bound or not) flushes to disk."""
    return getattr(write, "durable", True)


class Journal:
    """The Broker's transactions: :meth:`write`, :meth:`read`, :meth:`group_commit`,
    and the catalog and live slices a ``single_writer`` keeps between them."""

    def __init__(self, url: str, db_timeout: float | None, *, single_writer: bool) -> None:
        """Open the engine and its sessions; nothing kept in memory yet."""
        self.single_writer = single_writer
        # The catalog as the transaction under way sees it: kept between transactions
        # by a single writer, under the live slices' rule (below): a write of one of
        # its rows drops it (the next read loads what the transaction sees), and so
        # does any rollback that had written anything.
        self._catalog: _Catalog | None = None
        self._transaction_depth = 0
        self._group: Session | None = None  # the transaction of a group commit under way
        self.group_spoiled = False  # a write of it was refused after it had written
        # The live slices as the transaction under way sees them, by id (oldest first):
        # kept between transactions by a single writer, else loaded once per pass.
        # Every flush of a slice updates it; any rollback drops it.
        self._live: dict[int, _LiveSlice] | None = None
        # Ids of the kept live slices written since they were loaded, in order, and
        # how many loads there have been: what a reader that keeps its own copy of
        # them (the pass's index) has to look at again (see :meth:`live_changes`).
        # Positions count from the load; those before ``_touched_from`` are dropped.
        self._live_loads = 0
        self._touched: list[int] = []
        self._touched_from = 0
        # node -> {GPU index: id of the live slice that holds it}, as the kept live
        # slices say: built when first asked after they are loaded, then moved with
        # them (the store's own record for its last check of a grant, §5).
        self._holders: dict[str, dict[int, int]] | None = None
        # project -> [slices waiting, GPUs held] as the kept live slices say: built and
        # moved as the record of holders is (GET /projects' counts).
        self._tallies: dict[str, list[int]] | None = None
        # What the window's closed charges add to usage, kept by a single writer
        # under the same rule: every flushed charge is added, any rollback drops it.
        self._closed: ClosedCharges | None = None
        # What the last commit left, for readers off the database thread (see
        # :class:`Committed`); None until a commit finds it all kept.
        self.committed: Committed | None = None
        # Where the kept live slices' changes stood at that commit (see live_changes).
        self._committed_mark: tuple[int, int] | None = None
        # Writes the journal saw reach the database (flushes and statements): a
        # rollback of a transaction that saw none leaves what is kept
        # as the database has it, so a refused request does not make the next pass
        # read every live slice again.
        self._writes_seen = 0
        self.engine = make_engine(url, timeout=db_timeout)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._reads = sessionmaker(self.engine.execution_options(**{READ_ONLY_OPTION: True}))
        self._not_durable = sessionmaker(
            self.engine.execution_options(**{NOT_DURABLE_OPTION: True}), expire_on_commit=False
        )
        for writes in (self.sessions, self._not_durable):
            event.listen(writes, "after_flush", self._follow_flush)
            event.listen(writes, "do_orm_execute", self._follow_statement)

    def prepare_schema(self, upgrade: bool) -> None:
        """Create the schema on an empty database; migrate an old one if ``upgrade``."""
        try:
            check_schema(self.engine)
        except DatabaseNotInitialized:
            migrate(self.engine)
        except DatabaseOutOfDate:
            if not upgrade:
                raise
            migrate(self.engine)

    @contextmanager
    def write(self, *, durable: bool | None = None) -> Iterator[Session]:
        """A transaction holding the broker-wide write lock; commits on success.

        Not durable (a method declared :func:`not_durable`, or ``durable=False`` for a
        group of such writes) skips the commit's flush to disk. It is as atomic and as
        locked as any other.
        """
        if durable is None:
            durable = _DURABLE.get()
        seen = self._writes_seen
        if self._group is not None:
            # Inside a group commit, with no savepoint of its own (on PostgreSQL each is a
            # round trip): a write refused before it changed anything leaves the group as
            # it was; one refused after spoils it (see group_commit), and so does any
            # error of the database's, a failed read included (PostgreSQL aborts the
            # whole transaction then: the writes before it would be lost with it).
            session = self._group
            try:
                yield session
                session.flush()
            except BaseException as err:
                if (
                    isinstance(err, SQLAlchemyError)
                    or self._writes_seen != seen
                    or session.new
                    or session.dirty
                    or session.deleted
                ):
                    self.group_spoiled = True
                raise
            return
        sessions = self.sessions if durable else self._not_durable
        self._transaction_depth += 1
        committed = None
        try:
            with sessions.begin() as session:
                take_write_lock(session.connection())
                yield session
                if self.single_writer and self._transaction_depth == 1:
                    session.flush()  # what is kept is what commits
                    committed = self._as_committed()
        except BaseException:
            self._rolled_back(seen)
            raise
        finally:
            self._transaction_depth -= 1
            if self._transaction_depth == 0 and not self.single_writer:
                self._live = None
        self._publish(committed)

    def _publish(self, committed: Committed | None) -> None:
        """``committed`` is what the database now has (None: not all of it kept)."""
        self.committed = committed
        self._committed_mark = self.live_changes(None)[1] if committed is not None else None

    def committed_values(self) -> Sequence[Slice] | None:
        """The live slices' values, oldest first, from the copy the last commit left,
        where none of them has been written since (then they are the same): a pass's
        snapshot walks none of them. None otherwise. Asked after :meth:`live_slices`."""
        if self.committed is None or self._committed_mark is None:
            return None
        written, _ = self.live_changes(self._committed_mark)
        if written is None or written:
            return None
        return SliceValues(self.committed.live)

    @property
    def in_transaction(self) -> bool:
        """Whether a write is under way (its commit is yet to come)."""
        return self._transaction_depth > 0

    def _as_committed(self) -> Committed | None:
        """What is kept, as the transaction about to commit leaves it; None where any
        of it is not kept (a reader asks the database thread then)."""
        if self._live is None or self._catalog is None:
            return None
        written = None
        if self.committed is not None and self._committed_mark is not None:
            written, _ = self.live_changes(self._committed_mark)
        if written is None:  # loaded again since, or nothing published: copied whole
            return Committed(CommittedLive(dict(self._live), {}, len(self._live)), self._catalog)
        return Committed(self.committed.live.then(self._live, written), self._catalog)

    @contextmanager
    def group_commit(self, *, durable: bool = True) -> Iterator[None]:
        """Writes made inside share one transaction, committed once on leaving: a
        group commit (design.md §8); if the commit fails, none of them happened.
        A write refused after it had changed something sets :attr:`group_spoiled`:
        the caller must then leave by an exception, which rolls the whole group
        back, and run the other writes again. ``durable`` as for every write
        (``False`` only for writes that may be lost).
        """
        with self.write(durable=durable) as session:
            self._group, self.group_spoiled = session, False
            try:
                yield
            finally:
                self._group = None

    def catalog(self, session: Session) -> _Catalog:
        """The catalog as ``session`` sees it: kept in memory by a single writer."""
        session.flush()  # what the transaction changed so far reaches it first
        if self._catalog is not None:
            return self._catalog
        catalog = _Catalog(session)
        if self.single_writer:
            self._catalog = catalog
        return catalog

    def catalog_changes(self) -> None:
        """The transaction under way changes the catalog: the next read loads it as that
        transaction sees it. Called for every write of a catalog row
        (:meth:`_follow_flush`, :meth:`_follow_statement`)."""
        self._catalog = None

    def live_slices(self, session: Session) -> dict[int, _LiveSlice]:
        """The live slices as ``session`` sees them, by id, oldest first."""
        session.flush()  # what the transaction changed so far reaches them first
        if self._live is None:
            self._live = {row.id: _LiveSlice.of(row) for row in session.scalars(LIVE_ROWS)}
            self._holders = self._tallies = None
            self._live_loads += 1
            self._touched, self._touched_from = [], 0
        return self._live

    def live_changes(
        self, since: tuple[int, int] | None
    ) -> tuple[list[int] | None, tuple[int, int]]:
        """Ids of the live slices written since mark ``since`` (a previous answer's), or
        None when any may have changed (they were loaded again since, or no mark):
        then the reader walks them all. And the mark of now. Asked after
        :meth:`live_slices`, in the same transaction."""
        mark = (self._live_loads, self._touched_from + len(self._touched))
        if since is None or since[0] != mark[0] or since[1] < self._touched_from:
            return None, mark
        return self._touched[since[1] - self._touched_from :], mark

    def holders_on(self, session: Session, nodes: Set[str]) -> dict[tuple[str, int], int]:
        """Which live slice holds each GPU of ``nodes``, as last flushed (nothing is
        flushed here: the caller adds what it changed since): ``(node, GPU) -> slice
        id``. Kept from one call to the next while the live slices are."""
        holders = self._holders_record(session)
        return {
            (node, gpu): slice_id
            for node in nodes
            for gpu, slice_id in holders.get(node, {}).items()
        }

    def gpus_held(self, session: Session) -> dict[str, int]:
        """How many GPUs granted and preempting slices hold on each node: from the
        record of holders where a single writer keeps it (no row read), else read now."""
        if self.single_writer:
            return {node: len(gpus) for node, gpus in self._holders_record(session).items()}
        held: dict[str, int] = {}
        for row in session.scalars(select(SliceRow).where(SliceRow.state.in_(HELD_STATES))):
            for p in row.placements:
                held[p["node"]] = held.get(p["node"], 0) + len(p["gpu_indices"])
        return held

    def _holders_record(self, session: Session) -> dict[str, dict[int, int]]:
        """The record of who holds each GPU (:attr:`_holders`), built from the live
        slices when first asked after they are loaded."""
        live = self._live if self._live is not None else self.live_slices(session)
        if self._holders is None:
            self._holders = {}
            for slice_id, entry in live.items():
                self._move_holdings(slice_id, None, entry)
        return self._holders

    def project_tallies(self, session: Session, live: Iterable[Slice]) -> Mapping[str, list[int]]:
        """Each project's live slices as ``[waiting, GPUs held]``: where a single writer
        keeps them, counted when first asked after they are loaded and then moved with
        them (no walk), else counted from ``live`` (the live slices' values). A project
        with none may be missing or count zeros."""
        if not self.single_writer:
            tallies: dict[str, list[int]] = {}
            for slice_ in live:
                _tally(tallies, slice_, 1)
            return tallies
        kept = self._live if self._live is not None else self.live_slices(session)
        if self._tallies is None:
            self._tallies = {}
            for entry in kept.values():
                _tally(self._tallies, entry.slice, 1)
        return self._tallies

    def _move_holdings(
        self, slice_id: int, before: _LiveSlice | None, after: _LiveSlice | None
    ) -> None:
        """Move ``slice_id``'s GPUs in the record from what it held ``before`` to what it
        holds ``after`` (either None or holding nothing)."""
        holders = self._holders
        assert holders is not None
        if before is not None and before.slice.holds_gpus:
            for placement in before.slice.placements:
                on_node = holders.get(placement.node, {})
                for gpu in placement.gpu_indices:
                    if on_node.get(gpu) == slice_id:
                        del on_node[gpu]
        if after is not None and after.slice.holds_gpus:
            for placement in after.slice.placements:
                on_node = holders.setdefault(placement.node, {})
                on_node.update(dict.fromkeys(placement.gpu_indices, slice_id))

    def forget_changes_before(self, mark: tuple[int, int]) -> None:
        """The reader has taken in the changes up to ``mark``: they need not be kept."""
        if mark[0] == self._live_loads and mark[1] > self._touched_from:
            del self._touched[: mark[1] - self._touched_from]
            self._touched_from = mark[1]

    def _rolled_back(self, seen: int) -> None:
        """A transaction that began when ``seen`` writes had been seen was rolled
        back: what it wrote is gone, so is what is kept of it."""
        if self._writes_seen != seen:
            self._live = self._closed = self._catalog = None

    def kept_live(self, session: Session, slice_id: int) -> _LiveSlice | None:
        """Live slice ``slice_id`` as a single writer keeps it; None where it is not
        live or not kept (the caller reads its row)."""
        if not self.single_writer:
            return None
        return self.live_slices(session).get(slice_id)

    def row(self, session: Session, slice_id: int) -> SliceRow | None:
        """Slice ``slice_id``'s row for a write, as :meth:`rows` finds it."""
        return self.rows(session, (slice_id,)).get(slice_id)

    def rows(self, session: Session, slice_ids: Iterable[int]) -> dict[int, SliceRow]:
        """The slice rows of ``slice_ids`` for a write, by id: those ``session`` has
        already; those of live slices a single writer keeps, rebuilt from the kept
        columns without a read (the kept copy is the row as last written); the
        rest read, :data:`IDS_PER_QUERY` to a query."""
        kept = self.live_slices(session) if self.single_writer else {}
        in_session = session.identity_map
        rows: dict[int, SliceRow] = {}
        unread = []
        for slice_id in slice_ids:
            held = in_session.get(identity_key(SliceRow, slice_id))
            entry = kept.get(slice_id)
            if held is not None:
                rows[slice_id] = held
            elif entry is not None and entry.columns is not None:
                row = rows[slice_id] = SliceRow(**entry.columns)
                make_transient_to_detached(row)
                session.add(row)
            else:
                unread.append(slice_id)
        unread.sort()
        for start in range(0, len(unread), IDS_PER_QUERY):
            chunk = unread[start : start + IDS_PER_QUERY]
            query = select(SliceRow).where(SliceRow.id.in_(chunk))
            rows.update((row.id, row) for row in session.scalars(query))
        return rows

    def renew_leases(
        self, session: Session, slice_ids: Sequence[int], expires_at: float
    ) -> dict[int, _LiveSlice]:
        """Write kept live slices' new lease expiry (no row read) and keep it;
        returns the slices as now kept, by id."""
        assert self._live is not None  # kept_live answered each of them
        wanted = sorted(set(slice_ids))
        self._writes_seen += 1  # a rollback drops what is kept (see _follow_statement)
        session.connection().execute(
            _RENEW_LEASE, [{"slice_id": i, "expires_at": expires_at} for i in wanted]
        )
        renewed = {}
        for slice_id in wanted:
            entry = self._live[slice_id]
            renewed[slice_id] = self._live[slice_id] = _LiveSlice(
                replace(entry.slice, lease_expires_at=expires_at),
                {**entry.view, "lease_expires_at": expires_at},
                None
                if entry.columns is None
                else {**entry.columns, "lease_expires_at": expires_at},
            )
            self._touched.append(slice_id)
        return renewed

    def closed_usage(self, session: Session, now: float, window: float) -> dict[str, float]:
        """What the charges of ended holdings add to each project's usage at ``now``
        in a hard ``window``: kept by a single writer, else read now."""
        session.flush()  # the transaction's own charges count
        kept = self._closed
        if kept is not None and kept.window_us == round(window * 1e6):
            usage = kept.usage(now)
            if usage is not None:
                return usage
        entries = ledger_since(session, now - window)
        charges = ClosedCharges(window)
        for entry in entries:
            charges.add(entry)
        usage = charges.usage(now)
        if usage is None:  # an entry ends after now (a clock gone back): entry by entry
            self._closed = None
            return usage_by_project(entries, (), now, window)
        self._closed = charges if self.single_writer else None
        return usage

    def live_values(self, session: Session) -> list[Slice]:
        """The live slices' values as ``session`` sees them, oldest first: from memory
        where they are kept (a single writer, a write under way), else read now."""
        if self.single_writer or self._transaction_depth:
            return [entry.slice for entry in self.live_slices(session).values()]
        return [_to_slice(row) for row in session.scalars(LIVE_ROWS)]

    def live_view(self, session: Session) -> Sequence[Slice]:
        """:meth:`live_values` without the copy where they are kept: a view to walk
        within ``session`` only (a later write changes it), when the walk may not come."""
        if self.single_writer or self._transaction_depth:
            return SliceValues(self.live_slices(session))
        return self.live_values(session)

    def _follow_flush(self, session: Session, _context: Any) -> None:
        """Keep the live slices as the flush just wrote them (ids only grow, so new
        slices go last and the order stays oldest first); a catalog row written
        changes the catalog. One walk over what the flush wrote: a pass's flush
        writes every slice it decided about."""
        self._writes_seen += 1
        for row in session.deleted:
            if isinstance(row, SliceRow):
                self._live = None
            elif isinstance(row, CATALOG_ROWS):
                self.catalog_changes()
        new = session.new
        for row in (*new, *session.dirty):
            if isinstance(row, LedgerRow):
                if self._closed is not None:
                    self._closed.add(_ledger_entry(row))
            elif isinstance(row, SliceRow):
                if self._live is None:
                    continue
                before = self._live.get(row.id)
                after = _LiveSlice.of(row, row in new) if row.state in LIVE_STATES else None
                if after is not None:
                    self._live[row.id] = after
                else:
                    self._live.pop(row.id, None)
                self._touched.append(row.id)
                if self._holders is not None:
                    self._move_holdings(row.id, before, after)
                if self._tallies is not None:
                    if before is not None:
                        _tally(self._tallies, before.slice, -1)
                    if after is not None:
                        _tally(self._tallies, after.slice, 1)
            elif isinstance(row, CATALOG_ROWS):
                self.catalog_changes()

    def _follow_statement(self, state: ORMExecuteState) -> None:
        """A statement that inserts, updates or deletes rows without the flush (a bulk
        ``delete``): of catalog rows, it changes the catalog; of slices, the live
        slices are read again."""
        if not (state.is_insert or state.is_update or state.is_delete):
            return
        self._writes_seen += 1
        classes = {mapper.class_ for mapper in state.all_mappers}
        if classes.intersection(CATALOG_ROWS):
            self.catalog_changes()
        if SliceRow in classes:
            self._live = None
        if LedgerRow in classes:
            self._closed = None

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only session (inside a group commit: the group's, to see what it wrote)."""
        if self._group is not None:  # a write's answer: it sees what the group wrote
            yield self._group
            return
        with self._reads() as session:
            yield session
        if self.single_writer and self.committed is None and not self._transaction_depth:
            # No write under way: what it kept (loaded again, maybe) is what was committed.
            self._publish(self._as_committed())


def _tally(tallies: dict[str, list[int]], slice_: Slice, sign: int) -> None:
    """Count live ``slice_`` in (``sign`` 1) or out (-1) of its project's
    ``[waiting, GPUs held]``."""
    counts = tallies.setdefault(slice_.project, [0, 0])
    if slice_.state is SliceState.PENDING:
        counts[0] += sign
    else:
        counts[1] += sign * slice_.gpus


def ledger_since(session: Session, since: float) -> list[LedgerEntry]:
    """The charges of holdings that ended after ``since``."""
    # Plain rows, not ORM objects: the window's ledger is the largest thing read (an
    # entry per holding ended in it), and an object per entry cost more than the
    # rest of the read.
    rows = session.execute(
        select(
            LedgerRow.slice_id,
            LedgerRow.project,
            LedgerRow.user,
            LedgerRow.start,
            LedgerRow.end,
            LedgerRow.gpus,
            LedgerRow.weight,
        ).where(LedgerRow.end > since)
    )
    return [
        LedgerEntry(slice_id, project, user, start, end, gpus * weight, gpus)
        for slice_id, project, user, start, end, gpus, weight in rows
    ]


class _Catalog:
    """What nearly every request reads and only admins, the inventory and a pass's
    node changes write: the nodes, the GPU types' weights, the project tree and its
    members. A Broker that is its database's single writer keeps it in memory."""

    def __init__(self, session: Session):
        rows = session.scalars(select(NodeRow).order_by(NodeRow.name)).all()
        self.nodes = tuple(_node(row) for row in rows)
        self.weights = _weights(session)
        # The API's view of each node, but for the GPUs held on it (which change with
        # every grant and end: see Journal.gpus_held).
        self.node_views = tuple(_node_dict(row, self.weights, 0) for row in rows)
        self.costs = _Costs({node.name: node.gpu_type for node in self.nodes}, self.weights)
        self.accounts = tuple(_accounts(session))
        self.tree = ProjectTree(self.accounts)
        self.members = _members(session)
        self.known_gpu_types = set(self.weights) | {node.gpu_type for node in self.nodes}

    def is_member(self, project: str, user: str, groups: Iterable[str]) -> bool:
        users, member_groups = self.members.get(project, (set(), set()))
        return user in users or not member_groups.isdisjoint(groups)


@dataclass(frozen=True)
class Committed:
    """What a single writer's last commit left of what it keeps, for readers on
    other threads (the service's event loop answers live slices and nodes from it,
    design.md §8): built by the database thread at each commit and never changed
    after, so a reader holding one sees one commit whole, whatever is written
    meanwhile."""

    #: The live slices, by id, oldest first.
    live: CommittedLive
    catalog: _Catalog

    @functools.cached_property
    def gpus_held(self) -> Mapping[str, int]:
        """GPUs held per node (nodes holding none may be missing): counted by the
        first reader that asks, not at every commit (most are never asked)."""
        held: dict[str, int] = {}
        for entry in self.live.values():
            if entry.slice.holds_gpus:
                for placement in entry.slice.placements:
                    held[placement.node] = held.get(placement.node, 0) + len(placement.gpu_indices)
        return held


class SliceValues(Sequence[Slice]):
    """The values of kept live slices, oldest first, as a sequence over a mapping of
    them that is never changed (a commit's copy): walked only when iterated."""

    def __init__(self, live: Mapping[int, _LiveSlice]):
        self._live = live
        self._values: tuple[Slice, ...] | None = None

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Slice]:
        return (entry.slice for entry in self._live.values())

    def __getitem__(self, index: Any) -> Any:
        if self._values is None:
            self._values = tuple(self)
        return self._values[index]


class LiveViews(Mapping[int, dict[str, Any]]):
    """The API's views of kept live slices, by id, oldest first: looked up as asked,
    not copied (a pass tells its caller of thousands, which asks of a few)."""

    def __init__(self, live: Mapping[int, _LiveSlice]):
        self._live = live

    def __getitem__(self, slice_id: int) -> dict[str, Any]:
        return self._live[slice_id].view

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)


@dataclass(frozen=True)
class _LiveSlice:
    """A live slice kept in memory: the core's value for the pass, and the API's view
    (charged as journaled). Never changed in place: a change makes a new one."""

    slice: Slice
    view: dict[str, Any]
    # The row's columns as written, from which a write rebuilds the row instead of
    # reading it (Journal.row); None where the row did not have them all loaded.
    columns: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: SliceRow, inserted: bool = False) -> _LiveSlice:
        """``row`` as kept; ``inserted``: the flush that wrote it was its insert, which
        left the columns it gave no value NULL."""
        loaded = row.__dict__
        columns: dict[str, Any] | None = {}
        for key in _SLICE_COLUMNS:
            if key in loaded:
                columns[key] = loaded[key]
            elif inserted and key in _NULL_UNLESS_GIVEN:
                columns[key] = None
            else:
                columns = None
                break
        return cls(_to_slice(row), _row_view(row), columns)


#: A commit's copy of the live slices is copied whole again once the slices written
#: since the last whole copy number more than this many, or this share of them.
REBASE_AFTER = 8
REBASE_SHARE = 1 / 8


class CommittedLive(Mapping[int, _LiveSlice]):
    """The live slices as a commit left them, by id, oldest first: a copy of them
    all, shared with the commits after it, and the slices written since that copy
    (None: no longer live). So a commit copies what was written since the last
    whole copy, not every live slice (100 µs and more at 10,000); the whole copy
    is made again once that list grows past :data:`REBASE_AFTER` and
    :data:`REBASE_SHARE` of the slices. Never changed after it is made."""

    def __init__(
        self, base: dict[int, _LiveSlice], written: dict[int, _LiveSlice | None], count: int
    ):
        self._base, self._written, self._count = base, written, count

    def then(self, live: Mapping[int, _LiveSlice], written: Iterable[int]) -> CommittedLive:
        """The next commit's copy: ``live`` the kept slices as it leaves them,
        ``written`` the ids written since this copy was made."""
        since = dict(self._written)
        for slice_id in written:
            since[slice_id] = live.get(slice_id)
        if len(since) > max(REBASE_AFTER, len(live) * REBASE_SHARE):
            return CommittedLive(dict(live), {}, len(live))
        return CommittedLive(self._base, since, len(live))

    def get(self, slice_id: int, default: Any = None) -> Any:
        if slice_id in self._written:
            entry = self._written[slice_id]
            return default if entry is None else entry
        return self._base.get(slice_id, default)

    def __getitem__(self, slice_id: int) -> _LiveSlice:
        entry = self.get(slice_id)
        if entry is None:
            raise KeyError(slice_id)
        return entry

    def __contains__(self, slice_id: object) -> bool:
        return self.get(slice_id) is not None  # type: ignore[arg-type]

    def items(self) -> Iterable[tuple[int, _LiveSlice]]:  # type: ignore[override]
        """``(id, slice)`` oldest first, walked once: without the lookup per id that
        the mapping's own views make (5 to 30 times slower at 10,000)."""
        return self._base.items() if not self._written else self._merged()

    def values(self) -> Iterable[_LiveSlice]:  # type: ignore[override]
        """The slices oldest first, walked once (see :meth:`items`)."""
        if not self._written:
            return self._base.values()
        return (entry for _, entry in self._merged())

    def _merged(self) -> Iterator[tuple[int, _LiveSlice]]:
        written, base = self._written, self._base
        for slice_id, entry in base.items():
            if slice_id in written:
                entry = written[slice_id]
                if entry is None:
                    continue
            yield slice_id, entry
        # Ids only grow: those written since the copy and not in it come after it.
        for slice_id, entry in written.items():
            if entry is not None and slice_id not in base:
                yield slice_id, entry

    def __iter__(self) -> Iterator[int]:
        return iter(self._base) if not self._written else (i for i, _ in self._merged())

    def __len__(self) -> int:
        return self._count
