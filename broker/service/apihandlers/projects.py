"""Projects: the fair-share tree, usage reports, and admin changes (design.md §4, §8)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from ...core.accounting import usage_csv
from ...errors import Forbidden, InvalidRequest, NotFound
from ..schema import NAME_TEXT
from .base import NAME_PARAM, NEW_NAME_PARAM, APIHandler, Operation, Param
from .common import is_member


class ProjectListHandler(APIHandler):
    operations = {
        "get": Operation(
            "Show the project tree",
            "Parents before children, siblings in fair-share order (most under-served "
            "first), each with its share, entitlement, window usage, fair-share value "
            "(share used: its part of all usage over its entitlement), rank among projects, "
            "members and queue.",
            content={"application/json": "ProjectList"},
        ),
        "put": Operation(
            "Replace the project tree",
            "Admins only. Makes the tree and its members those given (what "
            "`slicebroker apply-config FILE` sends from the cluster file) and answers "
            "each account added, removed or changed, before and after; `dry_run=true` "
            "only answers them. Each change is recorded as a project event. Refused "
            "(409) when a project with live slices would be removed or get sub-accounts.",
            auth="admin",
            parameters=(Param("dry_run", "query", {"type": "boolean"}, "only show the changes"),),
            body="ProjectTree",
            content={"application/json": "ProjectChangeList"},
            errors=(400, 409),
        ),
    }

    async def get(self) -> None:
        projects = await self.runner.read_between_passes(self.broker.projects)
        self.write_json({"projects": projects})

    async def put(self) -> None:
        body = self.body()
        dry_run = bool(self.params().get("dry_run", False))
        who = self.identity.name

        def apply() -> dict[str, Any]:
            changes = self.broker.apply_tree(body["projects"], who=who, dry_run=dry_run)
            return {"changes": changes, "applied": not dry_run}

        if dry_run:
            self.write_json(await self.runner.read(apply))
        else:
            changed = await self.runner.change(apply)
            await self.runner.know_projects()
            self.write_json(changed)


class ProjectEventsHandler(APIHandler):
    operations = {
        "get": Operation(
            "List the changes of the project tree",
            "Admins only. Every change of an account or its members, oldest first: who "
            "made it (an admin, or the cluster file that seeded the tree on the first "
            "start), when, and the account before and after.",
            auth="admin",
            parameters=(Param("project", "query", NAME_TEXT, "only this account's changes"),),
            content={"application/json": "ProjectEventList"},
        )
    }

    async def get(self) -> None:
        project = self.params().get("project")
        events = await self.runner.read(self.broker.project_events, project)
        self.write_json({"events": events})


class ProjectHandler(APIHandler):
    operations = {
        "put": Operation(
            "Create or change an account",
            "Admins only. Sets the share and parent; `users`/`groups` replace the members "
            "when given. The new tree is checked before anything changes. The change is "
            "kept in the database (a restart keeps it) and recorded as a project event.",
            auth="admin",
            parameters=(NEW_NAME_PARAM,),
            body="ProjectUpdate",
            content={"application/json": "Project"},
            errors=(400, 409),
        ),
        "delete": Operation(
            "Delete an account",
            "Admins only. Deletes the account and its members; its slices and charges "
            "stay in the history. Refused (409) while it has sub-accounts or live "
            "slices. Answers the project event recording it.",
            auth="admin",
            parameters=(NAME_PARAM,),
            content={"application/json": "ProjectEvent"},
            errors=(404, 409),
        ),
    }

    async def delete(self, name: str) -> None:
        name = self.path_param("name", name)
        event = await self.runner.change(self.broker.delete_project, name, who=self.identity.name)
        self.write_json(event)

    async def put(self, name: str) -> None:
        name = self.path_param("name", name)
        project = await put_project(self.runner, name, self.body(), self.identity.name)
        self.write_json(project)


async def put_project(runner: Any, name: str, body: dict[str, Any], who: str) -> dict[str, Any]:
    """Create or change account ``name`` as a checked ``ProjectUpdate`` body says, as
    ``who``: ``PUT /projects/{name}`` and the pages' project form."""
    project = await runner.change(
        runner.broker.put_project,
        name,
        share=body["share"],
        parent=body.get("parent"),
        users=body.get("users"),
        groups=body.get("groups"),
        who=who,
    )
    await runner.know_projects()
    return project


TIME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 64}
USAGE_COLUMNS = ("project", "user", "since", "until", "slices", "gpu_seconds")


class ProjectUsageHandler(APIHandler):
    operations = {
        "get": Operation(
            "Report a project's charged usage",
            "Weighted and plain GPU-seconds charged to the account (with its "
            "sub-accounts) in [since, until), per user or per project; running slices "
            "count up to now. Members of the project, agents and admins may read it.",
            parameters=(
                NAME_PARAM,
                Param(
                    "since",
                    "query",
                    TIME_SCHEMA,
                    "start: epoch seconds or ISO 8601 (default: the lookback window ago)",
                ),
                Param(
                    "until",
                    "query",
                    TIME_SCHEMA,
                    "end: epoch seconds or ISO 8601 (default: now)",
                ),
                Param("by", "query", {"type": "string", "enum": ["user", "project"]}, "rows per"),
                Param(
                    "format",
                    "query",
                    {"type": "string", "enum": ["json", "csv"]},
                    "json (default) or csv",
                ),
            ),
            content={"application/json": "UsageReport", "text/csv": None},
            errors=(400, 404),
        )
    }

    async def get(self, name: str) -> None:
        name = self.path_param("name", name)
        params = self.params()
        since = _time(params, "since")
        until = _time(params, "until")
        if since is not None and until is not None and since > until:
            raise InvalidRequest("since must not be after until")
        by = params.get("by", "user")
        if not self.identity.acts_for_others:
            await self._check_member(name)
        rows = await self.runner.read(self.broker.usage_report, name, since, until, by=by)
        if params.get("format", "json") == "csv":
            self.set_header("Content-Type", "text/csv; charset=UTF-8")
            self.finish(_csv(rows, by))
            return
        self.write_json({"project": name, "by": by, "usage": rows})

    async def _check_member(self, name: str) -> None:
        projects = await self.runner.read_between_passes(self.broker.projects)
        project = next((p for p in projects if p["name"] == name), None)
        if project is None:
            raise NotFound(f"no project {name!r}")
        if not (project["is_project"] and is_member(self.identity, project)):
            raise Forbidden(f"only members of {name!r}, agents and admins may read its usage")


def _time(params: dict[str, Any], key: str) -> float | None:
    """Epoch seconds from a parameter in epoch seconds or ISO 8601 (UTC when naive)."""
    text = params.get(key)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise InvalidRequest(
                f"{key} must be epoch seconds or an ISO 8601 time, got {text!r}"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        try:
            value = moment.timestamp()
        except (OverflowError, OSError, ValueError):
            raise InvalidRequest(f"{key} is out of range: {text!r}") from None
    if not math.isfinite(value):
        raise InvalidRequest(f"{key} must be finite, got {text!r}")
    return value


def _csv(rows: list[dict[str, Any]], by: str) -> str:
    columns = [c for c in USAGE_COLUMNS if by == "user" or c != "user"]
    columns.append("weighted_gpu_seconds")
    return usage_csv(rows, columns)


default_handlers = [
    ("/projects", ProjectListHandler),
    # Before /projects/{name}: "events" names this list, not an account.
    ("/projects/events", ProjectEventsHandler),
    ("/projects/{name}", ProjectHandler),
    ("/projects/{name}/usage", ProjectUsageHandler),
]
