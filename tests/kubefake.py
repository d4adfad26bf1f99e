"""A small Kubernetes API server, for tests of the Kubernetes backend (no cluster needed).

It speaks the real REST and watch protocol over HTTP, so that the real
``kubernetes_asyncio`` client (and KubeSpawner on it) can be pointed at it::

    kube = FakeKube()
    kube.add_node(gpu_node("gpu-0", gpus=8))
    async with serving(kube) as url:
        api = CoreV1Api(ApiClient(Configuration(host=url)))
        nodes = await api.list_node()

What it serves (core ``/api/v1`` only): nodes (cluster-wide) and namespaced
resources (pods, events, ...), each with list, get, create, delete, merge
patch and watch. Lists carry ``metadata.resourceVersion``; ``?watch=1`` answers
a chunked stream of ``{"type", "object"}`` lines from that version on (or the
current objects as ``ADDED`` without one), ending after ``timeoutSeconds``;
a version older than the last :meth:`FakeKube.compact` gets one ``ERROR``
event with a 410 ``Status``, as the API server does. Errors are ``Status``
objects (404, 409 on a create of an existing name).

Events: :meth:`FakeKube.pod_event` records a pod's event (scheduled, pulling
the image, ...) and :meth:`FakeKube.start_pod` runs a pod created while
``run_pods`` was false.

Faults, for the tests: :meth:`FakeKube.fail` answers the next matching
requests with a status (500, 409, ...) or holds them (a timeout);
:meth:`FakeKube.drop_watches` cuts every open watch stream;
:meth:`FakeKube.compact` expires old resource versions. Pods start
``Running`` with a pod IP and a ready ``notebook`` container unless
``FakeKube.run_pods`` is false.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from tornado import web
from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError
from tornado.netutil import bind_sockets

Key = tuple[str, str, str]  # (resource, namespace or "", name)

KINDS = {"nodes": "Node", "pods": "Pod", "events": "Event", "services": "Service"}


def _kind(resource: str) -> str:
    return KINDS.get(resource, resource[:-1].capitalize())


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` object, as the API server answers errors."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are treated the same)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def gpu_node(
    name: str,
    gpus: int = 8,
    *,
    product: str = "NVIDIA-H100-80GB-HBM3",
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    mig: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A node as the API shows it, with ``gpus`` allocatable ``nvidia.com/gpu``."""
    allocatable = {"cpu": "64", "memory": "512Gi"}
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    for profile, count in (mig or {}).items():
        allocatable[f"nvidia.com/mig-{profile}"] = str(count)
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product},
        },
        "spec": spec,
        "status": {
            "allocatable": allocatable,
            "capacity": dict(allocatable),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


@dataclass
class Fault:
    method: str
    path: re.Pattern
    status: int | None  # None: hold the request until the client gives up
    count: int


@dataclass
class FakeKube:
    """The cluster's objects, their history of changes, and the faults to inject."""

    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, Key, str, dict[str, Any]]] = field(default_factory=list)
    resource_version: int = 1
    oldest_version: int = 0
    run_pods: bool = True
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _drop: asyncio.Event = field(default_factory=asyncio.Event)

    # ---- objects ------------------------------------------------------------------

    def _record(self, key: Key, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.resource_version += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.resource_version)
        if kind == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((self.resource_version, key, kind, obj))
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return obj

    def create(self, resource: str, obj: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        key = (resource, namespace, meta["name"])
        if key in self.objects:
            raise KubeError(409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists')
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        obj.setdefault("kind", _kind(resource))
        obj.setdefault("apiVersion", "v1")
        if resource == "pods":
            obj["status"] = running_status(obj) if self.run_pods else {"phase": "Pending"}
        return self._record(key, "ADDED", obj)

    def add_node(self, node: dict[str, Any]) -> dict[str, Any]:
        return self.create("nodes", node)

    def get(self, resource: str, name: str, namespace: str = "") -> dict[str, Any]:
        try:
            return self.objects[(resource, namespace, name)]
        except KeyError:
            raise KubeError(404, "NotFound", f'{resource} "{name}" not found') from None

    def patch(
        self, resource: str, name: str, patch: dict[str, Any], namespace: str = ""
    ) -> dict[str, Any]:
        current = self.get(resource, name, namespace)
        return self._record((resource, namespace, name), "MODIFIED", merge_patch(current, patch))

    def delete(self, resource: str, name: str, namespace: str = "") -> dict[str, Any]:
        current = self.get(resource, name, namespace)
        return self._record((resource, namespace, name), "DELETED", current)

    def list(self, resource: str, namespace: str | None = None, selector: str = "") -> list[dict]:
        return [
            obj
            for (res, ns, _), obj in sorted(self.objects.items())
            if res == resource and (namespace is None or ns == namespace) and matches(obj, selector)
        ]

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.list("pods", namespace)

    def pod_event(
        self, pod: str, namespace: str, reason: str, message: str, type_: str = "Normal"
    ) -> dict[str, Any]:
        """Record an ``Event`` about ``pod``, as the scheduler or the kubelet does."""
        now = time.time()
        return self.create(
            "events",
            {
                "metadata": {"name": f"{pod}.{uuid.uuid4().hex[:16]}"},
                "involvedObject": {"kind": "Pod", "name": pod, "namespace": namespace},
                "reason": reason,
                "message": message,
                "type": type_,
                "count": 1,
                "source": {"component": "kubelet"},
                "firstTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "lastTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "eventTime": None,
            },
            namespace,
        )

    def start_pod(self, name: str, namespace: str) -> dict[str, Any]:
        """Run a pod created while ``run_pods`` was false (``Running``, ready)."""
        pod = self.get("pods", name, namespace)
        return self.patch("pods", name, {"status": running_status(pod)}, namespace)

    # ---- faults -------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int | None, count: int = 1) -> None:
        """Answer the next ``count`` requests ``method`` on a path matching the regular
        expression ``path`` with ``status`` (``None``: never answer, a timeout)."""
        self.faults.append(Fault(method.upper(), re.compile(path), status, count))

    def _fault(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.method == method and fault.path.search(path):
                fault.count -= 1
                if fault.count <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    def drop_watches(self) -> None:
        """Cut every open watch stream (as a restarting API server or proxy does)."""
        old, self._drop = self._drop, asyncio.Event()
        old.set()

    def compact(self) -> None:
        """Forget history: watches from any earlier resource version get 410 Gone."""
        self.oldest_version = self.resource_version
        self.history.clear()
        self.drop_watches()


class KubeError(Exception):
    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.status = status(code, reason, message)


def running_status(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod.get("spec", {}).get("containers") or [{"name": "notebook"}]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "hostIP": "10.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {
                "name": c["name"],
                "ready": True,
                "restartCount": 0,
                "image": c.get("image", ""),
                "imageID": "",
                "state": {"running": {"startedAt": now}},
            }
            for c in containers
        ],
    }


def matches(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c!=d,e``), as far as the tests need."""
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


# ---- HTTP --------------------------------------------------------------------------


class Handler(web.RequestHandler):
    kube: FakeKube

    def initialize(self, kube: FakeKube) -> None:
        self.kube = kube

    async def prepare(self) -> None:
        self.kube.requests.append((self.request.method, self.request.path))
        fault = self.kube._fault(self.request.method, self.request.uri)
        if fault is None:
            return
        if fault.status is None:
            await asyncio.Event().wait()  # held until the client gives up
        self._error(KubeError(fault.status, "InternalError", "injected fault").status)
        self.finish()

    def _error(self, body: dict[str, Any]) -> None:
        self.set_status(body["code"])
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(body))

    def _json(self, obj: Any, code: int = 200) -> None:
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(obj))

    def _resolve(self, path: str) -> tuple[str, str | None, str | None]:
        """(resource, namespace or None for all, name or None)."""
        parts = path.strip("/").split("/")
        namespace = None
        if parts[0] == "namespaces" and len(parts) >= 3:
            namespace, parts = parts[1], parts[2:]
        resource = parts[0]
        name = parts[1] if len(parts) > 1 else None
        if resource == "nodes":
            namespace = ""
        return resource, namespace, name

    async def get(self, path: str) -> None:
        resource, namespace, name = self._resolve(path)
        try:
            if name is not None:
                return self._json(self.kube.get(resource, name, namespace or ""))
            selector = self.get_argument("labelSelector", "")
            if self.get_argument("watch", "") in ("1", "true", "True"):
                return await self._watch(resource, namespace, selector)
            items = self.kube.list(resource, namespace, selector)
            self._json(
                {
                    "kind": f"{_kind(resource)}List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.kube.resource_version)},
                    "items": items,
                }
            )
        except KubeError as err:
            self._error(err.status)

    def post(self, path: str) -> None:
        resource, namespace, _ = self._resolve(path)
        try:
            obj = self.kube.create(resource, json.loads(self.request.body), namespace or "")
            self._json(obj, 201)
        except KubeError as err:
            self._error(err.status)

    def patch(self, path: str) -> None:
        resource, namespace, name = self._resolve(path)
        try:
            obj = self.kube.patch(
                resource, name or "", json.loads(self.request.body), namespace or ""
            )
            self._json(obj)
        except KubeError as err:
            self._error(err.status)

    def delete(self, path: str) -> None:
        resource, namespace, name = self._resolve(path)
        try:
            self._json(self.kube.delete(resource, name or "", namespace or ""))
        except KubeError as err:
            self._error(err.status)

    async def _watch(self, resource: str, namespace: str | None, selector: str) -> None:
        kube = self.kube
        since = self.get_argument("resourceVersion", "")
        timeout = float(self.get_argument("timeoutSeconds", "0") or 0)
        deadline = time.monotonic() + timeout if timeout else None
        self.set_header("Content-Type", "application/json")
        self.set_header("Transfer-Encoding", "chunked")
        dropped = kube._drop

        def wanted(key: Key, obj: dict[str, Any]) -> bool:
            return (
                key[0] == resource
                and (namespace is None or key[1] == namespace)
                and matches(obj, selector)
            )

        try:
            if since in ("", "0"):
                version = kube.resource_version
                for obj in kube.list(resource, namespace, selector):
                    await self._send({"type": "ADDED", "object": obj})
            else:
                version = int(since)
                if version < kube.oldest_version:
                    gone = status(410, "Expired", f"too old resource version: {version}")
                    await self._send({"type": "ERROR", "object": gone})
                    return
            while not dropped.is_set():
                for rv, key, kind, obj in list(kube.history):
                    if rv > version and wanted(key, obj):
                        await self._send({"type": kind, "object": obj})
                version = max(version, kube.resource_version)
                changed = kube._changed
                waits = [
                    asyncio.ensure_future(changed.wait()),
                    asyncio.ensure_future(dropped.wait()),
                ]
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    for w in waits:
                        w.cancel()
                    return
                _, pending = await asyncio.wait(
                    waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                for w in pending:
                    w.cancel()
            # Dropped: cut the connection without ending the chunked body cleanly.
            self.request.connection.stream.close()
        except StreamClosedError:
            pass

    async def _send(self, event: dict[str, Any]) -> None:
        self.write(json.dumps(event) + "\n")
        await self.flush()


def make_app(kube: FakeKube) -> web.Application:
    return web.Application([(r"/api/v1/(.*)", Handler, {"kube": kube})])


@asynccontextmanager
async def serving(kube: FakeKube) -> AsyncIterator[str]:
    """Serve ``kube`` on a free port of 127.0.0.1 in this event loop; yields its URL."""
    sockets = bind_sockets(0, "127.0.0.1")
    port = sockets[0].getsockname()[1]
    server = HTTPServer(make_app(kube))
    server.add_sockets(sockets)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        kube.drop_watches()
        server.stop()
        await server.close_all_connections()
