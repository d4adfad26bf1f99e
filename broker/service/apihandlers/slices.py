"""Slices: request GPUs, watch the queue, heartbeat, release (design.md §7–§8).

Users see, heartbeat and release only their own slices; another user's slice
answers 404, exactly like a slice that does not exist, so ids reveal nothing.
Agents and admins reach every slice.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import OperationalError

from ...config import parse_duration
from ...core.model import SliceState
from ...errors import Forbidden, InvalidRequest, NotFound
from ...store import Principal
from ..runner import DatabaseTimeout, SliceKey, slice_key
from ..schema import NAME_TEXT, validate
from .base import ID_PARAM, APIHandler, Operation, Param
from .common import acting_identity, charging_principal

STATES = [s.value for s in SliceState]
LIVE_STATES = (SliceState.PENDING, SliceState.GRANTED, SliceState.PREEMPTING)
#: The longest Idempotency-Key taken, and what it may contain (printable ASCII).
MAX_IDEMPOTENCY_KEY = 255
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]+$"


class SliceListHandler(APIHandler):
    operations = {
        "get": Operation(
            "List slices",
            "Oldest first. Users see only their own slices; agents and admins see all "
            "and may filter by `user`. When the database does not answer in time, a list "
            "of live slices (`state` live, pending, granted or preempting) is answered "
            "as the last scheduling pass left them, with the header "
            "`Slicebroker-Stale: true`.",
            parameters=(
                Param(
                    "state",
                    "query",
                    {"type": "string", "enum": [*STATES, "live"]},
                    "only slices in this state; `live` means not ended",
                ),
                Param("project", "query", NAME_TEXT, "only slices of this project"),
                Param("user", "query", NAME_TEXT, "only slices of this user"),
            ),
            content={"application/json": "SliceList"},
            errors=(400,),
        ),
        "post": Operation(
            "Request a slice of GPUs",
            "Queues a request charged to `project`, of which the caller (or the user an "
            "agent acts for) must be a member. Contract terms left out come from the "
            "configuration's defaults for the kind. Answers at once with the pending "
            "slice; wait for the grant with `GET /slices/{id}?wait=...`. With an "
            "`Idempotency-Key`, a request the caller already made with that key makes "
            "nothing new and answers the slice the first one made (as it is now); the "
            "same key with another request is a 409.",
            parameters=(
                Param(
                    "Idempotency-Key",
                    "header",
                    {
                        "type": "string",
                        "minLength": 1,
                        "maxLength": MAX_IDEMPOTENCY_KEY,
                        "pattern": IDEMPOTENCY_KEY_PATTERN,
                    },
                    "a key unique to this request (e.g. a random UUID), sent again with "
                    "every retry of it; printable ASCII, at most "
                    f"{MAX_IDEMPOTENCY_KEY} characters",
                ),
            ),
            body="SliceRequest",
            ok=201,
            ok_description="the new slice, pending",
            content={"application/json": "Slice"},
            errors=(400, 409),
        ),
    }

    async def get(self) -> None:
        params = self.params()
        user = params.get("user")
        if not self.identity.acts_for_others:
            if user is not None and user != self.identity.name:
                raise Forbidden("users list only their own slices")
            user = self.identity.name
        state, project = params.get("state"), params.get("project")
        try:
            slices = await self.runner.read_committed(
                self.broker.committed_live_slices,
                self.broker.list_slices,
                state=state,
                project=project,
                user=user,
            )
        except (DatabaseTimeout, OperationalError):
            # The database does not answer: live slices are as the last pass left them.
            if state not in ("live", *LIVE_STATES):
                raise
            slices = [
                slice_
                for slice_ in self.runner.remembered_live()
                if state in ("live", slice_["state"])
                and project in (None, slice_["project"])
                and user in (None, slice_["user"])
            ]
            self.set_header("Slicebroker-Stale", "true")
        self.write_json({"slices": slices})

    async def post(self) -> None:
        body = self.body()
        principal = charging_principal(self.identity, body.get("user"), body.get("groups"))
        key = self.request.headers.get("Idempotency-Key")
        if key is not None:
            validate(
                key,
                self.operation.param("Idempotency-Key").schema,
                "the header 'Idempotency-Key'",
            )
        replayed = False

        def submit(**request: Any) -> dict[str, Any]:
            nonlocal replayed
            slice_, new = self.broker.submit_once(**request)
            replayed = not new
            return slice_

        slice_ = await self.runner.submit(
            submit,
            principal=principal,
            project=body["project"],
            gpus=body["gpus"],
            kind=body["kind"],
            min_runtime=_duration(body, "min_runtime"),
            gpu_type=body.get("gpu_type"),
            resumable=body.get("resumable"),
            max_runtime=_duration(body, "max_runtime"),
            priority=body.get("priority") or 0,
            idempotency_key=key,
            restores=body.get("restores"),
        )
        if replayed:
            self.set_header("Idempotent-Replayed", "true")
        self.set_header("Location", f"{self.settings['api_prefix']}/slices/{slice_['id']}")
        self.write_json(slice_, status=201)


def _duration(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as err:
        raise InvalidRequest(f"{key}: {err}") from None


class _OwnedSliceHandler(APIHandler):
    """A handler of one slice: the caller's own, unless an agent or admin."""

    async def owned(
        self,
        method,
        slice_id: int,
        *,
        change: bool = False,
        write: bool = False,
        committed: Callable[..., Any] | None = None,
    ) -> Any:
        """``method(slice_id, ...)`` for the caller: a read, unless it may ``change``
        the schedule (then a pass follows) or is another ``write`` (as a heartbeat: it
        joins the group commit of writes as durable as the Broker declares it). A read
        with its ``committed`` counterpart is answered from the last commit where it can
        (:meth:`~broker.service.runner.BrokerRunner.read_committed`). Another user's
        slice is not found (:class:`~broker.store.NotYours`)."""
        if change:
            return await self.runner.change(method, slice_id, caller=self.identity)
        if write:
            return await self.runner.write(method, slice_id, caller=self.identity)
        if committed is not None:
            return await self.runner.read_committed(
                committed, method, slice_id, caller=self.identity
            )
        return await self.runner.read(method, slice_id, caller=self.identity)


class SliceHandler(_OwnedSliceHandler):
    operations = {
        "get": Operation(
            "Get a slice, or wait for it to change",
            "With `wait`, a long poll: answers as soon as the slice's state differs from "
            "`state` (without `state`: as soon as its state or queue position changes "
            "from what it was when the request arrived), or after `wait` seconds (capped "
            "by the broker's `max_wait`) with the slice as it is then. When the database "
            "does not answer in time, a slice live at the last scheduling pass is answered "
            "as that pass left it, with the header `Slicebroker-Stale: true`.",
            parameters=(
                ID_PARAM,
                Param(
                    "wait",
                    "query",
                    {"type": "number", "minimum": 0},
                    "seconds to wait for a change (capped by the broker's max_wait)",
                ),
                Param(
                    "state",
                    "query",
                    {"type": "string", "enum": STATES},
                    "the state the caller knows; answer once the slice is in another",
                ),
            ),
            content={"application/json": "Slice"},
            errors=(400, 404),
        ),
        "delete": Operation(
            "Release or cancel a slice",
            "A pending slice is cancelled; a held one is released and charged up to now. "
            "Releasing an ended slice changes nothing. Answers with the slice.",
            parameters=(ID_PARAM,),
            content={"application/json": "Slice"},
            errors=(404,),
            shed=False,
        ),
    }

    async def get(self, id: str) -> None:
        slice_id = self.slice_id(id)
        params = self.params()
        generation = self.runner.watchers.generation
        try:
            current = await self._get(slice_id)
        except (DatabaseTimeout, OperationalError):
            # The database does not answer: a live slice is as the last pass left it.
            remembered = self.runner.remembered(slice_id)
            if remembered is None or not (
                self.identity.acts_for_others or remembered["user"] == self.identity.name
            ):
                raise
            self.set_header("Slicebroker-Stale", "true")
            self.write_json(remembered)
            return
        wait = min(params.get("wait", 0.0), self.settings["max_wait"])
        if wait > 0:
            current = await self._wait(slice_id, current, generation, wait, params.get("state"))
        self.write_json(current)

    async def _wait(
        self, slice_id: int, current: dict, generation: int, wait: float, known: str | None
    ) -> dict[str, Any]:
        """Long poll: the slice once it changed (see the operation), or at the timeout.

        No polling: the handler sleeps until the scheduling loop or a request
        publishes news of this slice (:class:`~broker.service.runner.SliceWatchers`),
        then reads the slice again to confirm. ``generation`` is the watchers'
        count of publications before ``current`` was read; if it moved, news may
        have raced that read, so the slice is read again before sleeping.
        """
        baseline = slice_key(current)

        def is_news(key: SliceKey | None) -> bool:
            if key is None:  # it left the live set: news unless it had ended already
                return baseline[0] != SliceState.ENDED
            return key[0] != known if known is not None else key != baseline

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        watchers = self.runner.watchers
        while not is_news(slice_key(current)):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            if watchers.generation == generation:
                self._waiting = watchers.watch(slice_id, is_news)
                try:
                    await asyncio.wait({self._waiting}, timeout=remaining)
                finally:
                    watchers.unwatch(slice_id, self._waiting)
                if self._waiting.cancelled() or watchers.closed:  # client gone, or stopping
                    break
            generation = watchers.generation
            current = await self._get(slice_id)
        return current

    async def _get(self, slice_id: int) -> dict[str, Any]:
        """The slice for the caller, from the last commit where it is live."""
        broker = self.broker
        return await self.owned(broker.get_slice, slice_id, committed=broker.committed_slice)

    async def delete(self, id: str) -> None:
        slice_ = await self.owned(self.broker.release, self.slice_id(id), change=True)
        self.write_json(slice_)


class _HeartbeatTicket(APIHandler):
    """A heartbeat request is timed from when it came to its answer: one answered late
    is time over which no lease runs out (:meth:`BrokerRunner.heartbeat_came`)."""

    _ticket: int | None = None  # while the broker answers it

    async def prepare(self) -> None:
        # Counted from when it came, before its token is looked up: a heartbeat held up
        # there by a busy broker is answered late too.
        self._ticket = self.runner.heartbeat_came(time.time() - self.request.request_time())
        await super().prepare()

    def on_finish(self) -> None:
        self._answered()
        super().on_finish()

    def on_connection_close(self) -> None:
        self._answered()  # the caller gave up: as late as it was then
        super().on_connection_close()

    def _answered(self) -> None:
        if self._ticket is not None:
            self.runner.heartbeat_answered(self._ticket)
            self._ticket = None


class SliceHeartbeatHandler(_HeartbeatTicket, _OwnedSliceHandler):
    operations = {
        "post": Operation(
            "Heartbeat a slice",
            "Extends the slice's lease to now + the broker's lease. Once heartbeated, a "
            "slice must keep being heartbeated (also while it waits): a lapsed lease ends "
            "it with reason `lost`. An ended slice is returned as it is.",
            parameters=(ID_PARAM,),
            content={"application/json": "Slice"},
            errors=(404,),
            shed=False,
        )
    }

    async def post(self, id: str) -> None:
        slice_ = await self.owned(self.broker.heartbeat, self.slice_id(id), write=True)
        self.write_json(slice_)


class HeartbeatsHandler(_HeartbeatTicket):
    operations = {
        "post": Operation(
            "Heartbeat many slices",
            "`POST /slices/{id}/heartbeat` of every slice named, in one request and one "
            "write: a hub heartbeats its sessions' slices together, so that its heartbeats "
            "cost the broker one request per round trip however many sessions it runs. "
            "Answers the slices in the order asked, and under `not_found` the ids of which "
            "the caller has no slice (users heartbeat only their own; agents and admins "
            "any).",
            body="HeartbeatBatch",
            content={"application/json": "HeartbeatAnswers"},
            errors=(400,),
            shed=False,
        )
    }

    async def post(self) -> None:
        ids = list(dict.fromkeys(self.body()["slices"]))
        asked = [(slice_id, self.identity) for slice_id in ids]
        answers = await self.runner.write(self.broker.heartbeats, asked)
        slices, not_found = [], []
        for slice_id, answer in zip(ids, answers, strict=True):
            if isinstance(answer, NotFound):  # another's too (NotYours)
                not_found.append(slice_id)
            elif isinstance(answer, Exception):
                raise answer
            else:
                slices.append(answer)
        self.write_json({"slices": slices, "not_found": not_found})


class SliceProtectionHandler(_OwnedSliceHandler):
    operations = {
        "post": Operation(
            "Extend a slice's protection",
            "Protects a granted slice under contract for `extend_by` longer, from the later "
            "of the end of its protection and now (`protected_until` moves; `min_runtime` "
            "grows). The slice is charged as before, from its grant to its end; nobody "
            "preempts it for longer. Bounded as a new contract is: the policy's "
            "`max_min_runtime` counted from the grant (a debug session's "
            "`debug_max_min_runtime`) and the slice's `max_runtime`; past a bound, or for a "
            "slice that is not granted or is free, it answers 409 with the room left.",
            parameters=(ID_PARAM,),
            body="ProtectionExtension",
            content={"application/json": "Slice"},
            errors=(400, 404, 409),
        )
    }

    async def post(self, id: str) -> None:
        slice_id = self.slice_id(id)
        by = _duration(self.body(), "extend_by")
        slice_ = await self.runner.change(
            self.broker.extend_protection, slice_id, by, caller=self.identity
        )
        self.write_json(slice_)


class SliceCheckpointHandler(_OwnedSliceHandler):
    operations = {
        "post": Operation(
            "Report a checkpoint",
            "Records that the slice's holder saved its work now (`checkpointed_at`). Among "
            "otherwise equal victims, the broker preempts the one with the least work since "
            "its grant or its last checkpoint first. Only a slice that holds GPUs "
            "(`granted` or `preempting`) has work to checkpoint: any other answers 409.",
            parameters=(ID_PARAM,),
            content={"application/json": "Slice"},
            errors=(404, 409),
        )
    }

    async def post(self, id: str) -> None:
        slice_ = await self.owned(self.broker.checkpoint, self.slice_id(id), write=True)
        self.write_json(slice_)


class SliceEventsHandler(_OwnedSliceHandler):
    operations = {
        "get": Operation(
            "List a slice's state changes",
            "Oldest first, each with the time and the reason (granted where, preempted "
            "for which slice, ended why).",
            parameters=(ID_PARAM,),
            content={"application/json": "SliceEventList"},
            errors=(404,),
        )
    }

    async def get(self, id: str) -> None:
        events = await self.owned(self.broker.events, self.slice_id(id))
        self.write_json({"events": events})


class SliceAlternativesHandler(_OwnedSliceHandler):
    operations = {
        "get": Operation(
            "What would start a waiting slice sooner",
            "For a pending slice: the changes to it (fewer GPUs, another GPU type, a "
            "shorter protected period, a debug-length session, another of its user's "
            "projects) that the scheduling pass would grant now or start sooner, each "
            "with its estimated start and the GPU-hours its protected period commits "
            "(design.md §5.8). Empty for a slice that does not wait.",
            parameters=(ID_PARAM,),
            content={"application/json": "AlternativeList"},
            errors=(404,),
        )
    }

    async def get(self, id: str) -> None:
        answer, stale = await read_alternatives(self.runner, self.identity, self.slice_id(id))
        if stale:
            self.set_header("Slicebroker-Stale", "true")
        self.write_json(answer)


class SliceReplaceHandler(_OwnedSliceHandler):
    operations = {
        "post": Operation(
            "Replace a waiting slice with one of its alternatives",
            "Withdraws the pending slice and queues in its place the same request with "
            "the terms given (as `GET /slices/{id}/alternatives` lists them in `fields`), "
            "in one transaction: both happen or neither. The new slice is the same "
            "user's, keeps the old one's place in its project's queue (its submit time), "
            "its lease and its other terms (resumable, max runtime, priority). The old "
            "one ends `cancelled` with `replaced_by` naming the new one, for its holder "
            "to follow. 409 if the slice is not waiting any more (granted meanwhile, say); "
            "403 for a project the user may not charge.",
            parameters=(ID_PARAM,),
            body="SliceReplacement",
            ok=201,
            ok_description="the new slice, pending",
            content={"application/json": "Slice"},
            errors=(400, 404, 409),
        )
    }

    async def post(self, id: str) -> None:
        new = await replace_slice(self.runner, self.identity, self.slice_id(id), self.body())
        self.set_header("Location", f"{self.settings['api_prefix']}/slices/{new['id']}")
        self.write_json(new, status=201)


async def read_alternatives(
    runner: Any, identity: Principal, slice_id: int
) -> tuple[dict[str, Any], bool]:
    """``GET /slices/{id}/alternatives`` for ``identity`` (the API's and the pages'), and
    whether the answer is stale.

    Several passes each: computed once per slice and caller until a pass decides
    something or a change (a minute at most), however often a pending page polls,
    within the what-if budget (design.md §5.8,
    :meth:`~broker.service.runner.BrokerRunner.read_what_if`). Another user's slice
    is not found.
    """
    compute = functools.partial(runner.broker.alternatives, slice_id, caller=identity)
    checks = functools.partial(compute, compute=False)
    return await runner.read_what_if(compute, ("alternatives", slice_id, identity), checks)


async def replace_slice(
    runner: Any, identity: Principal, slice_id: int, body: dict[str, Any]
) -> dict[str, Any]:
    """``POST /slices/{id}/replace`` with a checked ``SliceReplacement`` body, for
    ``identity`` (the API's and the pages'); the new slice."""
    # Membership in a new project is judged with the user's own groups (or those of
    # them named), or with those an agent or admin names for the slice's user.
    groups = acting_identity(identity, groups=body.get("groups")).groups
    return await runner.change(
        runner.broker.replace,
        slice_id,
        project=body["project"],
        gpus=body["gpus"],
        kind=body["kind"],
        min_runtime=_duration(body, "min_runtime"),
        gpu_type=body.get("gpu_type"),
        groups=sorted(groups),
        caller=identity,
    )


class ExpectedStartsHandler(APIHandler):
    operations = {
        "get": Operation(
            "When a new request would start, by GPU type and size",
            "Before a request is made: for each GPU type and each size up to the type's "
            "largest node (1, 2, 4, …), when a new request of the caller's for `project` "
            "would start (now, or the scheduling pass's estimate), from one pass each on "
            "the live state with that request added (design.md §5.8). Terms left out come "
            "from the kind's defaults. Computed once per caller and terms until a pass "
            "decides something or a change, a minute at most. 403 for a project the "
            "caller (or the user an agent names) may not charge.",
            parameters=(
                Param("project", "query", NAME_TEXT, "the project to charge", required=True),
                Param(
                    "kind",
                    "query",
                    {"type": "string", "enum": ["interactive", "batch"]},
                    "the request's kind (default batch)",
                ),
                Param(
                    "min_runtime",
                    "query",
                    {"type": "string", "minLength": 1, "maxLength": 32},
                    "its protected period, as `90m`, `8h` or seconds",
                ),
                Param(
                    "user",
                    "query",
                    NAME_TEXT,
                    "agents and admins: the user the request would be for",
                ),
                Param(
                    "groups",
                    "query",
                    {"type": "string", "maxLength": 4096},
                    "agents and admins: that user's groups, comma-separated",
                ),
            ),
            content={"application/json": "ExpectedStarts"},
            errors=(400,),
        )
    }

    async def get(self) -> None:
        params = self.params()
        terms = {
            "project": params["project"],
            "kind": params.get("kind") or "batch",
            "min_runtime": _duration(params, "min_runtime"),
        }
        named = params.get("groups")
        groups = None if named is None else [g for g in named.split(",") if g]
        principal = charging_principal(self.identity, params.get("user"), groups)
        compute = functools.partial(self.broker.expected_starts, principal=principal, **terms)
        key = ("expected_starts", principal, tuple(sorted(terms.items())))
        checks = functools.partial(compute, compute=False)
        answer, stale = await self.runner.read_what_if(compute, key, checks)
        if stale:
            self.set_header("Slicebroker-Stale", "true")
        self.write_json(answer)


default_handlers = [
    ("/slices", SliceListHandler),
    ("/slices/{id}", SliceHandler),
    ("/slices/{id}/heartbeat", SliceHeartbeatHandler),
    ("/slices/{id}/checkpoint", SliceCheckpointHandler),
    ("/slices/{id}/protection", SliceProtectionHandler),
    ("/slices/{id}/events", SliceEventsHandler),
    ("/slices/{id}/replace", SliceReplaceHandler),
    ("/slices/{id}/alternatives", SliceAlternativesHandler),
    ("/expected-starts", ExpectedStartsHandler),
    ("/heartbeats", HeartbeatsHandler),
]
