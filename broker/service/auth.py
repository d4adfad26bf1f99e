"""Who is calling: API tokens and the identities they stand for.

A request carries ``Authorization: token <t>`` (or ``Bearer <t>``). Two
authenticators turn a token into the
:class:`~broker.store.Principal` it stands for:

- :class:`TokenAuthenticator` (standalone): the broker's own tokens, made with
  :func:`create_token` (``slicebroker token create``) and stored as salted
  SHA-256 hashes in the ``api_tokens`` table; the configuration's ``admins``
  are admins too.
- :class:`HubAuthenticator` (a JupyterHub service): JupyterHub tokens, checked
  with the hub (:class:`jupyterhub.services.auth.HubAuth`). A token must hold
  ``access:services!service=<this service>`` to be let in; the custom scopes
  :data:`ADMIN_SCOPE` and :data:`AGENT_SCOPE` make it an admin or an agent.

Both cache answers for a few seconds. Tokens are never logged; only a hash of a
token ever leaves this module.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import delete, select

from ..errors import BrokerError
from ..orm import (
    READ_ONLY_OPTION,
    ApiTokenRow,
    DatabaseNotInitialized,
    check_schema,
    make_engine,
    migrate,
)
from ..store.access import Principal

log = logging.getLogger(__name__)

#: JupyterHub custom scope making a token's owner a broker admin.
ADMIN_SCOPE = "custom:slicebroker:admin"
#: JupyterHub custom scope letting a token act for any user (the spawner's).
AGENT_SCOPE = "custom:slicebroker:agent"

TOKEN_PREFIX = "sb"
_HASH_SCHEME = "sha256"
_ROLES = ("user", "agent")

T = TypeVar("T")


class Unavailable(BrokerError):
    """The hub, which identifies tokens in hub mode, cannot be reached."""

    status = 503
    code = "auth_unavailable"


def parse_authorization(header: str | None) -> str | None:
    """The token in an ``Authorization: token <t>`` (or ``Bearer <t>``) header, if any."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("token", "bearer"):
        return None
    token = token.strip()
    return token or None


def token_key(token: str) -> str:
    """A stable, non-reversible name for ``token``: what caches and logs may hold."""
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


# ---- the broker's own tokens ------------------------------------------------------


@dataclass(frozen=True)
class TokenInfo:
    """A stored token, without its secret."""

    id: int
    user: str
    admin: bool
    agent: bool
    created_at: float


def _digest(salt: str, role: str, secret: str) -> str:
    return hashlib.sha256(f"{salt}:{role}:{secret}".encode()).hexdigest()


def _is_id(text: str) -> bool:
    """Whether ``text`` can be a row id (a positive 32-bit integer, in ASCII digits)."""
    return text.isascii() and text.isdigit() and 0 < int(text) < 2**31


def _role(hashed: str) -> str | None:
    parsed = _parse_hashed(hashed)
    return parsed[0] if parsed else None


def _parse_hashed(hashed: str) -> tuple[str, str, str] | None:
    """``(role, salt, digest)`` of a stored hash ``sha256$<role>$<salt>$<digest>``."""
    parts = hashed.split("$")
    if len(parts) != 4 or parts[0] != _HASH_SCHEME or parts[1] not in _ROLES:
        return None
    return parts[1], parts[2], parts[3]


class TokenStore:
    """The broker's own API tokens in the ``api_tokens`` table of the database at ``url``.

    A token reads ``sb_<id>_<secret>``; the table keeps the owner, the admin flag
    and ``sha256$<role>$<salt>$<digest>`` (``role`` is ``user`` or ``agent``;
    the digest covers salt, role and secret, so neither can be changed in the
    table without invalidating the token). A blank database is initialised.
    """

    def __init__(self, url: str):
        self._engine = make_engine(url)
        self._reads = self._engine.execution_options(**{READ_ONLY_OPTION: True})
        try:
            check_schema(self._engine)
        except DatabaseNotInitialized:
            migrate(self._engine)
        except BaseException:
            self._engine.dispose()
            raise

    def close(self) -> None:
        self._engine.dispose()

    def create(self, user: str, *, admin: bool = False, agent: bool = False) -> str:
        if not isinstance(user, str) or not user.strip() or len(user) > 255:
            raise ValueError(f"a token needs a user name, got {user!r}")
        secret = secrets.token_urlsafe(32)
        salt = secrets.token_hex(8)
        role = "agent" if agent else "user"
        hashed = f"{_HASH_SCHEME}${role}${salt}${_digest(salt, role, secret)}"
        with self._engine.begin() as connection:
            result = connection.execute(
                ApiTokenRow.__table__.insert().values(
                    user=user, hashed=hashed, admin=bool(admin), created_at=time.time()
                )
            )
            (token_id,) = result.inserted_primary_key
        return f"{TOKEN_PREFIX}_{token_id}_{secret}"

    def verify(self, token: str) -> TokenInfo | None:
        """The stored token ``token`` stands for, or ``None``."""
        prefix, _, rest = token.partition("_")
        token_id, _, secret = rest.partition("_")
        if prefix != TOKEN_PREFIX or not secret or not _is_id(token_id):
            return None
        with self._reads.connect() as connection:
            row = connection.execute(
                select(ApiTokenRow).where(ApiTokenRow.id == int(token_id))
            ).first()
        if row is None:
            return None
        parsed = _parse_hashed(row.hashed)
        if parsed is None:
            return None
        role, salt, digest = parsed
        if not hmac.compare_digest(_digest(salt, role, secret), digest):
            return None
        return TokenInfo(row.id, row.user, row.admin, role == "agent", row.created_at)

    def revoke(self, token: str) -> bool:
        """Delete ``token``; whether it existed."""
        info = self.verify(token)
        if info is None:
            return False
        with self._engine.begin() as connection:
            connection.execute(delete(ApiTokenRow).where(ApiTokenRow.id == info.id))
        return True

    def revoke_id(self, token_id: int) -> bool:
        """Delete the token numbered ``token_id`` (its ``sb_<id>_`` part); whether it existed."""
        with self._engine.begin() as connection:
            result = connection.execute(delete(ApiTokenRow).where(ApiTokenRow.id == token_id))
        return bool(result.rowcount)

    def revoke_user(self, user: str) -> int:
        """Delete every token of ``user``; how many there were."""
        with self._engine.begin() as connection:
            result = connection.execute(delete(ApiTokenRow).where(ApiTokenRow.user == user))
        return result.rowcount or 0

    def list(self, user: str | None = None) -> list[TokenInfo]:
        query = select(ApiTokenRow).order_by(ApiTokenRow.id)
        if user is not None:
            query = query.where(ApiTokenRow.user == user)
        with self._reads.connect() as connection:
            rows = connection.execute(query).all()
        return [
            TokenInfo(r.id, r.user, r.admin, _role(r.hashed) == "agent", r.created_at) for r in rows
        ]


def _with_store(url: str, use: Callable[[TokenStore], T]) -> T:
    store = TokenStore(url)
    try:
        return use(store)
    finally:
        store.close()


def create_token(db_url: str, user: str, admin: bool = False, agent: bool = False) -> str:
    """A new API token for ``user`` in the broker's database at ``db_url``.

    ``admin`` tokens may do everything; ``agent`` tokens may act on behalf of
    any user (for a spawner). The token is shown once: only its hash is kept.
    What ``slicebroker token create --user NAME [--admin] [--agent]`` runs.
    """
    return _with_store(db_url, lambda store: store.create(user, admin=admin, agent=agent))


def revoke_token(db_url: str, token: str) -> bool:
    """Revoke one token; whether it existed. Takes effect within the cache time."""
    return _with_store(db_url, lambda store: store.revoke(token))


def revoke_token_id(db_url: str, token_id: int) -> bool:
    """Revoke the token numbered ``token_id`` (as :func:`list_tokens` shows); whether it existed."""
    return _with_store(db_url, lambda store: store.revoke_id(token_id))


def revoke_user_tokens(db_url: str, user: str) -> int:
    """Revoke every token of ``user``; how many there were."""
    return _with_store(db_url, lambda store: store.revoke_user(user))


def list_tokens(db_url: str, user: str | None = None) -> list[TokenInfo]:
    """The stored tokens (of ``user``), without their secrets."""
    return _with_store(db_url, lambda store: store.list(user))


# ---- authenticators -----------------------------------------------------------------


@dataclass
class _Cache:
    """Answers kept for ``max_age`` seconds, keyed by a hash of the token."""

    max_age: float
    max_entries: int = 10_000
    _entries: dict[str, tuple[float, Any]] = field(default_factory=dict)

    def get(self, key: str) -> tuple[bool, Any]:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return False, None
        return True, entry[1]

    def put(self, key: str, value: Any) -> None:
        if self.max_age <= 0:
            return
        if len(self._entries) >= self.max_entries:
            now = time.monotonic()
            self._entries = {k: v for k, v in self._entries.items() if v[0] >= now}
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
        self._entries[key] = (time.monotonic() + self.max_age, value)


class Authenticator:
    """Turns a token into the :class:`~broker.store.Principal` it stands for.

    :meth:`authenticate` returns ``None`` for a token nobody issued (the caller
    answers 401) and raises a :class:`~broker.errors.BrokerError` (e.g.
    :class:`~broker.errors.Forbidden`) for a known token that may not use the broker.
    """

    mode = "abstract"

    async def authenticate(self, token: str) -> Principal | None:
        raise NotImplementedError

    def describe(self) -> str:
        return self.mode

    def close(self) -> None:
        pass


class TokenAuthenticator(Authenticator):
    """Standalone mode: the broker's own tokens; ``admins`` (user names) are admins too.

    ``run`` runs a blocking function off the event loop (the service's database
    thread), so that token look-ups queue with the other database work.
    """

    mode = "standalone"

    def __init__(
        self,
        store: TokenStore,
        run: Callable[[Callable[[], T]], Awaitable[T]],
        *,
        admins: Iterable[str] = (),
        cache_max_age: float = 5.0,
    ):
        self.store = store
        self._run = run
        self.admins = frozenset(admins)
        self._cache = _Cache(cache_max_age)
        # Look-ups under way, by token key: requests that arrive with the same token
        # while its answer is looked up wait for that one look-up (a client's
        # requests all miss the cache together once its answer is too old).
        self._looking_up: dict[str, asyncio.Future] = {}

    async def authenticate(self, token: str) -> Principal | None:
        key = token_key(token)
        found, identity = self._cache.get(key)
        if found:
            return identity
        looking_up = self._looking_up.get(key)
        if looking_up is None:
            looking_up = asyncio.ensure_future(self._look_up(key, token))
            self._looking_up[key] = looking_up
            looking_up.add_done_callback(lambda _: self._looking_up.pop(key, None))
        return await asyncio.shield(looking_up)

    async def _look_up(self, key: str, token: str) -> Principal | None:
        info = await self._run(lambda: self.store.verify(token))
        identity = None
        if info is not None:
            identity = Principal(
                name=info.user, admin=info.admin or info.user in self.admins, agent=info.agent
            )
        self._cache.put(key, identity)
        return identity

    def close(self) -> None:
        self.store.close()


class HubAuthenticator(Authenticator):
    """Hub-service mode: JupyterHub identifies tokens (``GET /hub/api/user``).

    ``hub_auth`` is a :class:`jupyterhub.services.auth.HubAuth`; it reads
    ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_API_URL`` and ``JUPYTERHUB_SERVICE_NAME``
    and requires ``access:services!service=<name>`` of every token.
    """

    mode = "jupyterhub"

    def __init__(self, hub_auth: Any):
        from jupyterhub.services.auth import check_scopes

        self.hub_auth = hub_auth
        self._check_scopes = check_scopes

    @classmethod
    def from_environment(cls, cache_max_age: float = 5.0) -> HubAuthenticator:
        from jupyterhub.services.auth import HubAuth

        return cls(HubAuth(cache_max_age=cache_max_age))

    def describe(self) -> str:
        scopes = ", ".join(sorted(self.hub_auth.access_scopes)) or "none"
        return f"{self.mode} (hub API {self.hub_auth.api_url}, access scopes: {scopes})"

    async def authenticate(self, token: str) -> Principal | None:
        from tornado.web import HTTPError

        try:
            model = await self.hub_auth.user_for_token(token, sync=False)
        except HTTPError as err:
            raise Unavailable(
                f"cannot check the token with JupyterHub: {err.log_message}"
            ) from None
        if not model:
            return None
        scopes = set(model.get("scopes") or ())
        access = self.hub_auth.access_scopes
        if access and not self._check_scopes(access, scopes):
            from ..errors import Forbidden

            needed = " or ".join(sorted(access))
            raise Forbidden(f"this token may not use the broker: it needs the scope {needed}")
        kind = model.get("kind", "user")
        return Principal(
            name=model["name"],
            groups=frozenset(model.get("groups") or ()) if kind == "user" else frozenset(),
            admin=bool(self._check_scopes({ADMIN_SCOPE}, scopes)),
            agent=bool(self._check_scopes({AGENT_SCOPE}, scopes)),
            kind=kind,
        )
