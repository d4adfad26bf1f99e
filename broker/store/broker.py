"""The Broker: the one place that reads and writes the broker's database.

It turns requests (submit, release, heartbeat, admin changes) into rows,
builds the scheduler's :class:`~broker.core.model.Snapshot` from them, and applies
the :class:`~broker.core.model.Decisions` a pass returns — each in one transaction
(:mod:`.journal` says how). This module holds the Broker's requests, its projects and
the scheduling pass; the package's other modules what they share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence, Set
from functools import partial
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ..config import ClusterConfig, format_duration
from ..core import accounting, transitions, whatif
from ..core.extension import ExtensionRefused, extended_contract
from ..core.fairshare import ProjectTree
from ..core.incremental import PassState, wake_times
from ..core.model import (
    Account,
    Contract,
    Decisions,
    EndReason,
    Node,
    NodeState,
    Placement,
    Policy,
    QueueEntry,
    Reservation,
    Slice,
    SliceKind,
    SliceState,
    Snapshot,
)
from ..core.scheduler import schedule as default_schedule
from ..errors import BrokerError, Conflict, InvalidConfig, InvalidRequest, NotFound
from ..orm import (
    DRAINED_BY_ADMIN,
    AccountRow,
    BrokerAliveRow,
    GpuTypeRow,
    LedgerRow,
    MemberRow,
    NodeRow,
    ProjectEventRow,
    SliceEventRow,
    SliceRow,
)
from ..validation import REASON_MAX_LENGTH, check_text
from .access import Principal, _check_member, _check_owner, _owned_row
from .inventory import ADMIN_NODE_STATES, _set_node, _sync_nodes, _take_inventory
from .journal import Journal, LiveViews, _Catalog, _LiveSlice, ledger_since, not_durable
from .lapses import LATE_HEARTBEAT_S, LateAnswers, RecentLapses
from .projects import (
    CONTROL_CHARACTERS,
    _add_members,
    _member_names,
    _record,
    _tree_changes,
    _wanted_states,
    _write_tree,
)
from .rows import (
    HELD_STATES,
    LIVE_STATES,
    _accounts,
    _Costs,
    _kind_or_none,
    _ledger_entry,
    _members,
    _placement_json,
    _placements,
    _to_slice,
    _tree,
    _update,
    _write_state,
)
from .views import (
    _account_states,
    _config_states,
    _kept_dict,
    _project_event_dict,
    _slice_dict,
)

# One logger for the whole store, whichever of its modules logs.
log = logging.getLogger("broker.store")

DEFAULT_LEASE_S = 120.0

Schedule = Callable[[Snapshot], Decisions]


class Broker:
    """Slices, projects, nodes and the ledger in a database at ``url``.

    ``config`` is the cluster configuration; on open its GPU types and nodes are
    written to the database (admin node states survive). The database is the
    record of the project tree and its members: the file's accounts and members
    seed it on the first start only, and later change only through
    :meth:`put_project`, :meth:`delete_project` and :meth:`apply_tree`, each
    recorded in :meth:`project_events`. ``clock``
    is the one source of "now" (seconds since the epoch). ``schedule`` is the
    scheduling pass. ``lease`` is how long (seconds) a heartbeat keeps a slice
    alive; a heartbeat answered ``late_heartbeat`` seconds or more after it came
    marks the broker as behind, and no lease runs out over that time (0: never;
    :class:`~.lapses.LateAnswers`). ``upgrade`` lets an out-of-date database be migrated on open;
    otherwise that raises :class:`~broker.orm.DatabaseOutOfDate` (a blank
    database is always initialised). ``usual_gap``: see :meth:`run_pass_and_live`.
    ``db_timeout``: how long (seconds) one statement may wait for the database (see
    :func:`~broker.orm.make_engine`).
    ``single_writer``: no other process writes this database (the service's leader,
    behind its leader lock, design.md §8), so the catalog — nodes, GPU types, the
    project tree and members — is read once and kept in memory, reloaded only after
    this Broker changed it; so are the live slices, and the default pass keeps its
    state between passes (:class:`~broker.core.incremental.PassState`).
    """

    def __init__(
        self,
        url: str,
        config: ClusterConfig,
        clock: Callable[[], float] = time.time,
        *,
        schedule: Schedule = default_schedule,
        lease: float = DEFAULT_LEASE_S,
        late_heartbeat: float = LATE_HEARTBEAT_S,
        upgrade: bool = False,
        usual_gap: float | None = None,
        db_timeout: float | None = None,
        single_writer: bool = False,
    ):
        self.config = config
        self.single_writer = single_writer
        self._running_charges = accounting.RunningCharges() if single_writer else None
        # The pass's index of the live slices, kept between passes; what-if passes
        # start from copies of it.
        self._kept_index: PassState | None = None
        # Where the journal's list of written live slices stood at the last pass.
        self._live_mark: tuple[int, int] | None = None
        if single_writer and schedule is default_schedule:
            # The same decisions, with what the pass finds by walking every live
            # slice kept between passes (design.md §5).
            self._kept_index = PassState()
            schedule = partial(default_schedule, index=self._kept_index)
        self._clock = clock
        self._schedule = schedule
        self.lease = lease
        self.usual_gap = usual_gap
        self.lapses = RecentLapses()  # for the pass's lease lapse limit
        self.late_answers = LateAnswers(late_heartbeat)  # answered late: leases wait
        # When the last committed pass ran, as its row says: kept by a single writer only.
        self._alive_at: float | None = None
        self.journal = Journal(url, db_timeout, single_writer=single_writer)
        try:
            self.journal.prepare_schema(upgrade)
            self._sync_config()
        except BaseException:
            self.journal.engine.dispose()
            raise

    def close(self) -> None:
        self.journal.engine.dispose()

    # ---- configuration ---------------------------------------------------------

    def _sync_config(self) -> None:
        """Write the configuration file's GPU types and nodes into the database, and
        its project tree and members too on the first start (a database that never
        had any); log where the tree came from."""
        config = self.config
        with self.journal.write() as session:
            now = self._clock()
            session.execute(delete(GpuTypeRow))
            session.add_all(
                GpuTypeRow(name=n, weight=w) for n, w in config.gpu_type_weights.items()
            )
            _sync_nodes(session, config.nodes, now)
            first_start = session.scalars(select(AccountRow.name).limit(1)).first() is None
            first_start = (
                first_start and session.scalars(select(ProjectEventRow.id).limit(1)).first() is None
            )
            if first_start:
                _write_tree(session, {}, _config_states(config), f"file {config.source}", now)
                log.info(
                    "project tree: seeded from the cluster file %s (%d accounts)",
                    config.source,
                    len(config.accounts),
                )
                return
            current = _account_states(session)
            differ = len(_tree_changes(current, _config_states(config)))
        note = (
            f"; the cluster file {config.source} differs in {differ} accounts and is not "
            "applied (slicebroker apply-config FILE shows and applies the difference)"
            if differ
            else ""
        )
        log.info("project tree: from the database (%d accounts)%s", len(current), note)

    def sync_inventory(self, nodes: Iterable[Node]) -> None:
        """Make the database's nodes those of a live inventory (e.g. Kubernetes).

        New nodes are added, missing ones go ``down``, and each node takes the
        inventory's state, except that an admin's drain holds until an admin
        undrains the node (the inventory's ``down`` still wins), and a
        ``drained`` node stays drained while the inventory still says
        ``draining``. GPU types without a weight get 1.0.
        """
        nodes = list(nodes)
        with self.journal.write() as session:
            _take_inventory(session, nodes, self._clock())

    # ---- slices: requests --------------------------------------------------------

    def submit(self, **request: Any) -> dict[str, Any]:
        """:meth:`submit_once`'s slice alone (its keyword arguments are the request)."""
        return self.submit_once(**request)[0]

    def submit_once(
        self,
        *,
        principal: Principal,
        project: str,
        gpus: int,
        kind: str,
        min_runtime: float | None = None,
        gpu_type: str | None = None,
        resumable: bool | None = None,
        max_runtime: float | None = None,
        priority: int = 0,
        idempotency_key: str | None = None,
        restores: int | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Queue a request of ``principal``'s (its user: the slice's) for ``gpus`` GPUs
        charged to ``project``: the new slice, and whether it is new (``False``: a
        replay).

        ``restores`` names a slice of the user's that a preemption or a node going
        down ended (a session brought back, design.md §3; a batch command the runner
        asks again for): the new request keeps its place in its project's queue (its
        submit time) and its preemptions so far, once, and a preempted resumable batch
        job the longer protection the broker's requeue would give it; :class:`Conflict`
        for a slice that is still live, ended otherwise, or was restored already.

        Contract terms left ``None`` come from the configuration's defaults for
        the kind. Raises :class:`InvalidRequest` for a request that can never be
        granted and :class:`Forbidden` unless ``principal`` (by name or one of its
        groups) is a member of ``project`` or an admin. Nothing is written then.

        A submission of the user's with an ``idempotency_key`` they used before
        changes nothing and answers the slice the first one made, whatever state
        it is in now: a client that timed out and retried gets one slice, not two.
        The same key with another request is a :class:`Conflict`.
        """
        digest = _request_digest(
            project=project,
            gpus=gpus,
            kind=kind,
            min_runtime=min_runtime,
            gpu_type=gpu_type,
            resumable=resumable,
            max_runtime=max_runtime,
            priority=priority,
            **({} if restores is None else {"restores": restores}),
        )
        user = principal.name
        for name in (user, *principal.groups):
            if not isinstance(name, str) or CONTROL_CHARACTERS.search(name):
                raise InvalidRequest(f"a user or group name has control characters: {name!r:.80}")
        min_runtime, resumable, max_runtime = self._with_defaults(
            kind, min_runtime, resumable, max_runtime
        )
        with self.journal.write() as session:
            if idempotency_key is not None:
                first = session.scalars(
                    select(SliceRow).where(
                        SliceRow.user == user, SliceRow.idempotency_key == idempotency_key
                    )
                ).first()
                if first is not None:
                    if first.request_digest != digest:
                        raise Conflict(
                            f"Idempotency-Key {idempotency_key!r:.80} was used for another "
                            f"request (slice {first.id}); use a new key for a new request"
                        )
                    now = self._clock()
                    return _slice_dict(first, now, self.journal.catalog(session).costs), False
            catalog = self.journal.catalog(session)
            self._check_request(
                catalog,
                resumable,
                gpus=gpus,
                kind=kind,
                min_runtime=min_runtime,
                max_runtime=max_runtime,
                gpu_type=gpu_type,
                priority=priority,
                project=project,
            )
            _check_member(catalog, project, principal)
            now = self._clock()
            restored = None if restores is None else _restorable_row(session, restores, user)
            row = _pending_row(
                project=project,
                user=user,
                gpus=gpus,
                gpu_type=gpu_type,
                kind=SliceKind(kind).value,
                min_runtime=float(min_runtime),  # type: ignore[arg-type]  # validated
                resumable=resumable,
                max_runtime=None if max_runtime is None else float(max_runtime),
                priority=priority,
                submitted_at=now if restored is None else restored.submitted_at,
                idempotency_key=idempotency_key,
                request_digest=None if idempotency_key is None else digest,
            )
            if restored is not None:
                # Its place is kept; its wait before preempting counts from now, as a
                # requeued victim's does, and its preemptions still count.
                row.queued_at, row.preemptions = now, restored.preemptions
                longer = _protected_again(restored, self.config.policy)
                if longer is not None and longer > row.min_runtime:
                    row.min_runtime = longer
            session.add(row)
            session.flush()
            if restored is None:
                _event(session, row, None, "submitted", now)
            else:
                _event(session, row, None, f"submitted: restores slice {restored.id}", now)
                restored.replaced_by = row.id
            return _slice_dict(row, now, _Costs()), True

    def _with_defaults(
        self,
        kind: object,
        min_runtime: float | None = None,
        resumable: bool | None = None,
        max_runtime: float | None = None,
    ) -> tuple[float | None, bool | None, float | None]:
        """``(min_runtime, resumable, max_runtime)`` of a request of ``kind``: those it
        gives, the configuration's defaults for the kind for those it leaves ``None``."""
        defaults = self.config.defaults.get(_kind_or_none(kind))
        if defaults is None:
            return min_runtime, resumable, max_runtime
        return (
            defaults.min_runtime if min_runtime is None else min_runtime,
            defaults.resumable if resumable is None else resumable,
            defaults.max_runtime if max_runtime is None else max_runtime,
        )

    def _check_request(self, catalog: _Catalog, resumable: object, **terms: Any) -> None:
        """:class:`InvalidRequest` for a request that can never be granted: ``terms``
        (gpus, kind, protected and maximum runtime, GPU type, priority, project) as
        :func:`~broker.validation.validate_slice_request` takes them, on ``catalog``."""
        from ..validation import validate_slice_request

        validate_slice_request(
            **terms,
            tree=catalog.tree,
            nodes=list(catalog.nodes),
            policy=self.config.policy,
            known_gpu_types=catalog.known_gpu_types,
        )
        if not isinstance(resumable, bool):
            raise InvalidRequest(f"resumable must be true or false, got {resumable!r}")

    def replace(
        self,
        slice_id: int,
        *,
        project: str,
        gpus: int,
        kind: str,
        min_runtime: float | None,
        gpu_type: str | None = None,
        groups: Iterable[str] = (),
        caller: Principal | None = None,
    ) -> dict[str, Any]:
        """Withdraw waiting ``slice_id`` and queue in its place the same request with
        these terms (one of its alternatives, design.md §5.8): one transaction, so
        both happen or neither. The new slice is the same user's, keeps the old one's
        place in its project's queue (its submit time) and its other terms (resumable,
        max runtime, priority); the new one.

        :class:`Conflict` unless ``slice_id`` is pending; :class:`Forbidden` for
        another user's slice, as :meth:`release`, and for a project its user (or
        ``groups``) may not charge unless ``caller`` is an admin; :class:`InvalidRequest` for
        terms that can never be granted.
        """
        with self.journal.write() as session:
            old = _owned_row(self.journal, session, slice_id, caller)
            if old.state != SliceState.PENDING.value:
                raise Conflict(
                    f"slice {slice_id} is {old.state} now, not waiting: nothing replaced"
                )
            min_runtime = self._with_defaults(kind, min_runtime)[0]
            catalog = self.journal.catalog(session)
            self._check_request(
                catalog,
                old.resumable,
                gpus=gpus,
                kind=kind,
                min_runtime=min_runtime,
                max_runtime=old.max_runtime,
                gpu_type=gpu_type,
                priority=old.priority,
                project=project,
            )
            if project != old.project:
                admin = caller is not None and caller.admin
                _check_member(catalog, project, Principal(old.user, frozenset(groups), admin))
            now = self._clock()
            new = _pending_row(
                project=project,
                user=old.user,
                gpus=gpus,
                gpu_type=gpu_type,
                kind=SliceKind(kind).value,
                min_runtime=float(min_runtime),  # type: ignore[arg-type]  # validated
                resumable=old.resumable,
                max_runtime=old.max_runtime,
                priority=old.priority,
                submitted_at=old.submitted_at,
                lease_expires_at=old.lease_expires_at,
            )
            session.add(new)
            session.flush()
            _event(session, new, None, f"submitted: replaces slice {old.id}", now)
            costs = catalog.costs
            why = f"cancelled: replaced by slice {new.id}"
            self._end(session, old, EndReason.CANCELLED, now, costs, why=why)
            old.replaced_by = new.id
            return _slice_dict(new, now, costs)

    def release(self, slice_id: int, *, caller: Principal | None = None, why: str = "") -> dict:
        """Cancel a pending slice or release a held one (charging its held time).

        A ``caller`` may release only their own slices (:class:`Forbidden`); an
        agent or an admin, or no ``caller``, any. Releasing an ended slice changes nothing.
        ``why`` is the event's reason when the releaser is not the holder (e.g. a
        backend whose job ended: ``released: job 12 FAILED in Slurm``).
        """
        with self.journal.write() as session:
            row = _owned_row(self.journal, session, slice_id, caller)
            now = self._clock()
            costs = self.journal.catalog(session).costs
            if row.state == SliceState.PENDING:
                why_text = f"cancelled: {why}" if why else "cancelled"
                self._end(session, row, EndReason.CANCELLED, now, costs, why=why_text)
            elif row.state in HELD_STATES:
                why_text = f"released: {why}" if why else "released"
                self._end(session, row, EndReason.RELEASED, now, costs, why=why_text)
            return _slice_dict(row, now, costs)

    # Not durable: a heartbeat lost to a power failure costs its holder one heartbeat's
    # worth of lease, and the restarted service extends every lease by the time it was
    # away (_cover_absence). Saves an fsync per heartbeat.
    @not_durable
    def heartbeat(self, slice_id: int, *, caller: Principal | None = None) -> dict:
        """Extend a live slice's lease to ``now + lease``; returns the slice.

        Once a slice is heartbeated it must keep being heartbeated, also while it
        waits: a lapsed lease ends it (``lost``). An ended slice is returned as it is.
        ``caller`` as for :meth:`release`.
        """
        (answer,) = self.heartbeats([(slice_id, caller)])
        if isinstance(answer, BrokerError):
            raise answer
        return answer

    @not_durable
    def heartbeats(
        self, asked: Sequence[tuple[int, Principal | None]]
    ) -> list[dict[str, Any] | BrokerError]:
        """:meth:`heartbeat` of each ``(slice_id, caller)``, in one write: the leases
        of the slices kept in memory are renewed by one statement, so that a group of
        heartbeats costs the database one round trip, not one each. Each answer is
        the slice, or the error its heartbeat alone raises (nothing written for it)."""
        with self.journal.write() as session:
            now = self._clock()
            costs = self.journal.catalog(session).costs
            answers: list[dict[str, Any] | BrokerError | int] = []
            for slice_id, caller in asked:
                try:
                    kept = self._owned_kept(session, slice_id, caller)
                    if kept is not None:
                        answers.append(slice_id)  # renewed below, with the others
                        continue
                    # Not kept in memory, or not live: the row.
                    row = _owned_row(self.journal, session, slice_id, caller)
                    if row.state in LIVE_STATES:
                        row.lease_expires_at = now + self.lease
                    answers.append(_slice_dict(row, now, costs))
                except BrokerError as err:
                    answers.append(err)
            ids = [answer for answer in answers if isinstance(answer, int)]
            renewed = self.journal.renew_leases(session, ids, now + self.lease) if ids else {}
            return [
                _kept_dict(renewed[a].view, renewed[a].slice, now, costs)
                if isinstance(a, int)
                else a
                for a in answers
            ]

    def extend_protection(
        self, slice_id: int, by: float, *, caller: Principal | None = None
    ) -> dict:
        """Extend a granted slice's protection by ``by`` seconds from the later of its
        end and now, within the contract's caps (:mod:`broker.core.extension`); returns
        the slice. :class:`Conflict` says why when the extension is refused.
        ``caller`` as for :meth:`release`.
        """
        with self.journal.write() as session:
            row = _owned_row(self.journal, session, slice_id, caller)
            now = self._clock()
            try:
                contract = extended_contract(_to_slice(row), by, now, self.config.policy)
            except ExtensionRefused as err:
                raise Conflict(err.describe(format_duration)) from None
            row.min_runtime = contract.min_runtime
            reason = f"protection extended by {format_duration(round(by))}"
            _event(session, row, SliceState(row.state), reason, now)
            return _slice_dict(row, now, self.journal.catalog(session).costs)

    # Not durable, as a heartbeat: a checkpoint lost to a power failure only makes the
    # slice look to have more work at risk than it has.
    @not_durable
    def checkpoint(self, slice_id: int, *, caller: Principal | None = None) -> dict:
        """Record that the holder of a slice that holds GPUs checkpointed now: among
        otherwise equal victims, the one with the least work since its grant or its last
        checkpoint is preempted first (design.md §5.3). Returns the slice.

        :class:`Conflict` for a slice that holds no GPUs (waiting or ended): it has no
        work to lose. ``caller`` as for :meth:`release`.
        """
        with self.journal.write() as session:
            row = _owned_row(self.journal, session, slice_id, caller)
            if row.state not in HELD_STATES:
                raise Conflict(
                    f"slice {slice_id} is {row.state}: only a slice that holds GPUs has work "
                    "to checkpoint"
                )
            now = self._clock()
            row.checkpointed_at = now
            return _slice_dict(row, now, self.journal.catalog(session).costs)

    def get_slice(self, slice_id: int, *, caller: Principal | None = None) -> dict:
        """The slice, as design.md §8 shows it; :class:`Forbidden` if ``caller`` may not see it.
        A single writer answers a live slice from its kept copy, reading no row."""
        with self.journal.read() as session:
            now, costs = self._clock(), self.journal.catalog(session).costs
            kept = self._owned_kept(session, slice_id, caller)
            if kept is None:
                return _slice_dict(_owned_row(self.journal, session, slice_id, caller), now, costs)
            return _kept_dict(kept.view, kept.slice, now, costs)

    def _owned_kept(
        self, session: Session, slice_id: int, caller: Principal | None
    ) -> _LiveSlice | None:
        """Live slice ``slice_id`` as the single writer keeps it, once ``caller`` may see
        it (as :func:`_owned_row` checks a row); None where it is not kept."""
        kept = self.journal.kept_live(session, slice_id)
        if kept is not None:
            _check_owner(slice_id, kept.view["user"], caller)
        return kept

    def list_slices(
        self,
        *,
        state: str | None = None,
        project: str | None = None,
        user: str | None = None,
    ) -> list[dict[str, Any]]:
        """Slices matching every filter given, oldest first. ``state="live"`` means not ended.

        A single writer answers live states from its kept copies, reading no row: the
        pages and the queue ask for every live slice on each refresh."""
        if state is not None and state != "live" and state not in set(SliceState):
            choices = ", ".join([*(s.value for s in SliceState), "live"])
            raise InvalidRequest(f"unknown state {state!r}; expected one of {choices}")
        if self.journal.single_writer and (state == "live" or state in LIVE_STATES):
            with self.journal.read() as session:
                now, costs = self._clock(), self.journal.catalog(session).costs
                live = self.journal.live_slices(session).values()
                return _live_views(live, state, project, user, now, costs)
        query = select(SliceRow).order_by(SliceRow.id)
        if state == "live":
            query = query.where(SliceRow.state.in_(LIVE_STATES))
        elif state is not None:
            query = query.where(SliceRow.state == state)
        if project is not None:
            query = query.where(SliceRow.project == project)
        if user is not None:
            query = query.where(SliceRow.user == user)
        with self.journal.read() as session:
            now, costs = self._clock(), self.journal.catalog(session).costs
            return [_slice_dict(row, now, costs) for row in session.scalars(query)]

    # ---- reads off the database thread ------------------------------------------

    def committed_slice(
        self, slice_id: int, *, caller: Principal | None = None
    ) -> dict[str, Any] | None:
        """:meth:`get_slice` of a slice live at the last commit, from what that commit
        left (:class:`~.journal.Committed`): safe on any thread, as every method named
        ``committed_*``. None where that does not hold the slice: ask :meth:`get_slice`."""
        committed = self.journal.committed
        kept = None if committed is None else committed.live.get(slice_id)
        if kept is None:
            return None
        _check_owner(slice_id, kept.view["user"], caller)
        return _kept_dict(kept.view, kept.slice, self._clock(), committed.catalog.costs)

    def committed_live_slices(
        self, *, state: str = "live", project: str | None = None, user: str | None = None
    ) -> list[dict[str, Any]] | None:
        """:meth:`list_slices` of live states from what the last commit left; None where
        it is not kept or ``state`` is not ``live`` or a live state."""
        committed = self.journal.committed
        if committed is None or not (state == "live" or state in LIVE_STATES):
            return None
        live, costs = committed.live.values(), committed.catalog.costs
        return _live_views(live, state, project, user, self._clock(), costs)

    def committed_nodes(self) -> list[dict[str, Any]] | None:
        """:meth:`nodes` as the last commit left them; None where that is not kept."""
        committed = self.journal.committed
        if committed is None:
            return None
        return _node_views(committed.catalog, committed.gpus_held)

    def live_slice_ids(self) -> set[int]:
        """The ids of the slices not ended (pending, granted, preempting)."""
        with self.journal.read() as session:
            return set(session.scalars(select(SliceRow.id).where(SliceRow.state.in_(LIVE_STATES))))

    def events(self, slice_id: int, *, caller: Principal | None = None) -> list[dict]:
        """A slice's state transitions, oldest first: ``{at, from_state, to_state, reason}``;
        :class:`Forbidden` if ``caller`` may not see the slice."""
        with self.journal.read() as session:
            _owned_row(self.journal, session, slice_id, caller)
            rows = session.scalars(
                select(SliceEventRow)
                .where(SliceEventRow.slice_id == slice_id)
                .order_by(SliceEventRow.id)
            )
            return [
                {"at": r.at, "from_state": r.from_state, "to_state": r.to_state, "reason": r.reason}
                for r in rows
            ]

    def alternatives(
        self, slice_id: int, *, caller: Principal | None = None, compute: bool = True
    ) -> dict[str, Any]:
        """What would start pending slice ``slice_id`` sooner (design.md §5.8):
        ``{slice_id, now, starts_at, alternatives: [{change, fields, starts_at,
        gpu_hours}]}``, computed on the live state as the next pass would see it;
        an empty list for a slice that does not wait, and with ``compute`` off (the
        service's what-if budget is spent: the checks alone). :class:`Forbidden` if
        ``caller`` may not see it."""
        with self.journal.read() as session:
            # Who may ask, from the kept copy of a live slice where there is one.
            kept = self._owned_kept(session, slice_id, caller)
            if kept is not None:
                state, user = kept.slice.state.value, kept.slice.user
            else:
                row = _owned_row(self.journal, session, slice_id, caller)
                state, user = row.state, row.user
            now = self._clock()
            answer: dict[str, Any] = {"slice_id": slice_id, "now": now, "starts_at": None}
            if state != SliceState.PENDING.value or not compute:
                return {**answer, "alternatives": []}
            catalog = self.journal.catalog(session)
            snapshot = self._live_snapshot(session, catalog, now)
            groups = caller.groups if caller is not None and caller.name == user else ()
            projects = [
                name
                for name, (users, member_groups) in catalog.members.items()
                if user in users or member_groups.intersection(groups)
            ]
        found = whatif.alternatives(
            snapshot, slice_id, projects=projects, **self._what_if_base(catalog)
        )
        return {
            **answer,
            "starts_at": found.starts_at,
            "alternatives": [
                {
                    "change": a.change,
                    "fields": a.fields,
                    "starts_at": a.starts_at,
                    "gpu_hours": a.gpu_hours,
                }
                for a in found.alternatives
            ],
        }

    def expected_starts(
        self,
        *,
        principal: Principal,
        project: str,
        kind: str,
        min_runtime: float | None = None,
        compute: bool = True,
    ) -> dict[str, Any]:
        """When a new request of ``principal``'s for ``project`` would start, for each GPU
        type and each size up to the type's largest node (1, 2, 4, …), before it is
        made (design.md §5.8): ``{now, project, kind, min_runtime, starts: [{gpu_type,
        gpus, starts_at}]}``; no starts with ``compute`` off (the service's what-if
        budget is spent: the checks alone). Terms left out come from the kind's
        defaults. Raises :class:`Forbidden` unless ``principal`` may charge ``project``,
        and :class:`InvalidRequest` for terms no request may have."""
        min_runtime, resumable, max_runtime = self._with_defaults(kind, min_runtime)
        resumable = bool(resumable)  # a kind without defaults: not resumable
        with self.journal.read() as session:
            catalog = self.journal.catalog(session)
            self._check_request(
                catalog,
                resumable,
                gpus=1,
                kind=kind,
                min_runtime=min_runtime,
                max_runtime=max_runtime,
                gpu_type=None,
                priority=0,
                project=project,
            )
            _check_member(catalog, project, principal)
            now = self._clock()
            snapshot = self._live_snapshot(session, catalog, now) if compute else None
        answer = {
            "now": now,
            "project": project,
            "kind": SliceKind(kind).value,
            "min_runtime": float(min_runtime),  # type: ignore[arg-type]  # validated
            "starts": [],
        }
        if snapshot is None:
            return answer
        request = Slice(
            id=max((s.id for s in snapshot.slices), default=0) + 1,
            project=project,
            user=principal.name,
            gpus=1,
            kind=SliceKind(kind),
            contract=Contract(float(min_runtime), resumable, max_runtime),  # type: ignore[arg-type]
        )
        found = whatif.expected_starts(
            snapshot, request, whatif.request_shapes(catalog.nodes), **self._what_if_base(catalog)
        )
        answer["starts"] = [
            {"gpu_type": e.gpu_type, "gpus": e.gpus, "starts_at": e.starts_at} for e in found
        ]
        return answer

    def _what_if_base(self, catalog: _Catalog) -> dict[str, Any]:
        """Where what-if passes start: the kept index (copied) where there is one."""
        if self._kept_index is not None:
            return {"index": self._kept_index}
        return {"tree": catalog.tree}

    def _live_snapshot(self, session: Session, catalog: _Catalog, now: float) -> Snapshot:
        """The live state as the next pass would see it, for questions asked of it."""
        live = tuple(self.journal.live_values(session))
        return self._snapshot(
            catalog, now, live, self._usage_now(session, now, catalog.costs, live)
        )

    def _snapshot(
        self, catalog: _Catalog, now: float, slices: Sequence[Slice], usage: Mapping[str, float]
    ) -> Snapshot:
        """What a pass sees at ``now``: the catalog, ``slices`` and ``usage``, with the
        policy and what the lease rules remember (``store/lapses.py``)."""
        return Snapshot(
            now=now,
            nodes=catalog.nodes,
            accounts=catalog.accounts,
            slices=slices,
            usage=usage,
            gpu_type_weights=catalog.costs.weights,
            policy=self.config.policy,
            lapsed_last_minute=self.lapses.count(now),
            answered_late=self.late_answers.times(now),
            lease=self.lease,
        )

    # ---- the policy clients plan by ----------------------------------------------

    def limits(self) -> dict[str, Any]:
        """The terms a request is held to, for clients (the spawner's form) to plan by
        instead of copying them: the lease, the grace period, the protected period's cap,
        the debug lane's limits, the projects' GPU caps, the preemption budget and the
        contract defaults per kind (seconds; None: no limit)."""
        policy = self.config.policy
        return {
            "lease": self.lease,
            "grace_period": policy.grace_period,
            "max_min_runtime": policy.max_min_runtime,
            "debug_max_gpus": policy.debug_max_gpus,
            "debug_max_min_runtime": policy.debug_max_min_runtime,
            "project_gpu_caps": dict(sorted(policy.project_gpu_caps.items())),
            "preemption_budget": policy.preemption_budget,
            "defaults": {
                kind.value: {
                    "min_runtime": terms.min_runtime,
                    "resumable": terms.resumable,
                    "max_runtime": terms.max_runtime,
                }
                for kind, terms in self.config.defaults.items()
            },
        }

    # ---- nodes -------------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        """Every node: ``name, gpu_type, gpu_count, weight, state, state_reason,
        state_changed_at, in_config, drained_by, gpus_held``."""
        with self.journal.read() as session:
            catalog = self.journal.catalog(session)
            held = self.journal.gpus_held(session)
        return _node_views(catalog, held)

    def set_node_state(self, name: str, state: str, reason: str = "") -> dict[str, Any]:
        """An admin's drain (``draining``), undrain (``ready``) or ``down``; returns the node.

        Draining an already drained node keeps it drained. A drain or a ``down``
        holds until an admin sets the node ``ready``, whatever a live inventory
        says, except its ``down``. A node that left the configuration cannot be
        changed (:class:`Conflict`). ``reason`` is free text (:func:`check_text`):
        refused here, on every database alike, rather than by one of them.
        """
        check_text(reason, "reason", REASON_MAX_LENGTH)
        try:
            target = NodeState(state)
        except ValueError:
            target = None
        if target not in ADMIN_NODE_STATES:
            allowed = ", ".join(s.value for s in ADMIN_NODE_STATES)
            raise InvalidRequest(f"a node can be set to {allowed}; got {state!r}")
        with self.journal.write() as session:
            row = session.get(NodeRow, name)
            if row is None:
                raise NotFound(f"no node {name!r}")
            if not row.in_config:
                raise Conflict(f"node {name!r} is not in the configuration any more")
            now = self._clock()
            if not (target is NodeState.DRAINING and row.state == NodeState.DRAINED):
                _set_node(row, target, reason or f"set {target.value} by an admin", now)
            row.drained_by = None if target is NodeState.READY else DRAINED_BY_ADMIN
            session.flush()
        return next(node for node in self.nodes() if node["name"] == name)

    # ---- projects ------------------------------------------------------------------

    def put_project(
        self,
        name: str,
        *,
        share: float,
        parent: str | None = None,
        users: Iterable[str] | None = None,
        groups: Iterable[str] | None = None,
        who: str = "admin",
    ) -> dict[str, Any]:
        """Create or change an account (admin ``who``). ``users``/``groups`` replace the
        members when given. The new tree is checked before anything is written
        (:class:`InvalidRequest`); turning a project with live slices into a parent is a
        :class:`Conflict`. A change is recorded as a project event.
        """
        if not isinstance(name, str) or not name.strip() or len(name) > 255:
            raise InvalidRequest(f"an account needs a name, got {name!r}")
        users = None if users is None else _member_names(users, "users")
        groups = None if groups is None else _member_names(groups, "groups")
        with self.journal.write() as session:
            accounts = {a.name: a for a in _accounts(session)}
            accounts[name] = Account(name, share, parent)
            try:
                tree = ProjectTree(accounts.values())
            except InvalidConfig as err:
                raise InvalidRequest(err.message) from None
            if (users is not None or groups is not None) and not tree.is_project(name):
                raise InvalidRequest(f"{name!r} has sub-accounts; members belong on projects")
            if parent is not None and _tree(session).is_project(parent):
                self._check_can_become_parent(session, parent)
            before = _account_states(session).get(name)
            row = session.get(AccountRow, name) or AccountRow(name=name)
            row.share, row.parent = float(share), parent
            session.add(row)
            session.flush()
            if users is not None or groups is not None:
                old = session.scalars(select(MemberRow).where(MemberRow.project == name)).all()
                keep_users = {m.name for m in old if m.kind == "user"}
                keep_groups = {m.name for m in old if m.kind == "group"}
                session.execute(delete(MemberRow).where(MemberRow.project == name))
                _add_members(
                    session,
                    name,
                    keep_users if users is None else users,
                    keep_groups if groups is None else groups,
                )
                session.flush()
            after = _account_states(session)[name]
            if after != before:
                _record(session, name, who, self._clock(), "set", before, after)
        return next(row for row in self.projects() if row["name"] == name)

    def delete_project(self, name: str, *, who: str = "admin") -> dict[str, Any]:
        """Delete an account (admin ``who``) and its members; the project event recording it.

        :class:`NotFound` if there is none; :class:`Conflict` while it has
        sub-accounts or live slices. Its slices and charges stay in the history.
        """
        with self.journal.write() as session:
            states = _account_states(session)
            if name not in states:
                raise NotFound(f"no account {name!r}")
            children = sorted(n for n, state in states.items() if state["parent"] == name)
            if children:
                raise Conflict(
                    f"account {name!r} has sub-accounts ({', '.join(children)}); "
                    "delete or move them first"
                )
            live = _live_count(session, name)
            if live:
                raise Conflict(
                    f"project {name!r} has {live} live slice{'s' * (live != 1)}; release them first"
                )
            session.execute(delete(MemberRow).where(MemberRow.project == name))
            session.execute(delete(AccountRow).where(AccountRow.name == name))
            event = _record(session, name, who, self._clock(), "delete", states[name], None)
            session.flush()
            return _project_event_dict(event)

    def apply_tree(
        self, accounts: Iterable[Mapping[str, Any]], *, who: str = "admin", dry_run: bool = False
    ) -> list[dict[str, Any]]:
        """Make the project tree and members ``accounts`` (admin ``who``); the changes.

        Each account: ``name, share, parent`` and, for projects, ``users``/``groups``.
        The result lists each account that is added, removed or changed:
        ``{"account", "change", "before", "after"}`` (states as in
        :meth:`project_events`). ``dry_run``: only compute it. Refused
        (:class:`InvalidRequest`) for a tree that is not valid, and (:class:`Conflict`)
        when a project with live slices would be removed or get sub-accounts.
        """
        wanted = _wanted_states(accounts)
        if dry_run:
            with self.journal.read() as session:
                return _tree_changes(_account_states(session), wanted)
        with self.journal.write() as session:
            current = _account_states(session)
            changes = _tree_changes(current, wanted)
            tree = ProjectTree(Account(n, s["share"], s["parent"]) for n, s in wanted.items())
            for name in current:
                if (name not in wanted or not tree.is_project(name)) and _live_count(session, name):
                    raise Conflict(
                        f"project {name!r} has live slices; it cannot be removed or get "
                        "sub-accounts (release them first)"
                    )
            _write_tree(session, current, wanted, who, self._clock(), action="apply")
        return changes

    def project_events(self, project: str | None = None) -> list[dict[str, Any]]:
        """The changes of the project tree, oldest first (of ``project`` only, if given):
        ``{"id", "account", "who", "at", "action", "before", "after"}``, where
        ``before``/``after`` are ``{"share", "parent", "users", "groups"}`` or ``None``."""
        query = select(ProjectEventRow).order_by(ProjectEventRow.id)
        if project is not None:
            query = query.where(ProjectEventRow.account == project)
        with self.journal.read() as session:
            return [_project_event_dict(row) for row in session.scalars(query)]

    def _check_can_become_parent(self, session: Session, project: str) -> None:
        """A project that gets a sub-account stops being a project; refuse (:class:`Conflict`)
        what the configuration check would refuse of the result, and live work."""
        if _live_count(session, project):
            raise Conflict(f"project {project!r} has live slices; it cannot get sub-accounts")
        users, groups = _members(session).get(project, (set(), set()))
        if users or groups:
            raise Conflict(
                f"project {project!r} has members ({len(users)} users, {len(groups)} groups); "
                "members belong on projects, so it cannot get sub-accounts while it has "
                "them (give it empty users and groups first)"
            )
        if project in self.config.policy.project_gpu_caps:
            raise Conflict(
                f"project {project!r} has a GPU cap (policy project_gpu_caps); caps apply "
                "to projects, so it cannot get sub-accounts"
            )

    def projects(self) -> list[dict[str, Any]]:
        """The project tree, parents before children, siblings in fair-share order.

        Each row: ``name, parent, share, entitlement, is_project, usage`` (weighted
        GPU-seconds in the window, or decayed, summed over the subtree),
        ``fairshare_value`` (share used: its part of all usage over its entitlement,
        1 being exactly its share), ``rank`` (1-based among
        projects, lowest first; ``None`` for parents), ``users``, ``groups``,
        ``pending`` (slices waiting) and ``gpus_held``, both also summed over the
        subtree, as usage is.
        """
        with self.journal.read() as session:
            now = self._clock()
            catalog = self.journal.catalog(session)
            tree = catalog.tree
            live = self.journal.live_view(session)  # a single writer's counts walk none
            usage = self._usage_now(session, now, catalog.costs, live)
            subtree = tree.subtree_usage(usage)
            values = tree.share_used(usage)
            rank = {name: i + 1 for i, name in enumerate(tree.project_order(usage))}
            members = catalog.members
            tallies = self.journal.project_tallies(session, live)
        pending = {project: waiting for project, (waiting, _) in tallies.items()}
        held = {project: gpus for project, (_, gpus) in tallies.items()}
        # A parent's counts are its projects' (it holds nothing itself), as its usage is.
        pending_in = tree.subtree_usage(pending)
        held_in = tree.subtree_usage(held)
        rows = []
        stack = sorted(tree.children.get(None, []), key=lambda n: (values[n], n), reverse=True)
        while stack:
            name = stack.pop()
            account = tree.accounts[name]
            users, groups = members.get(name, (set(), set()))
            rows.append(
                {
                    "name": name,
                    "parent": account.parent,
                    "share": account.share,
                    "entitlement": tree.entitlements[name],
                    "is_project": tree.is_project(name),
                    "usage": subtree[name],
                    "fairshare_value": values[name],
                    "rank": rank.get(name),
                    "users": sorted(users),
                    "groups": sorted(groups),
                    "pending": round(pending_in[name]),
                    "gpus_held": round(held_in[name]),
                }
            )
            kids = tree.children.get(name, [])
            stack.extend(sorted(kids, key=lambda n: (values[n], n), reverse=True))
        return rows

    def usage_report(
        self,
        project: str,
        since: float | None = None,
        until: float | None = None,
        *,
        by: accounting.ReportBy = "user",
    ) -> list[dict[str, Any]]:
        """Charged usage of ``project`` (with its sub-accounts) in ``[since, until)``.

        Defaults: the lookback window up to now. Rows per project and user
        (``by="user"``) or per project, as :func:`broker.core.accounting.usage_rows`
        makes them; slices still running count up to now.
        """
        if by not in ("user", "project"):
            raise InvalidRequest(f"a report is by 'user' or 'project', not {by!r}")
        with self.journal.read() as session:
            now = self._clock()
            since = now - self.config.policy.window if since is None else since
            until = now if until is None else until
            catalog = self.journal.catalog(session)
            tree = catalog.tree
            if project in tree.accounts:
                names = [p for p in tree.projects if project in tree.paths[p]]
            elif session.scalar(select(LedgerRow.id).where(LedgerRow.project == project).limit(1)):
                names = [project]  # a project gone from the tree still has its history
            else:
                raise NotFound(f"no project {project!r}")
            closed = session.scalars(
                select(LedgerRow).where(
                    LedgerRow.project.in_(names), LedgerRow.end > since, LedgerRow.start < until
                )
            )
            entries = [_ledger_entry(row) for row in closed]
            costs = catalog.costs
            for slice_ in self._running(session, names):
                entry = costs.entry(slice_, now)
                if entry is not None:
                    entries.append(entry)
        return accounting.usage_rows(entries, since, until, by=by)

    def _running(self, session: Session, projects: Collection[str]) -> list[Slice]:
        """The slices of ``projects`` that hold GPUs: a single writer's kept copies (the
        pages ask for a report per day), else read."""
        if self.journal.single_writer:
            wanted = set(projects)
            return [
                slice_
                for slice_ in self.journal.live_values(session)
                if slice_.holds_gpus and slice_.project in wanted
            ]
        query = select(SliceRow).where(
            SliceRow.state.in_(HELD_STATES), SliceRow.project.in_(projects)
        )
        return [_to_slice(row) for row in session.scalars(query)]

    # ---- the scheduling pass ------------------------------------------------------

    def run_pass(self) -> Decisions:
        """Snapshot, schedule and apply, in one transaction under the write lock."""
        return self.run_pass_and_live()[0]

    def run_pass_and_live(
        self, usual_gap: float | None = None
    ) -> tuple[Decisions, Mapping[int, dict[str, Any]]]:
        """:meth:`run_pass`, and the live slices right after it by id (as
        ``list_slices`` shows them, oldest first, charged as journaled), read in the
        same transaction. The views are shared: not to be changed.

        The scheduling loop needs both; the pass has the live rows loaded
        already, so this saves reloading them (about as costly as the pass's
        own snapshot load); a single writer answers with what its commit left
        (:class:`~.journal.Committed`), copying nothing. ``usual_gap`` (seconds)
        is the longest time between two passes of a broker at work: past it, see
        :meth:`_cover_absence` (``None``: the Broker's own ``usual_gap``; ``None``
        there too: passes are driven by hand, as in tests, and leases are left alone).
        """
        with self.journal.write() as session:
            # Read the clock only once the lock is held, so passes see time move forward.
            now = self._clock()
            decisions, alive_at = self._pass(
                session, now, self.usual_gap if usual_gap is None else usual_gap
            )
            after = self.journal.live_slices(session)
        if self.single_writer and alive_at is not None:
            # Committed (unless inside a transaction of the caller's: then read it again
            # next time). No other process writes the row while this one leads, so the
            # next pass need not read it; a pass that failed left the copy as it was.
            nested = self.journal.in_transaction
            self._alive_at = None if nested else alive_at
        committed = self.journal.committed
        if committed is None or self.journal.in_transaction:  # a single writer's alone
            return decisions, LiveViews(dict(after))  # a copy: later writes change them
        return decisions, LiveViews(committed.live)  # what this pass's commit left

    def _pass(
        self, session: Session, now: float, usual_gap: float | None
    ) -> tuple[Decisions, float | None]:
        """Snapshot, schedule and apply in ``session``; the decisions, and the time the
        pass wrote as the last pass's (None: leases left alone, ``usual_gap`` None)."""
        catalog = self.journal.catalog(session)
        costs = catalog.costs
        alive_at = None if usual_gap is None else self._cover_absence(session, now, usual_gap)
        live = self.journal.live_slices(session)
        slices = self.journal.committed_values()
        if slices is None:
            slices = tuple(entry.slice for entry in live.values())
        # What the journal saw written since the last pass: the kept usage and index
        # look at those slices alone (both check that the result adds up).
        ids, mark = self.journal.live_changes(self._live_mark)
        changed = None if ids is None else {i: live[i].slice if i in live else None for i in ids}
        snapshot = self._snapshot(
            catalog, now, slices, self._usage(session, now, costs, slices, changed)
        )
        if self._kept_index is not None:
            self._kept_index.expect(changed)
        decisions = self._schedule(snapshot)
        nodes = {node.name: node for node in snapshot.nodes}
        self._apply(session, decisions, live, nodes, now, costs)
        self.lapses.record(now, decisions)
        after = self.journal.live_slices(session)
        if self._kept_index is not None:
            # The index takes in the pass's own writes now, so that it tells the next
            # wake (next_wake) as the pass left the slices.
            written, _ = self.journal.live_changes(mark)
            changed = None
            if written is not None:
                changed = {i: after[i].slice if i in after else None for i in written}
            every = (entry.slice for entry in after.values())  # walked only if needed
            self._kept_index.take_in(changed, len(after), every)
        self._live_mark = mark
        self.journal.forget_changes_before(mark)
        return decisions, alive_at

    def next_wake(self, after: float) -> float | None:
        """When a pass next has something to do for a live slice, after ``after``: the
        earliest end of a protection, a grace period, a maximum runtime or a lease, as
        the last pass left them (a single writer's kept index; other Brokers read)."""
        if self._kept_index is not None:
            return self._kept_index.next_wake(after)
        with self.journal.read() as session:
            times = [at for s in self.journal.live_values(session) for at in wake_times(s)]
        return min((at for at in times if at > after), default=None)

    def _cover_absence(self, session: Session, now: float, usual_gap: float) -> float:
        """Extend every live lease by the time no broker could take heartbeats.

        That is the time since the last pass, when it is longer than
        ``usual_gap``: the broker was restarting, or the database was out. A
        lease never lapses for the broker's own trouble, yet a crash loop does
        not keep a dead holder alive for ever (each restart adds only the
        seconds it was away, not a fresh lease). With no record of a last pass
        (a database from before revision 0004), every leased slice gets a full lease.
        Returns the time it records as the last pass's.
        """
        known = self._alive_at  # a single writer's copy of the row, as last committed
        if known is None:
            alive = session.get(BrokerAliveRow, 1)
            known = None if alive is None else alive.alive_at
        if known is None:  # no record of a last pass: every lease renewed in full
            session.add(BrokerAliveRow(id=1, alive_at=now))
            alive_at, away = now, None
        else:
            alive_at, away = max(known, now), now - known
            if alive_at != known:
                session.execute(
                    update(BrokerAliveRow).where(BrokerAliveRow.id == 1).values(alive_at=alive_at)
                )
            if away <= usual_gap:
                return alive_at
        leased = session.scalars(
            select(SliceRow).where(
                SliceRow.state.in_(LIVE_STATES), SliceRow.lease_expires_at.is_not(None)
            )
        ).all()
        for row in leased:
            if away is None:
                row.lease_expires_at = max(row.lease_expires_at, now + self.lease)
            else:
                row.lease_expires_at += away
        if leased:
            if away is None:
                log.info("gave %d live slices a full lease: no record of a last pass", len(leased))
            else:
                log.warning(
                    "no pass for %.1f s (a restart or a database outage): extended the "
                    "leases of %d live slices by as much",
                    away,
                    len(leased),
                )
        return alive_at

    def _usage_now(
        self, session: Session, now: float, costs: _Costs, live: Collection[Slice]
    ) -> dict[str, float]:
        """Each project's charged usage at ``now`` between passes, ``live`` the live
        slices: a single writer's kept usage takes in the slices written since the
        last pass alone (which the next pass then finds already taken in)."""
        changed = None
        if self.journal.single_writer:
            ids, _ = self.journal.live_changes(self._live_mark)
            if ids is not None:
                kept = self.journal.live_slices(session)
                changed = {i: kept[i].slice if i in kept else None for i in ids}
        return self._usage(session, now, costs, live, changed)

    def _usage(
        self,
        session: Session,
        now: float,
        costs: _Costs,
        live: Collection[Slice],
        changed: Mapping[int, Slice | None] | None = None,
    ) -> dict[str, float]:
        """Each project's charged usage at ``now``: the ledger plus the ``live`` slices
        that hold GPUs (``changed``: those written since the last pass, if known)."""
        policy = self.config.policy
        if policy.half_life is None:
            usage = self.journal.closed_usage(session, now, policy.window)
            # A single writer keeps what held slices accrued from one pass to the next.
            charges = self._running_charges or accounting.RunningCharges()
            running_usage = charges.usage(
                live, costs.node_types, costs.weights, now, policy.window, changed
            )
            for project, amount in running_usage.items():
                usage[project] = usage.get(project, 0.0) + amount
            return usage
        horizon = accounting.usage_horizon(policy.window, policy.half_life)
        closed = ledger_since(session, now - horizon)
        running = [costs.running(slice_) for slice_ in live if slice_.state in HELD_STATES]
        return accounting.usage_by_project(
            closed,
            (interval for interval in running if interval is not None),
            now,
            policy.window,
            policy.half_life,
        )

    def _apply(
        self,
        session: Session,
        decisions: Decisions,
        live: Mapping[int, _LiveSlice],
        nodes: Mapping[str, Node],
        now: float,
        costs: _Costs,
    ) -> None:
        """Write a pass's decisions; endings first, as they free what grants take.

        Only the rows a decision or a new queue place changes are read."""
        promised = {r.slice_id: r for r in decisions.reservations if r.promised}
        queue = {entry.slice_id: entry for entry in decisions.queue}
        # The pending slices, from the pass's kept index where there is one: not a
        # walk over every live slice for the few that wait.
        kept = self._kept_index
        waiting = live.keys() if kept is None else [s.id for s in kept.pending()]
        rows = self.journal.rows(session, _changed_ids(decisions, live, promised, queue, waiting))
        for ending in decisions.endings:
            row = _live(rows, ending.slice_id, LIVE_STATES, "end")
            if row is not None:
                why = ending.reason.value
                self._end(
                    session,
                    row,
                    ending.reason,
                    now,
                    costs,
                    why=why,
                    requeue=ending.requeue,
                    protect_next=ending.protect_next,
                )
        for preemption in decisions.preemptions:
            row = _live(rows, preemption.slice_id, (SliceState.GRANTED,), "preempt")
            if row is None:
                continue
            _write_state(row, transitions.preempting(_to_slice(row), preemption.deadline))
            row.preempt_reason = preemption.reason.value
            why = preemption.reason.value
            if preemption.for_slice is not None:
                why += f" (for slice {preemption.for_slice})"
            _event(session, row, SliceState.GRANTED, why, now)
        granted_on = {p.node for grant in decisions.grants for p in grant.placements}
        held = self._held_gpus(session, rows, granted_on) if granted_on else {}
        for grant in decisions.grants:
            row = _live(rows, grant.slice_id, (SliceState.PENDING,), "grant")
            if row is None:
                continue
            # The last guard of design.md §5's first invariant: whatever the pass says,
            # a GPU that is held or does not exist is never granted.
            problem = _grant_problem(grant.placements, held, nodes)
            if problem is not None:
                log.error("the pass granted slice %s %s; grant refused", row.id, problem)
                continue
            held.update({gpu: row.id for gpu in _gpus(grant.placements)})
            _write_state(row, transitions.granted(_to_slice(row), grant.placements, now))
            row.lease_expires_at = now + self.lease
            row.preempt_reason = None
            where = ", ".join(f"{p.node}{list(p.gpu_indices)}" for p in grant.placements)
            _event(session, row, SliceState.PENDING, f"granted on {where}", now)
        for row in rows.values():
            waiting = row.state == SliceState.PENDING
            promise = promised.get(row.id) if waiting else None
            entry = queue.get(row.id) if waiting else None
            # Assign only what changed: an unchanged row then costs no UPDATE.
            _update(
                row,
                promised=_placement_json(promise.placements) if promise else [],
                queue_position=entry.position if entry else None,
                fairshare_value=entry.fairshare_value if entry else None,
                estimated_start=entry.estimated_start if entry else None,
            )
        for change in decisions.node_changes:
            node = session.get(NodeRow, change.node)
            if node is None:
                log.warning("the pass changed unknown node %s; ignored", change.node)
                continue
            _set_node(node, change.state, change.reason, now)

    def _held_gpus(
        self, session: Session, rows: Mapping[int, SliceRow], on: Set[str]
    ) -> dict[tuple[str, int], int]:
        """Which slice holds each GPU of the nodes ``on``: the live slices as last
        flushed (the journal keeps who holds what per node), as ``rows`` changed them
        since (only the nodes a pass grants on need checking)."""
        held = {
            gpu: slice_id
            for gpu, slice_id in self.journal.holders_on(session, on).items()
            if slice_id not in rows
        }
        for slice_id, row in rows.items():
            if SliceState(row.state) in HELD_STATES:
                for placement in _placements(row.placements):
                    if placement.node in on:
                        held.update({(placement.node, i): slice_id for i in placement.gpu_indices})
        return held

    def _end(
        self,
        session: Session,
        row: SliceRow,
        reason: EndReason,
        now: float,
        costs: _Costs,
        *,
        why: str,
        requeue: bool = False,
        protect_next: float | None = None,
    ) -> None:
        """End ``row`` (or requeue it, with ``protect_next`` its next protected
        period), writing the ledger entry for what it held."""
        before = SliceState(row.state)
        if before in HELD_STATES:
            entry = costs.entry(_to_slice(row), now)
            if entry is not None:
                session.add(
                    LedgerRow(
                        slice_id=row.id,
                        project=entry.project,
                        user=entry.user,
                        start=entry.start,
                        end=entry.end,
                        gpus=entry.gpus,
                        weight=entry.rate / entry.gpus,
                        gpu_seconds=entry.weighted_gpu_seconds,
                    )
                )
                row.charged_gpu_seconds += entry.weighted_gpu_seconds
        row.promised = []
        row.queue_position = row.fairshare_value = row.estimated_start = None
        if requeue and before in HELD_STATES:
            _write_state(row, transitions.requeued(_to_slice(row), now, protect_next))
            row.preempt_reason = None
            why += ", requeued"
        else:
            row.state = SliceState.ENDED.value
            row.end_reason = reason.value
            row.ended_at = now
            row.lease_expires_at = None
        _event(session, row, before, why, now)


def _changed_ids(
    decisions: Decisions,
    live: Mapping[int, _LiveSlice],
    promised: Mapping[int, Reservation],
    queue: Mapping[int, QueueEntry],
    waiting: Iterable[int],
) -> set[int]:
    """The live slices a pass's decisions change: those it ends, preempts or grants,
    and the waiting ones (of ``waiting``, ids of live slices that include every
    pending one) whose promise or queue place moves."""
    ids = {e.slice_id for e in decisions.endings}
    ids.update(p.slice_id for p in decisions.preemptions)
    ids.update(g.slice_id for g in decisions.grants)
    for slice_id in waiting:
        entry = live[slice_id]
        if slice_id in ids or entry.slice.state is not SliceState.PENDING:
            continue
        promise, place = promised.get(slice_id), queue.get(slice_id)
        now_shown = (
            promise.placements if promise else (),
            place.position if place else None,
            place.fairshare_value if place else None,
            place.estimated_start if place else None,
        )
        view = entry.view
        shown = (
            entry.slice.promised,
            view["queue_position"],
            view["fairshare_value"],
            view["estimated_start"],
        )
        if now_shown != shown:
            ids.add(slice_id)
    return ids & live.keys()


def _restorable_row(session: Session, slice_id: int, user: str) -> SliceRow:
    """``user``'s slice ``slice_id`` if a new request may restore it: ended by a
    preemption (a drain's included) or its node going down, and not restored yet."""
    row = session.get(SliceRow, slice_id)
    if row is None or row.user != user:
        raise NotFound(f"no slice {slice_id} of {user!r} to restore")
    if row.state != SliceState.ENDED.value:
        raise Conflict(f"slice {slice_id} is {row.state}, not ended: nothing to restore")
    if row.preempt_reason is None and row.end_reason != EndReason.NODE_DOWN.value:
        raise Conflict(
            f"slice {slice_id} ended {row.end_reason}, not by a preemption or its node "
            "going down: only those are restored"
        )
    if row.replaced_by is not None:
        raise Conflict(f"slice {slice_id} was restored already, by slice {row.replaced_by}")
    return row


def _protected_again(restored: SliceRow, policy: Policy) -> float | None:
    """The protection of the next run of a preempted batch job brought back by its
    runner: what the broker's own requeue would give it (``preemption_backoff``,
    design.md §5.7); None for work the broker would not requeue."""
    kind, preempted = SliceKind(restored.kind), EndReason.PREEMPTED
    if restored.preempt_reason is None or not transitions.requeued_when_ended(
        kind, restored.resumable, preempted
    ):
        return None
    return transitions.protected_after_preemption(restored.min_runtime, policy)


def _request_digest(**terms: Any) -> str:
    """A digest of a submission's terms as given, to tell a replay from another request."""
    text = json.dumps(terms, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _live_views(
    live: Iterable[_LiveSlice],
    state: str | None,
    project: str | None,
    user: str | None,
    now: float,
    costs: _Costs,
) -> list[dict[str, Any]]:
    """The views of the kept ``live`` slices that match the filters (``state``: one
    live state, or ``live`` for all), charged up to ``now``."""
    return [
        _kept_dict(entry.view, entry.slice, now, costs)
        for entry in live
        if state in ("live", entry.view["state"])
        and project in (None, entry.view["project"])
        and user in (None, entry.view["user"])
    ]


def _node_views(catalog: _Catalog, held: Mapping[str, int]) -> list[dict[str, Any]]:
    """Every node of ``catalog`` as the API shows it, with the GPUs ``held`` on it."""
    return [{**view, "gpus_held": held.get(view["name"], 0)} for view in catalog.node_views]


def _live_count(session: Session, project: str) -> int:
    query = select(SliceRow.id).where(SliceRow.project == project, SliceRow.state.in_(LIVE_STATES))
    return len(session.scalars(query).all())


def _live(
    rows: Mapping[int, SliceRow], slice_id: int, states: Iterable[SliceState], action: str
) -> SliceRow | None:
    """The row a decision is about, if it is in a state the decision applies to."""
    row = rows.get(slice_id)
    if row is None or row.state not in {s.value for s in states}:
        state = row.state if row is not None else "unknown"
        log.warning("the pass asked to %s slice %s in state %s; ignored", action, slice_id, state)
        return None
    return row


def _event(
    session: Session, row: SliceRow, before: SliceState | None, reason: str, now: float
) -> None:
    session.add(
        SliceEventRow(
            slice_id=row.id,
            at=now,
            from_state=None if before is None else SliceState(before).value,
            to_state=row.state,
            reason=reason,
        )
    )


def _gpus(placements: Iterable[Placement]) -> list[tuple[str, int]]:
    return [(p.node, index) for p in placements for index in p.gpu_indices]


def _pending_row(**fields: Any) -> SliceRow:
    """A new request's row: ``fields`` (its terms, owner and submit time), waiting and
    holding nothing."""
    pending = SliceState.PENDING.value
    return SliceRow(**fields, state=pending, placements=[], promised=[], charged_gpu_seconds=0.0)


def _grant_problem(
    placements: tuple[Placement, ...],
    held: Mapping[tuple[str, int], int],
    nodes: Mapping[str, Node],
) -> str | None:
    """Why these placements cannot be granted, or ``None`` if they can."""
    gpus = _gpus(placements)
    if not gpus or len(set(gpus)) != len(gpus):
        return f"an empty or repeated set of GPUs {gpus}"
    for node, index in gpus:
        if node not in nodes or not 0 <= index < nodes[node].gpu_count:
            return f"GPU {node}[{index}], which does not exist"
        if (node, index) in held:
            return f"GPU {node}[{index}], held by slice {held[node, index]}"
    return None
