"""The API's root: its version, who the caller is, and the OpenAPI document."""

from __future__ import annotations

from typing import Any

from ... import __version__
from ...store import Principal
from ..openapi import build_document
from .base import APIHandler, Operation, Param
from .common import acting_identity, is_member

API_VERSION = "v1"


class RootHandler(APIHandler):
    operations = {
        "get": Operation(
            "Show the broker's version",
            "Needs no token; a quick way to see that the broker is up, and whether it "
            "leads or waits as a standby (`role`).",
            auth="none",
            content={"application/json": "Version"},
        )
    }

    async def get(self) -> None:
        # A standby answers this too, with its own role (broker.service.leader).
        self.write_json({"version": __version__, "api": API_VERSION, "role": "leader"})


class WhoAmIHandler(APIHandler):
    operations = {
        "get": Operation(
            "Show who the token belongs to",
            "The caller's name, groups, roles and the projects they may charge (every "
            "project for admins). Agents and admins may pass `user` (and `group`) to see "
            "the projects a user may charge, as the spawner does to build its form.",
            parameters=(
                Param(
                    "user",
                    "query",
                    {"type": "string", "minLength": 1, "maxLength": 255},
                    "see this user instead of the caller (agents and admins only)",
                ),
                Param(
                    "group",
                    "query",
                    {"type": "array", "items": {"type": "string", "minLength": 1}},
                    "that user's groups (repeat the parameter for several)",
                ),
            ),
            content={"application/json": "Identity"},
        )
    }

    async def get(self) -> None:
        params = self.params()
        identity = acting_identity(self.identity, params.get("user"), params.get("group"))
        projects = await self.runner.read_between_passes(self.broker.projects)
        self.write_json(describe(identity, projects))


def describe(identity: Principal, projects: list[dict[str, Any]]) -> dict[str, Any]:
    """``identity`` as ``GET /whoami`` shows it, with the projects it may charge."""
    chargeable = [
        p["name"]
        for p in projects
        if p["is_project"] and (identity.admin or is_member(identity, p))
    ]
    return {
        "name": identity.name,
        "kind": identity.kind,
        "groups": sorted(identity.groups),
        "admin": identity.admin,
        "agent": identity.agent,
        "projects": sorted(chargeable),
    }


class LimitsHandler(APIHandler):
    operations = {
        "get": Operation(
            "Show the terms requests are held to",
            "The lease, the grace period, the longest protected period, the debug lane's "
            "limits (GPUs, protected period), each project's GPU cap and the contract "
            "defaults per kind, in seconds. Clients plan by these (the spawner's form "
            "offers no more than they allow) instead of copying the broker's configuration.",
            content={"application/json": "Limits"},
        )
    }

    async def get(self) -> None:
        self.write_json(self.broker.limits())


class OpenAPIHandler(APIHandler):
    operations = {
        "get": Operation(
            "Get this API's OpenAPI 3.0 document",
            "Needs no token.",
            auth="none",
            content={"application/json": None},
        )
    }

    async def get(self) -> None:
        document = self.settings.get("openapi_document")
        if document is None:
            document = build_document(self.settings["api_handlers"], self.settings["api_prefix"])
            self.settings["openapi_document"] = document
        self.write_json(document)


default_handlers = [
    ("/", RootHandler),
    ("/whoami", WhoAmIHandler),
    ("/limits", LimitsHandler),
    ("/openapi.json", OpenAPIHandler),
]
