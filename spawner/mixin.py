"""The broker half of the spawner: a GPU slice first, then the server (design.md §7).

:class:`SliceBrokerMixin` goes in front of any JupyterHub spawner (the local
process spawner in :mod:`spawner.local`; a Kubernetes spawner later)::

    class MySpawner(SliceBrokerMixin, SomeSpawner): ...

and changes its life cycle as follows.

- ``start()`` asks the broker for a slice on behalf of the user (with the
  agent token, naming the user and their groups), waits in the queue,
  then starts the server through the spawner below it. If the spawn is
  cancelled (the hub's ``start_timeout``, a DELETE of the pending server) or
  fails, the request is withdrawn before the error goes on.
- The options form is the spawner's own form, if it has one (KubeSpawner's
  profiles, an admin's ``options_form``), then the slice form: the user's projects
  and their budget position, GPUs, GPU type, protected length
  (:mod:`spawner.options`, laid out by a template the admin may replace:
  ``options_form_template_paths``). The slice's fields become user options here,
  the others as the spawner's own ``options_from_form`` reads them.
- ``progress()`` streams the queue position, fair-share value and estimated
  wait while the request waits, then the grant and the launch.
- ``poll()`` says "running" while ``start()`` runs (waiting in the queue
  included); once the server is gone it releases the slice and says stopped.
- ``stop()`` is idempotent and always releases the slice, even when no server
  was ever launched.
- A background task per slice heartbeats it (holding the lease) and watches
  its state. When the slice is preempted, the server keeps running until the
  grace period ends, then stops; when the slice ends (preempted, expired,
  node down) the server stops at once. Either way the spawner records a
  *notice* (:mod:`spawner.notices`) that the hub's pages show: what happened,
  when, and what to do.
- ``get_state()`` keeps the slice id, so a restarted hub reconnects to its
  running sessions (and heartbeats them again) instead of losing them.

Backends launch on the granted GPUs: the slice is in :attr:`slice`
(``placements: [{node, gpu_indices}]``), and :meth:`get_env` already adds
``SLICEBROKER_*`` variables naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC
from typing import Any

from jupyterhub.spawner import Spawner, SpawnException
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from traitlets import (
    Bool,
    Dict,
    Float,
    Int,
    List,
    TraitError,
    TraitType,
    Unicode,
    Union,
    default,
    validate,
)
from traitlets.config import Configurable

from broker.client import URL_ENV, BrokerAPIError, BrokerClient
from broker.config import format_duration, parse_duration
from broker.traits import seconds_above_zero
from slicebroker_lab import (
    CULL_ENV,
    RESTORE_ENV,
    RESTORES_ENDED_ENV,
    RESTORES_ENV,
    session_env,
)

from . import notices, restore
from .brokerview import BrokerView
from .culler import CullLimits, verdict, waiter_for
from .lifecycle import Lifecycle, Phase
from .options import (
    FORM_TEMPLATE,
    OPTION_KEYS,
    Choices,
    OptionsError,
    SliceRequest,
    capacity_note,
    gpu_type_views,
    options_from_form,
    project_views,
    render_form,
    resolve_request,
)

TOKEN_ENV = "SLICEBROKER_TOKEN"
#: How long past a preemption deadline the spawner waits for the broker to end the
#: slice before it stops the server anyway (seconds).
END_WAIT_S = 5.0
#: Pause after a failed broker call in the background task (seconds), doubled after each
#: failure in a row up to the heartbeat interval: a broker that is behind gets fewer
#: calls, not more (a lease does not run out while the broker answers late).
RETRY_PAUSE_S = 2.0
#: How long a request waits before the pending page says what would start it sooner
#: (design.md §5.8), in seconds.
SOONER_AFTER_S = 60.0

#: ``start_timeout`` of a spawner whose backend sets none (seconds): start() includes the
#: wait in the queue.
QUEUE_START_TIMEOUT_S = 3600

_DEFAULT_PROTECTED = ["15m", "1h", "2h", "4h", "8h", "0"]
#: The debug lane's longest protected period where neither the admin nor the broker says
#: (the broker's own default, policy.debug_max_min_runtime).
DEFAULT_DEBUG_MAX = 15 * 60.0


def spawn_error(reason: str, message: str, *, html: str = "", status: int = 400) -> SpawnException:
    """A :class:`SpawnException` whose text the hub's pages show as it is."""
    exc = SpawnException(message, reason=reason, message_html=html, status_code=status)
    exc.jupyterhub_message = message
    if html:
        exc.jupyterhub_html_message = html
    return exc


def after_grant(progress: float) -> int:
    """A backend's progress (0-100) in the part of the bar after the grant."""
    return int(notices.GRANT_PROGRESS + (100 - notices.GRANT_PROGRESS) * progress / 100)


def cancelled_error(slice_id: int | None) -> SpawnException:
    """What ``start()`` raises when ``stop()`` withdrew the request it waited on."""
    which = f"GPU request (slice {slice_id})" if slice_id is not None else "GPU request"
    return spawn_error(
        "cancelled",
        f"The spawn was cancelled: the server was stopped before it started, and its {which} "
        "was withdrawn. Start again when you need the GPUs.",
    )


def broker_error(err: BrokerAPIError) -> web.HTTPError:
    """What the user sees when the broker refuses or fails a request."""
    if err.status == 0 or err.status >= 500:
        return spawn_error(
            "broker_unavailable",
            f"The GPU broker is not answering ({err.message}). Try again in a minute; if it "
            "persists, tell your hub admin.",
            status=503,
        )
    if err.status == 401:
        return spawn_error(
            "broker_auth",
            "The hub cannot authenticate with the GPU broker; tell your hub admin "
            "(SliceBrokerMixin.broker_token).",
            status=500,
        )
    return spawn_error(
        f"broker_{err.code}", f"The GPU broker refused the request: {err.message}", status=400
    )


async def render_options_form(spawner: SliceBrokerMixin) -> str:
    """``Spawner.options_form`` of a slice-broker spawner (JupyterHub calls it with the spawner)."""
    return await spawner.slice_options_form()


class SliceBrokerMixin(Configurable):
    """Acquire a GPU slice from the broker before the server starts; see the module docstring.

    Put it first among the bases: ``class S(SliceBrokerMixin, LocalProcessSpawner)``.
    """

    # ---- configuration ---------------------------------------------------------

    broker_url = Unicode(
        help=f"""The broker's base URL, without ``/api/v1``.

        For the broker run as a hub-managed service, its service URL and prefix,
        e.g. ``http://127.0.0.1:10101/services/slicebroker``. Default: the
        ``{URL_ENV}`` environment variable of the hub.
        """,
    ).tag(config=True)

    @default("broker_url")
    def _broker_url_default(self) -> str:
        return os.environ.get(URL_ENV, "")

    broker_token = Unicode(
        help=f"""The API token the spawner uses with the broker.

        It must hold the ``custom:slicebroker:agent`` scope (it acts for every
        user: it submits, heartbeats and releases their slices) and access to
        the broker service (``access:services!service=slicebroker``). The
        embedded ``jupyterhub_config.py`` makes a random one at every hub start.
        Default: the ``{TOKEN_ENV}`` environment variable of the hub.
        """,
    ).tag(config=True)

    @default("broker_token")
    def _broker_token_default(self) -> str:
        return os.environ.get(TOKEN_ENV, "")

    session_broker_url = Unicode(
        help=f"""The broker's base URL as sessions reach it, given to every session as
        ``{URL_ENV}`` (with the session's own hub token as ``{TOKEN_ENV}``, so that
        ``slicebroker run`` in a terminal charges the user's projects). Empty (the
        default): ``broker_url``, right when sessions run on the hub's machine; on
        other machines, the hub's public URL and the service's prefix, e.g.
        ``https://hub.example.org/services/slicebroker``. The token needs
        ``access:services!service=slicebroker`` in the ``server`` role's scopes.
        """,
    ).tag(config=True)

    broker_timeout = Float(
        10.0,
        help="Seconds one call to the broker may take (a long-poll gets its wait on top).",
    ).tag(config=True)

    protected_choices = List(
        Union([Unicode(), Float()]),
        default_value=_DEFAULT_PROTECTED,
        help="""Protected lengths a user may choose, in the order the form lists them.

        Each is seconds or a duration such as ``"15m"``, ``"2h"``. For this long
        after the grant nothing preempts the session; ``0`` is a free session
        (not charged, preemptible at any time). Each must be within the
        broker's ``policy.max_min_runtime``. Default: 15 min (debug), 1 h, 2 h,
        4 h, 8 h and 0.
        """,
    ).tag(config=True)

    @validate("protected_choices")
    def _check_protected_choices(self, proposal: Any) -> list:
        values = list(proposal.value)
        if not values:
            raise TraitError("protected_choices must offer at least one length")
        for value in values:
            try:
                parse_duration(value)
            except ValueError as err:
                raise TraitError(f"protected_choices: {err}") from None
        return values

    protected_default = Union(
        [Unicode(), Float()],
        default_value="15m",
        help="The protected length preselected on the form and used when a spawn names none "
        "(seconds or a duration). Must be one of protected_choices.",
    ).tag(config=True)

    debug_protected_max = Union(
        [Unicode(), Float()],
        default_value=None,
        allow_none=True,
        help="Protected lengths up to this are labelled 'debug' on the form (seconds or a "
        "duration). None (the default): the broker's policy.debug_max_min_runtime, read "
        "from the broker (GET /limits), else 15 min.",
    ).tag(config=True)

    gpu_choices = List(
        Int(),
        default_value=[1, 2, 4, 8],
        help="GPU counts a user may choose (those above max_gpus are left out).",
    ).tag(config=True)

    default_gpus = Int(1, help="GPUs of a session whose spawn names no count.").tag(config=True)

    max_gpus = Int(
        8,
        help="The most GPUs one session may have; larger requests are refused with a message.",
    ).tag(config=True)

    project_gpu_caps = Dict(
        value_trait=Int(),
        help="""Project -> the most GPUs it may hold at once. The form offers no more
        to a project, and a larger request is refused before it is submitted. Empty
        (the default): the broker's ``[policy.project_gpu_caps]``, read from the broker
        (GET /limits); set it only to offer less than the broker allows.""",
    ).tag(config=True)

    gpu_types = List(
        Unicode(),
        help="""GPU types a user may choose, e.g. ``["h100", "b200"]``. Empty (the
        default): every type among the broker's nodes. A session without a type
        takes any.""",
    ).tag(config=True)

    default_project = Unicode(
        "",
        help="""The project preselected and used when a spawn names none, if the
        user may charge it. Empty (the default): the user's project that ranks
        first in fair share.""",
    ).tag(config=True)

    session_max_runtime = Union(
        [Unicode(), Float()],
        default_value=None,
        allow_none=True,
        help="""A hard end for every session (seconds or a duration), after which
        its slice ends as ``expired`` and the server stops. None (the default):
        the broker's ``[defaults.interactive] max_runtime``.""",
    ).tag(config=True)

    heartbeat_interval = Float(
        30.0,
        help="""Seconds between heartbeats of a slice (while it waits and while it
        runs). A slice whose heartbeats stop for a lease ends as ``lost``, so where
        the broker's lease is known (``GET /limits``) a third of it is the most
        used: a broker whose lease is shortened needs no change here. After a failed
        call the spawner waits 2 s, doubled per failure in a row, at most this long.""",
    ).tag(config=True)

    queue_refresh_interval = Float(
        5.0,
        help="Seconds between refreshes of the queue position shown while a spawn waits.",
    ).tag(config=True)

    cull_idle_timeout = Union(
        [Unicode(), Float()],
        default_value="1h",
        help="""Stop a session past its protected period (or free) after this long idle
        when no waiting request could use its GPUs (seconds or a duration; 0: never).
        Idle is what the session reports (see ``session_activity``).""",
    ).tag(config=True)

    session_activity = Bool(
        True,
        help="""Read a session's idleness from the session itself (the Lab extension's
        ``slicebroker/activity`` route, with the server's own token): a kernel executing,
        a kernel's or terminal's output, typing in a terminal, or one of its GPUs busy is
        activity; an open browser tab is not. Where the route does not answer (a session
        without the extension, the hub's internal SSL) and when off, idle is the hub's
        ``last_activity`` of the server, which counts the browser's requests too.""",
    ).tag(config=True)

    restore_sessions = Bool(
        True,
        help="""Offer "Bring it back after a preemption" on the form. A session that asked
        for it is started again by the hub when a preemption (a drain's included) or its
        node going down ends it: the same options, queued in the old request's place in
        its project's queue, on the same files; its kernels start afresh. Off: the box is
        not shown and such requests are refused with a message.""",
    ).tag(config=True)

    cull_idle_busy = Union(
        [Unicode(), Float()],
        default_value="15m",
        help="""Stop a session past its protected period (or free) after this long idle
        while a waiting request could use its GPUs now (seconds or a duration; 0: never).""",
    ).tag(config=True)

    cull_idle_protected = Union(
        [Unicode(), Float()],
        default_value="1h",
        help="""Stop a session within its protected period only after this long idle, and
        only while a waiting request could use its GPUs now (seconds or a duration; 0:
        never). The options form states it next to the protected length.""",
    ).tag(config=True)

    cull_interval = Float(
        30.0,
        help="""Seconds between checks of a running session against the idle limits. The
        queue and the nodes are read from the broker at most every half of it, for
        all sessions of the hub together.""",
    ).tag(config=True)

    # Zero or less would heartbeat, poll or check the broker in a tight loop.
    _check_seconds = validate(
        "broker_timeout", "heartbeat_interval", "queue_refresh_interval", "cull_interval"
    )(seconds_above_zero)

    options_form_template_paths = List(
        Unicode(),
        help=f"""Directories searched, in order, for the options form's template
        ``{FORM_TEMPLATE}`` before the one shipped with the spawner. Copy the shipped
        file into one of them and change the layout; the values it shows are computed
        by the spawner (``spawner.options.form_context``) and escaped on output. An
        edited file is read again on the next render. Empty (the default): the shipped
        template.""",
    ).tag(config=True)

    @default("start_timeout")
    def _start_timeout_default(self) -> int:
        # A backend's own default wins (JupyterHub's NeverSpawner: 1 s); else an hour, not
        # the hub's 60 s: waiting in the queue happens inside start().
        mro = type(self).__mro__
        for cls in mro[mro.index(SliceBrokerMixin) + 1 :]:
            if cls is Spawner:
                break
            own = vars(cls).get("_trait_default_generators", {}).get("start_timeout")
            if own is not None:
                return own(self)
            trait = vars(cls).get("start_timeout")  # the trait declared again, e.g. Integer(300)
            if isinstance(trait, TraitType):
                return trait.default_value
        return QUEUE_START_TIMEOUT_S

    def __init__(self, **kwargs: Any) -> None:
        #: Where the session is: every hook reads it (:mod:`spawner.lifecycle`).
        self.lifecycle = Lifecycle()
        super().__init__(**kwargs)
        if self.has_trait("options_form") and not self.options_form:
            # The spawner below has no form of its own: the slice form is the whole form.
            # (Not a trait default, which would hide the default of the spawner below:
            # KubeSpawner's profile form. The mixin alone, without a spawner, has none.)
            self.options_form = render_options_form

    # ---- run-time state ----------------------------------------------------------

    slice_id: int | None = None
    #: The slice as the broker last showed it (``GET /slices/{id}``), or ``None``.
    slice: dict[str, Any] | None = None
    #: The request being (or last) submitted, set by :meth:`apply_slice_options`.
    slice_request: SliceRequest | None = None
    #: The GPU type of the granted node (the request may have named none).
    granted_gpu_type: str | None = None
    #: Why the last session ended, when the broker ended it (see :mod:`spawner.notices`).
    notice: dict[str, Any] | None = None
    #: Whether the session comes back after a preemption (the form's box, see restore_sessions).
    restore_chosen: bool = False
    #: The ended slice this session restores, as the broker showed it, or ``None``.
    restored_from: dict[str, Any] | None = None

    _broker: BrokerClient | None = None
    _watch_task: asyncio.Task | None = None
    _progress_events: list[dict[str, Any]] | None = None
    _sooner: str = ""  # what would start the waiting request sooner, in words
    _progress_update: asyncio.Event | None = None
    _update: asyncio.Event | None = None
    _options_seconds = 0.0
    _culling: asyncio.Future | None = None  # the stop of a session culled as idle
    _bringing_back: asyncio.Future | None = None  # the hub asked to start it again

    @property
    def broker(self) -> BrokerClient:
        """The broker's client, as the agent (one per spawner: long-polls hold a connection)."""
        if self._broker is None:
            if not self.broker_url:
                raise spawn_error(
                    "broker_config",
                    "The hub has no GPU broker configured (SliceBrokerMixin.broker_url); tell "
                    "your hub admin.",
                    status=500,
                )
            self._broker = BrokerClient(
                self.broker_url, self.broker_token, timeout=self.broker_timeout, max_clients=4
            )
        return self._broker

    @property
    def broker_view(self) -> BrokerView:
        """What the hub's sessions read of this spawner's broker, shared."""
        return BrokerView.of(self.broker_url)

    def choices(self) -> Choices:
        """What the admin offers within what the broker allows (its ``GET /limits``, as
        last read), as :mod:`spawner.options` reads it."""
        limits = self.broker_view.limits or {}
        protected = tuple(dict.fromkeys(parse_duration(v) for v in self.protected_choices))
        longest = limits.get("max_min_runtime")
        if longest is not None:  # the broker would refuse the longer ones
            protected = tuple(p for p in protected if p <= longest) or protected
        default_protected = parse_duration(self.protected_default)
        if default_protected not in protected:
            default_protected = protected[0]
        return Choices(
            protected=protected,
            protected_default=default_protected,
            gpus=tuple(self.gpu_choices),
            default_gpus=self.default_gpus,
            max_gpus=self.max_gpus,
            gpu_types=tuple(self.gpu_types),
            default_project=self.default_project,
            debug_max=(
                limits.get("debug_max_min_runtime", DEFAULT_DEBUG_MAX)
                if self.debug_protected_max is None
                else parse_duration(self.debug_protected_max)
            ),
            idle_protected=parse_duration(self.cull_idle_protected),
            idle_busy=parse_duration(self.cull_idle_busy),
            project_caps=dict(self.project_gpu_caps or limits.get("project_gpu_caps") or {}),
            offer_restore=self.restore_sessions,
        )

    def cull_limits(self) -> CullLimits:
        """The idle limits, in seconds."""
        return CullLimits(
            idle=parse_duration(self.cull_idle_timeout),
            busy=parse_duration(self.cull_idle_busy),
            protected=parse_duration(self.cull_idle_protected),
        )

    def _user_groups(self) -> list[str]:
        return sorted(group.name for group in getattr(self.user, "groups", None) or ())

    # ---- options -------------------------------------------------------------------

    async def _cluster_view(self) -> tuple[list, list, int, list]:
        """The user's projects, the cluster's GPU types, the queue length and the nodes, from
        the broker."""
        try:
            rows, nodes, limits = await asyncio.gather(
                self.broker.projects(), self.broker.nodes(), self._read_limits()
            )
        except BrokerAPIError as err:
            raise broker_error(err) from None
        self.broker_view.nodes_seen = nodes
        if limits is not None:
            self.broker_view.limits = limits
        projects = project_views(rows, self.user.name, self._user_groups())
        queue = sum(int(r.get("pending") or 0) for r in rows if r.get("is_project"))
        return projects, gpu_type_views(nodes), queue, nodes

    async def _read_limits(self) -> dict[str, Any] | None:
        """The broker's terms (``GET /limits``); None from a broker that has no such
        route (the traits' own values then stand)."""
        try:
            return await self.broker.limits()
        except BrokerAPIError as err:
            if err.status == 404:
                return None
            raise

    async def get_options_form(self) -> str:
        """The spawner's own form (its ``options_form``: KubeSpawner's profiles, an
        admin's form), then the slice form."""
        slice_form = await self.slice_options_form()
        if self.options_form is render_options_form:
            return slice_form
        own = await super().get_options_form()
        return f"{own}\n{slice_form}" if own else slice_form

    def run_options_from_form(self, form_data: Mapping[str, Any]) -> Any:
        """User options from the submitted form (:meth:`_own_and_slice_options`)."""
        return self._own_and_slice_options(form_data, super().run_options_from_form)

    def options_from_query(self, query_data: Mapping[str, Any]) -> Any:
        """User options from ``/hub/spawn?project=...`` (:meth:`_own_and_slice_options`)."""
        return self._own_and_slice_options(query_data, super().options_from_query)

    def _own_and_slice_options(
        self, form_data: Mapping[str, Any], own: Callable[[dict[str, Any]], Any]
    ) -> Any:
        """The slice's fields as :func:`~spawner.options.options_from_form` reads them, and
        the others as ``own`` reads them: the spawner's ``options_from_form``, JupyterHub's
        'passthrough' unless the admin set 'simple' or a callable (KubeSpawner: its
        profiles). A dict, as JupyterHub's contract has it; an awaitable only where
        ``own`` gives one."""
        others = own({k: v for k, v in form_data.items() if k not in OPTION_KEYS})
        slice_fields = options_from_form(form_data)
        if inspect.isawaitable(others):
            return self._merge_options(others, slice_fields)
        return {**(others or {}), **slice_fields}

    @staticmethod
    async def _merge_options(
        others: Awaitable[dict[str, Any]], slice_fields: dict[str, Any]
    ) -> dict[str, Any]:
        return {**((await others) or {}), **slice_fields}

    async def slice_options_form(self) -> str:
        """The options form: the user's projects with their budget position and queue,
        GPU count and type, and the protected length."""
        try:
            projects, gpu_types, queue, nodes = await self._cluster_view()
        except web.HTTPError as err:
            return render_form(
                projects=[],
                gpu_types=[],
                choices=self.choices(),
                broker_error=getattr(err, "jupyterhub_message", str(err)),
                template_paths=self.options_form_template_paths,
            )
        previous = self.orm_spawner.user_options if self.orm_spawner is not None else None
        choices = self.choices()
        return render_form(
            projects=projects,
            gpu_types=gpu_types,
            choices=choices,
            expected=await self._expected_starts([p.name for p in projects]),
            previous=previous or {},
            notice_html=notices.notice_alert(self.notice),
            queue_total=queue,
            capacity=capacity_note(nodes, 1),
            queue_url=notices.pages_url(self.broker_url),
            template_paths=self.options_form_template_paths,
        )

    async def _expected_starts(self, projects: Sequence[str]) -> dict[str, dict[str, Any]]:
        """When a session (its default terms) would start for each of ``projects``, by GPU
        type and size (``GET /expected-starts``, asked together); a project the broker
        cannot say for (an older broker, or it does not answer) is left out, and the
        form goes without its line."""
        protected = self.choices().protected_default

        async def ask(project: str) -> dict[str, Any] | None:
            try:
                return await self.broker.expected_starts(
                    project,
                    "interactive",
                    protected,
                    user=self.user.name,
                    groups=self._user_groups(),
                )
            except BrokerAPIError as err:
                self.log.debug("No expected starts for %s: %s", project, err.message)
                return None

        answers = await asyncio.gather(*(ask(project) for project in projects))
        return {p: a for p, a in zip(projects, answers, strict=True) if a is not None}

    async def apply_slice_options(self, user_options: Mapping[str, Any]) -> SliceRequest:
        """Check ``user_options`` and keep the request for :meth:`start`.

        Raises a :class:`SpawnException` with a message for the user when the
        options ask for what the user may not have. ``user_options`` stay as the hub
        and the form gave them; the request as resolved (defaults filled in) is in the
        spawner's state with its slice (``state["slicebroker"]["slice"]``).
        """
        began = time.perf_counter()
        projects, gpu_types, _, _ = await self._cluster_view()
        try:
            request = resolve_request(
                user_options or {}, projects=projects, gpu_types=gpu_types, choices=self.choices()
            )
        except OptionsError as err:
            raise spawn_error(err.reason, err.message, html=err.html) from None
        self.slice_request = request
        self._options_seconds = time.perf_counter() - began
        return request

    # ---- state ---------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        mine: dict[str, Any] = {}
        if self.slice_id is not None:
            mine["slice_id"] = self.slice_id
            if self.slice is not None:
                mine["slice"] = {
                    key: self.slice.get(key)
                    for key in (
                        "id",
                        "project",
                        "gpus",
                        "gpu_type",
                        "state",
                        "placements",
                        "granted_at",
                        "protected_until",
                        "min_runtime",
                    )
                }
            if self.granted_gpu_type:
                mine["granted_gpu_type"] = self.granted_gpu_type
        if self.notice:
            mine["notice"] = self.notice
        if self.restore_chosen:
            mine["restore"] = True
        if mine:
            state[notices.STATE_KEY] = mine
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        mine = state.get(notices.STATE_KEY) or {}
        self.slice_id = mine.get("slice_id")
        self.slice = mine.get("slice")
        self.notice = mine.get("notice")
        self.granted_gpu_type = mine.get("granted_gpu_type")
        self.restore_chosen = bool(mine.get("restore"))
        if self.slice_id is not None and not self.lifecycle.starting:
            # A hub restart: the first poll() asks the broker where the slice stands.
            self.lifecycle.move(Phase.RUNNING)
            self.lifecycle.needs_reconnect = True

    def clear_state(self) -> None:
        """Forget the slice (the notice stays until the next start, for the pages)."""
        super().clear_state()
        self.slice_id = None
        self.slice = None
        self.granted_gpu_type = None
        self.lifecycle.needs_reconnect = False
        self._options_seconds = 0.0

    def get_env(self) -> dict[str, str]:
        env = super().get_env()
        env.update(self.slice_env())
        # The session's own token (its owner's, with the server role's scopes), never the
        # agent's: work submitted from the session is the user's.
        env[URL_ENV] = self.session_broker_url or self.broker_url
        env[TOKEN_ENV] = env.get("JUPYTERHUB_API_TOKEN") or self.api_token
        # Lab's GPU extension: loaded from an editable install too, and told the idle limits.
        env.update(session_env(env))
        limits = self.cull_limits()
        env.update({name: f"{getattr(limits, key):g}" for key, name in CULL_ENV.items()})
        return env

    def slice_env(self) -> dict[str, str]:
        """Variables naming the slice: its id, project, node(s) and protected end."""
        s = self.slice
        if not s:
            return {}
        env = {
            "SLICEBROKER_SLICE_ID": str(s["id"]),
            "SLICEBROKER_PROJECT": str(s.get("project") or ""),
            "SLICEBROKER_PROTECTED_UNTIL": notices.iso_time(s.get("protected_until")),
            "SLICEBROKER_GPU_TYPE": str(s.get("gpu_type") or self.granted_gpu_type or ""),
            "SLICEBROKER_NODES": ",".join(p["node"] for p in s.get("placements") or ()),
        }
        if self.restore_chosen:
            env[RESTORE_ENV] = "1"
        old = self.restored_from
        if old:
            # A session brought back: which slice it restores and when that one ended.
            env[RESTORES_ENV] = str(old["id"])
            env[RESTORES_ENDED_ENV] = notices.iso_time(old.get("ended_at"))
        return env

    def placement_problem(self, slice_: Mapping[str, Any]) -> str | None:
        """Why a backend cannot launch on this grant (``None``: it can). Backends override."""
        return None

    # ---- start -----------------------------------------------------------------------

    async def start(self) -> Any:
        """Get a slice (waiting in the queue), then start the server on it."""
        self.lifecycle.move(Phase.REQUESTING)
        self.notice = None
        self._progress_events = []
        try:
            # Resolved here, not in apply_user_options (which stays the admin's): the hub
            # calls start() at once after it, as JupyterHub's own tests expect.
            request = await self.apply_slice_options(self.user_options or {})
            self.restore_chosen = request.restore
            granted = await self._acquire(request)
            if self.lifecycle.cancelled:  # stop() came as the grant did
                raise cancelled_error(granted.get("id"))
            self._add_progress(notices.grant_event(granted, self.broker_view.preemption_budget))
            self.lifecycle.move(Phase.LAUNCHING)
            try:
                url = await super().start()
            except BaseException:
                await asyncio.shield(self._release(self.slice_id))
                raise
            if self.lifecycle.phase is not Phase.LAUNCHING:
                # stop() came during the launch: it stops the server and the slice.
                raise cancelled_error(granted.get("id"))
            self.lifecycle.move(Phase.RUNNING)
            self.broker_view.watch_idle(self)
            return url
        except BaseException:
            if self.lifecycle.starting:
                self.lifecycle.move(Phase.STOPPED)
            raise
        finally:
            self.slice_request = None
            self._pulse_progress()
            if self.slice_id is not None and (self.slice or {}).get("state") != "granted":
                # The slice changed while the server launched: let the task act on it.
                self._start_watch()

    async def _acquire(self, request: SliceRequest) -> dict[str, Any]:
        gpus = f"{request.gpus} {request.gpu_type or ''} GPU{'s' if request.gpus != 1 else ''}"
        asking = (
            f"Asking the GPU broker for {' '.join(gpus.split())} "
            f"(project {request.project}, protected {format_duration(request.min_runtime)})"
        )
        self.restored_from = None
        if request.restores is not None:
            self.restored_from = await self._ended_slice(request.restores)
            asking = f"{notices.restoring_text(self.restored_from)} {asking}, in its place"
        self._add_progress({"progress": 5, "message": f"{asking}."})
        max_runtime = self.session_max_runtime
        began = time.perf_counter()
        submit = asyncio.ensure_future(
            self.broker.submit(
                request.project,
                request.gpus,
                "interactive",
                min_runtime=request.min_runtime,
                gpu_type=request.gpu_type,
                max_runtime=None if max_runtime is None else parse_duration(max_runtime),
                user=self.user.name,
                groups=self._user_groups(),
                restores=request.restores,
            )
        )
        try:
            submitted = await asyncio.shield(submit)
        except asyncio.CancelledError:
            # Cancelled while the request was on its way: withdraw what it made, if anything.
            with contextlib.suppress(Exception):
                made = await submit
                await self._release(made["id"])
            raise
        except BrokerAPIError as err:
            raise broker_error(err) from None
        self.log.info("Slice %s requested for %s: %s", submitted["id"], self._log_name, request)
        if self.lifecycle.cancelled:
            # stop() came while the request was on its way: withdraw what it made.
            await asyncio.shield(self._release(submitted["id"]))
            raise cancelled_error(submitted["id"])
        self._track(submitted)
        try:
            granted = await self._until_granted()
            problem = self.placement_problem(granted)
            if problem:
                raise spawn_error("placement", problem, status=500)
            self.granted_gpu_type = await self._granted_type(granted)
            waited = time.perf_counter() - began
            self.log.info(
                "Slice %s granted to %s: broker time %.1f ms (options %.1f ms, request and "
                "queue %.1f ms)",
                granted["id"],
                self._log_name,
                1000 * (self._options_seconds + waited),
                1000 * self._options_seconds,
                1000 * waited,
            )
            return granted
        except BaseException as err:
            why = "cancelled" if isinstance(err, asyncio.CancelledError) else "failed"
            self.log.info(
                "Spawn of %s %s; withdrawing slice %s", self._log_name, why, self.slice_id
            )
            await asyncio.shield(self._release(self.slice_id))
            raise

    async def _ended_slice(self, slice_id: int) -> dict[str, Any]:
        """The slice a session restores, as far as the broker shows it (its id at least)."""
        try:
            return await self.broker.get_slice(slice_id)
        except BrokerAPIError as err:
            raise broker_error(err) from None

    async def _granted_type(self, granted: Mapping[str, Any]) -> str | None:
        """The GPU type of the granted node(s): the request's, else the node's."""
        if granted.get("gpu_type"):
            return granted["gpu_type"]
        try:
            nodes = await self.broker.nodes()
        except BrokerAPIError as err:
            self.log.warning("Cannot read the nodes of %s's grant: %s", self._log_name, err.message)
            return None
        self.broker_view.nodes_seen = nodes
        names = {p["node"] for p in granted.get("placements") or ()}
        types = sorted({n["gpu_type"] for n in nodes if n["name"] in names})
        return ",".join(types) or None

    async def _until_granted(self) -> dict[str, Any]:
        waited_on = self.slice_id
        while True:
            update = self._update_event()
            waited_on = self.slice_id or waited_on  # the request that replaced it, if any
            if self.lifecycle.cancelled:
                raise cancelled_error(waited_on)
            s = self.slice or {}
            if s.get("state") == "granted":
                return s
            if s.get("state") in ("preempting", "ended"):
                why = s.get("end_reason") or s.get("preempt_reason") or s.get("state")
                raise spawn_error(
                    "slice_ended",
                    f"Your GPU request (slice {s.get('id')}) ended before it was granted "
                    f"({why}). Start again.",
                )
            await update.wait()

    # ---- progress ------------------------------------------------------------------------

    def _add_progress(self, event: dict[str, Any]) -> None:
        if self._progress_events is None:
            return
        if self._progress_events and self._progress_events[-1]["message"] == event["message"]:
            return
        self._progress_events.append(event)
        self._pulse_progress()

    def _pulse_progress(self) -> None:
        if self._progress_update is not None:
            old, self._progress_update = self._progress_update, asyncio.Event()
            old.set()

    async def progress(self) -> Any:
        """Queue position, fair-share value and estimated wait while pending; the grant;
        then the backend's own events while it launches (KubeSpawner's pod events,
        JupyterHub's "Spawning server..."), their progress scaled into the part of the bar
        after the grant so that it never goes back."""
        seen = 0
        while True:
            if self._progress_update is None:
                self._progress_update = asyncio.Event()
            update = self._progress_update
            events = self._progress_events or []
            while seen < len(events):
                yield events[seen]
                seen += 1
            phase = self.lifecycle.phase
            if phase is Phase.LAUNCHING or not (
                self.lifecycle.starting or getattr(self, "_spawn_pending", False)
            ):
                break
            await update.wait()
        if self.lifecycle.phase is not Phase.LAUNCHING:
            return  # no grant (the request failed), or the launch is already over
        async for event in super().progress():
            if "progress" in event:
                event = {**event, "progress": after_grant(event["progress"])}
            yield event

    # ---- the slice's background task ------------------------------------------------------

    def _update_event(self) -> asyncio.Event:
        if self._update is None:
            self._update = asyncio.Event()
        return self._update

    def _pulse_update(self) -> None:
        """Wake whoever waits on the slice (:meth:`_until_granted`)."""
        if self._update is not None:
            old, self._update = self._update, asyncio.Event()
            old.set()

    def _track(self, slice_: dict[str, Any]) -> None:
        """Hold ``slice_``: remember it and start heartbeating and watching it."""
        self.slice_id = slice_["id"]
        if self.lifecycle.phase is Phase.REQUESTING:
            self.lifecycle.move(Phase.WAITING)
        self._observe(slice_)
        self._start_watch()

    def _start_watch(self, beat_now: bool = False) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.ensure_future(self._watch(self.slice_id, beat_now))

    def _cancel_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()

    def _observe(self, slice_: dict[str, Any]) -> None:
        """Take in the broker's latest view of the held slice."""
        if slice_.get("id") != self.slice_id:
            return
        previous = (self.slice or {}).get("state")
        self.slice = slice_
        state = slice_.get("state")
        nodes = self.broker_view.nodes_seen
        starting = self.lifecycle.starting
        if state == "pending" and starting:
            capacity = capacity_note(nodes or [], slice_.get("gpus") or 0, slice_.get("gpu_type"))
            queue_url = notices.pages_url(self.broker_url)
            now = time.time()
            held = self.broker_view.held_seen
            budget = self.broker_view.preemption_budget
            reason = notices.wait_reason(slice_, nodes or [], held, now, budget)
            event = notices.queue_event(slice_, now, capacity, queue_url, reason, self._sooner)
            self._add_progress(event)
        if state != previous and state in ("preempting", "ended") and not starting:
            # Only a session that comes back carries its count of preemptions on.
            budget = self.broker_view.preemption_budget if self.restore_chosen else None
            self.notice = notices.notice_from_slice(slice_, nodes, budget)
            if self.orm_spawner is not None:
                # The pages read the stored state: show the news now (the hub commits it).
                self.orm_spawner.state = self.get_state()
            self.log.warning(
                "Slice %s of %s is %s (%s)",
                slice_.get("id"),
                self._log_name,
                state,
                slice_.get("preempt_reason") or slice_.get("end_reason"),
            )
        self._pulse_update()

    async def _heartbeat(self, slice_id: int) -> dict[str, Any]:
        """Heartbeat ``slice_id`` with the hub's other slices (:meth:`BrokerView.heartbeats`)."""
        return await self.broker_view.heartbeats(self.broker).beat(slice_id)

    def _beat_interval(self) -> float:
        """Seconds to the next heartbeat: ``heartbeat_interval``, or a third of the
        broker's lease where that is shorter (three beats may be lost before the slice)."""
        lease = (self.broker_view.limits or {}).get("lease")
        return self.heartbeat_interval if lease is None else min(self.heartbeat_interval, lease / 3)

    def _retry_pause(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failed calls in a row: ``RETRY_PAUSE_S``,
        doubled each time, at most the heartbeat interval."""
        return min(RETRY_PAUSE_S * 2 ** (failures - 1), max(self._beat_interval(), RETRY_PAUSE_S))

    async def _watch(self, slice_id: int, beat_now: bool = False) -> None:
        """Heartbeat the slice and follow its state until it ends or is released.

        A new request is heartbeated at once, alongside the first long-poll; a
        reconnect (``beat_now``) heartbeats before anything else.
        """
        next_beat = 0.0 if beat_now else time.monotonic() + self._beat_interval()
        failures = 0  # calls failed in a row: the pause before the next one grows
        if not beat_now:
            # A new request gets its lease at once (a hub that dies now leaves nothing
            # waiting for ever), without delaying the long-poll that sees the grant.
            first = asyncio.ensure_future(self._heartbeat(slice_id))
            first.add_done_callback(lambda f: f.cancelled() or f.exception())
        while self.slice_id == slice_id:
            s = self.slice or {}
            state = s.get("state")
            if state == "ended":
                break
            if (
                state == "preempting"
                and time.time() >= (s.get("preempt_deadline") or 0) + END_WAIT_S
            ):
                break
            now = time.monotonic()
            try:
                if now >= next_beat:
                    fresh = await self._heartbeat(slice_id)
                    next_beat = now + self._beat_interval()
                else:
                    fresh = await self._next_change(slice_id, s, next_beat - now)
            except asyncio.CancelledError:
                raise
            except BrokerAPIError as err:
                if err.status == 404:
                    self.log.warning(
                        "Slice %s of %s is gone from the broker", slice_id, self._log_name
                    )
                    self._observe({**s, "id": slice_id, "state": "ended", "end_reason": "lost"})
                    break
                self.log.warning("Slice %s of %s: %s", slice_id, self._log_name, err.message)
                failures += 1
                await asyncio.sleep(self._retry_pause(failures))
                continue
            except Exception:
                self.log.exception("Watching slice %s of %s failed", slice_id, self._log_name)
                failures += 1
                await asyncio.sleep(self._retry_pause(failures))
                continue
            failures = 0
            successor = fresh.get("replaced_by")
            if fresh.get("state") == "ended" and successor is not None and self.lifecycle.starting:
                self._follow(slice_id, successor)
                return
            self._observe(fresh)
        phase = self.lifecycle.phase
        if (
            self.slice_id == slice_id
            and not self.lifecycle.starting
            and phase is not Phase.STOPPING
        ):
            await self._end_session(slice_id)

    def _follow(self, slice_id: int, successor: int) -> None:
        """The waiting request was replaced by one of its alternatives (the user took
        it, on the broker's pages or with ``slicebroker sooner --take``): hold and wait
        for the new slice instead, as if it had been submitted in its place."""
        self.log.info(
            "Slice %s of %s was replaced by slice %s (an alternative taken); following it",
            slice_id,
            self._log_name,
            successor,
        )
        self.slice_id, self.slice = successor, None
        if self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
        self._watch_task = asyncio.ensure_future(self._watch(successor, beat_now=True))
        self._pulse_update()

    async def _next_change(
        self, slice_id: int, s: Mapping[str, Any], wait: float
    ) -> dict[str, Any]:
        """The slice once it changes from ``s``, or after at most ``wait`` seconds: less
        while it is pending (the queue view refreshes) or preempting (its end is near)."""
        state = s.get("state")
        if state == "pending":
            wait = min(wait, self.queue_refresh_interval)
            # Fresh nodes for the page: is the cluster draining or down?
            await self.broker_view.queue(self.read_queue, self.cull_interval / 2)
            await self._look_for_sooner(slice_id, s)
        elif state == "preempting":
            until_end = (s.get("preempt_deadline") or 0) + END_WAIT_S - time.time()
            wait = min(wait, max(until_end, 0.05))
        return await self.broker.wait_for_change(slice_id, state, wait)

    async def _look_for_sooner(self, slice_id: int, s: Mapping[str, Any]) -> None:
        """Once the request has waited ``SOONER_AFTER_S``, what would start it sooner, for
        the pending page (design.md §5.8); a broker without the route offers nothing."""
        if time.time() - (s.get("submitted_at") or time.time()) < SOONER_AFTER_S:
            return
        try:
            found = await self.broker.alternatives(slice_id)
        except BrokerAPIError as err:
            self.log.debug("No alternatives for slice %s: %s", slice_id, err.message)
            return
        self._sooner = notices.sooner_text(found, s, asked_at=time.time())

    async def _end_session(self, slice_id: int, why: str | None = None) -> None:
        """The slice is over (or the session ``why``, e.g. idle): stop the server and let
        the hub notice at once."""
        s = self.slice or {}
        if why is None:
            reason = s.get("end_reason") or s.get("preempt_reason")
            why = f"its slice {slice_id} is {s.get('state')}" + (f" ({reason})" if reason else "")
        self.log.warning("Stopping %s: %s", self._log_name, why)
        self.lifecycle.move(Phase.STOPPING)
        try:
            await self._backend_stop(now=False)
        except Exception:
            self.log.exception("Stopping %s after its slice ended failed", self._log_name)
        await self._release(slice_id)
        self.lifecycle.move(Phase.STOPPED)
        await self.poll_and_notify()
        if self.restore_chosen and self.restore_sessions and restore.ended_by_preemption(s):
            options = restore.restart_options(self.user_options or {}, slice_id)
            self._bringing_back = asyncio.ensure_future(restore.bring_back(self, options, self.log))

    async def _backend_stop(self, now: bool = False) -> None:
        """Stop the server with the spawner below this mixin (``now`` only when set: some
        spawners' ``stop()`` takes no argument, JupyterHub's mock spawners among them)."""
        if now:
            await super().stop(now=True)
        else:
            await super().stop()

    async def _release(self, slice_id: int | None) -> None:
        """Let the slice go (cancel it if it waits). Idempotent; never raises."""
        if slice_id is None:
            return
        if self.slice_id == slice_id:
            self._cancel_watch()
            self.broker_view.unwatch_idle(self)
        known = self.slice if (self.slice or {}).get("id") == slice_id else None
        if known is None or known.get("state") != "ended":
            try:
                final = await self.broker.release(slice_id)
                self.log.info(
                    "Slice %s of %s released (%s, %.1f GPU-seconds charged)",
                    slice_id,
                    self._log_name,
                    final.get("end_reason"),
                    final.get("charged_gpu_seconds") or 0.0,
                )
            except BrokerAPIError as err:
                if err.status != 404:
                    self.log.error(
                        "Releasing slice %s of %s failed (%s); its lease will end it",
                        slice_id,
                        self._log_name,
                        err.message,
                    )
            except Exception:
                self.log.exception("Releasing slice %s of %s failed", slice_id, self._log_name)
        if self.slice_id == slice_id:
            self.slice_id = None

    def _reconnect(self) -> None:
        """After a hub restart: hold the slice again. The background task asks the broker
        where it stands (the broker may still be starting) and stops a server whose slice
        ended while the hub was away."""
        self.lifecycle.needs_reconnect = False
        if self.slice_id is not None:
            self.log.info("Reconnecting %s to slice %s", self._log_name, self.slice_id)
            self._start_watch(beat_now=True)
            self.broker_view.watch_idle(self)

    # ---- idle sessions ------------------------------------------------------------------------

    def idle_checkable(self) -> bool:
        """Whether the idle pass checks this session now: running on a granted slice."""
        return (
            self.slice_id is not None
            and self.lifecycle.phase is Phase.RUNNING
            and (self.slice or {}).get("state") == "granted"
        )

    async def session_idle_seconds(self, now: float) -> tuple[float | None, str]:
        """The session's idle seconds and where they were read: ``the session`` (its own
        activity route) or ``the hub`` (``last_activity``, see ``session_activity``)."""
        server = self.server
        if self.session_activity and server is not None and not self.internal_ssl:
            url = server.url.rstrip("/") + "/slicebroker/activity"
            try:
                answer = await AsyncHTTPClient().fetch(
                    url, headers={"Authorization": f"token {self.api_token}"}, request_timeout=10
                )
                return max(float(json.loads(answer.body)["idle_seconds"]), 0.0), "the session"
            except (HTTPClientError, OSError, ValueError, KeyError, TypeError) as err:
                self.log.debug("Activity of %s not read from the session: %s", self._log_name, err)
        return self.idle_seconds(now), "the hub"

    def idle_seconds(self, now: float) -> float | None:
        """Seconds since the server's last activity as the hub saw it (``None``: unknown)."""
        orm = self.orm_spawner
        last = getattr(orm, "last_activity", None) or getattr(orm, "started", None)
        if last is None:
            return None
        if last.tzinfo is None:  # the hub stores naive UTC
            last = last.replace(tzinfo=UTC)
        return max(now - last.timestamp(), 0.0)

    async def read_queue(self) -> tuple[list, list, list]:
        """The broker's pending slices, nodes and granted slices (the idle rule's view)."""
        return await asyncio.gather(
            self.broker.list_slices(state="pending"),
            self.broker.nodes(),
            self.broker.list_slices(state="granted"),
        )

    def idle_for_a_waiter(self, idle: float, now: float) -> bool:
        """Whether the session has idled long enough to be stopped if a waiting request
        could use its GPUs (the rule's limit with a waiter)."""
        return verdict(self.slice or {}, now, self.cull_limits(), {"id": None}).due(idle)

    def idle_check(
        self,
        pending: list,
        nodes: list,
        idle: float | None,
        source: str,
        now: float,
        idle_beside: Mapping[str, int] | None = None,
    ) -> bool:
        """One check of the idle rule (:mod:`spawner.culler`) against the hub's view of the
        queue (``pending``, ``nodes``) and the session's ``idle`` seconds (read from
        ``source``); ``idle_beside``: node -> GPUs of the other sessions idle long enough
        to go for a waiting request (see :func:`~spawner.culler.waiter_for`). When it is
        due, stop the session with a ``culled_idle`` notice and say so (True)."""
        session = self.slice or {}
        view = self.broker_view
        waiter = waiter_for(session, pending, nodes, view.freeing, idle_beside)
        rule = verdict(session, now, self.cull_limits(), waiter)
        waiting = (
            f"waiting request {rule.waiter} could use its GPUs"
            if rule.waiter is not None
            else "no waiting request could use its GPUs"
        )
        self.log.debug(
            "Idle check of %s: idle %s s, limit %s s, %s (idleness from %s)",
            self._log_name,
            None if idle is None else round(idle),
            rule.limit,
            waiting,
            source,
        )
        if idle is None or not rule.due(idle) or self.slice_id is None:
            return False
        self.log.warning(
            "Culling %s: idle %.0f s >= %.0f s (%s; %s)",
            self._log_name,
            idle,
            rule.limit,
            "protected" if rule.protected else "past its protection",
            waiting,
        )
        self.notice = notices.cull_notice(session, now, idle, rule)
        if self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
        view.count_as_freeing(session)
        view.unwatch_idle(self)
        self._culling = asyncio.ensure_future(
            self._end_session(self.slice_id, why=f"idle for {idle:.0f} s")
        )
        return True

    # ---- poll and stop ----------------------------------------------------------------------

    async def poll(self) -> int | None:
        """``None`` while starting (waiting in the queue included) or running; else the exit
        status, once the slice is released."""
        phase = self.lifecycle.phase
        if self.lifecycle.starting:
            return None
        if self.lifecycle.needs_reconnect:
            self._reconnect()
        held = self.slice_id
        status = await super().poll()  # the local spawner clears its state when dead
        if status is not None and phase is not Phase.STOPPING:
            if held is not None:
                await self._release(held)
            if phase is Phase.RUNNING:
                self.lifecycle.move(Phase.STOPPED)
        return status

    async def stop(self, now: bool = False) -> None:
        """Stop the server (if any) and release the slice; safe to call at any time."""
        held = self.slice_id
        # Before the grant the backend has launched nothing: its stop() would act on no
        # server (the local backend would signal pid 0, the hub's own process group).
        launched = not self.lifecycle.before_grant
        if not launched:
            # A spawn that waits is cancelled: start() raises once the request is gone.
            self.lifecycle.cancelled = True
        self.lifecycle.move(Phase.STOPPING)
        if held is not None:
            self._cancel_watch()
            self.broker_view.unwatch_idle(self)
        try:
            if launched:
                await self._backend_stop(now=now)
        except BaseException:
            if held is not None and self.slice_id == held:
                # The server may still run on the slice's GPUs: they must not go to anyone
                # else. The slice stays held (heartbeats go on) until a stop succeeds.
                self.log.error(
                    "Stopping %s failed; its slice %s is kept, as the server may still run "
                    "on its GPUs",
                    self._log_name,
                    held,
                )
                self.lifecycle.move(Phase.RUNNING)
                self._start_watch()
                self.broker_view.watch_idle(self)
                raise
            await self._release(held)
            self.lifecycle.move(Phase.STOPPED)
            raise
        await self._release(held)
        self.lifecycle.move(Phase.STOPPED)
        self._pulse_update()


__all__ = ["SliceBrokerMixin", "render_options_form", "spawn_error"]
