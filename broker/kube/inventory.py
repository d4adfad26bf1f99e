"""GPU inventory from the Kubernetes nodes (design.md §6, §9).

:func:`nodes_from_kube` maps one node object (the API's JSON) to broker
:class:`~broker.core.model.Node` values — a pure function, tested on tables:

- whole GPUs: allocatable ``nvidia.com/gpu`` gives a broker node of the same
  name, its GPU type read from the node's labels (``nvidia.com/gpu.product``,
  as GPU feature discovery sets it, e.g. ``NVIDIA-H100-80GB-HBM3`` -> ``h100``;
  :attr:`InventoryRules.gpu_types` maps products to types explicitly);
- MIG devices (the device plugin's *mixed* strategy): each allocatable
  ``nvidia.com/mig-<profile>`` gives a broker node ``<node>:<profile>`` of GPU
  type ``<type>-<profile>`` (e.g. ``gpu-3:1g.10gb``, ``h100-1g.10gb``);
  :func:`kube_node_name` and :func:`gpu_resource` map back;
- state: a node whose ``Ready`` condition is not ``True`` is ``down``; a
  cordoned node (``spec.unschedulable``) or one with a ``NoSchedule`` or
  ``NoExecute`` taint (other than the keys in
  :attr:`InventoryRules.ignored_taints`, such as the ``nvidia.com/gpu`` taint
  that keeps CPU pods off GPU nodes) is ``draining``; any other is ``ready``.
  A node without GPUs is no broker node.

:class:`InventoryWatcher` keeps a sink (:meth:`broker.store.Broker.sync_inventory`)
current: it lists the nodes, then watches from the list's resource version;
on ``410 Gone`` it lists again; on API errors, timeouts and dropped streams it
backs off and starts over. It pushes the whole inventory after every list and
after every event that changes it.

:class:`KubernetesInventory` is the broker service's inventory backend
(``--BrokerApp.inventory_class=kubernetes``): the watcher, the drain reports and
the cleanup of pods of ended slices, configured by its own traits.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traitlets import Bool, Float, TraitError, Unicode, validate

from broker.core.model import Node, NodeState
from broker.inventory import Inventory, InventoryError
from broker.rounds import Backoff
from broker.traits import seconds_above_zero, seconds_not_negative

if TYPE_CHECKING:
    from .service import KubernetesTasks

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
#: Separates a Kubernetes node's name from a MIG profile in a broker node's name.
MIG_SEPARATOR = ":"

_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
#: A Kubernetes namespace name (an RFC 1123 label).
NAMESPACE_PATTERN = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


@dataclass(frozen=True)
class InventoryRules:
    """How node objects become broker nodes; every field has a default that suits the
    NVIDIA GPU operator."""

    #: Node labels naming the GPU model, the first present wins.
    product_labels: tuple[str, ...] = ("nvidia.com/gpu.product",)
    #: Product label value -> broker GPU type; products not listed are shortened
    #: (``NVIDIA-H100-80GB-HBM3`` -> ``h100``).
    gpu_types: Mapping[str, str] = field(default_factory=dict)
    #: GPU type of a node without a product label.
    default_gpu_type: str = "gpu"
    #: Taint keys that do not drain a node (taints every GPU node carries on purpose).
    ignored_taints: tuple[str, ...] = ("nvidia.com/gpu",)
    #: Whether MIG resources become broker nodes of their own.
    mig: bool = True


def gpu_type_of(product: str | None, rules: InventoryRules) -> str:
    """The broker GPU type for a product label value."""
    if not product:
        return rules.default_gpu_type
    if product in rules.gpu_types:
        return rules.gpu_types[product]
    base, _, mig = product.partition("-MIG-")
    words = [w for w in base.lower().split("-") if w and w not in _VENDOR_WORDS]
    name = words[0] if words else rules.default_gpu_type
    return f"{name}-{mig.lower()}" if mig else name


def node_state(obj: Mapping[str, Any], rules: InventoryRules) -> NodeState:
    """``down`` unless Ready; ``draining`` if cordoned or tainted NoSchedule/NoExecute."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return NodeState.DOWN
    spec = obj.get("spec") or {}
    if spec.get("unschedulable"):
        return NodeState.DRAINING
    for taint in spec.get("taints") or ():
        if taint.get("effect") in ("NoSchedule", "NoExecute") and (
            taint.get("key") not in rules.ignored_taints
        ):
            return NodeState.DRAINING
    return NodeState.READY


def _count(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def nodes_from_kube(obj: Mapping[str, Any], rules: InventoryRules | None = None) -> list[Node]:
    """The broker nodes of one Kubernetes node object (none for a node without GPUs)."""
    rules = rules or InventoryRules()
    meta = obj.get("metadata") or {}
    name = meta["name"]
    labels = meta.get("labels") or {}
    allocatable = (obj.get("status") or {}).get("allocatable") or {}
    product = next((labels[k] for k in rules.product_labels if labels.get(k)), None)
    gpu_type = gpu_type_of(product, rules)
    state = node_state(obj, rules)
    nodes = []
    whole = _count(allocatable.get(GPU_RESOURCE, 0))
    if whole > 0:
        nodes.append(Node(name, gpu_type, whole, state))
    if rules.mig:
        base = gpu_type.split("-", 1)[0]
        for resource in sorted(allocatable):
            if resource.startswith(MIG_PREFIX):
                count = _count(allocatable[resource])
                profile = resource[len(MIG_PREFIX) :]
                if count > 0:
                    nodes.append(
                        Node(f"{name}{MIG_SEPARATOR}{profile}", f"{base}-{profile}", count, state)
                    )
    return nodes


def inventory(objs: Iterable[Mapping[str, Any]], rules: InventoryRules | None = None) -> list[Node]:
    """The broker nodes of many node objects, sorted by name."""
    return sorted((n for obj in objs for n in nodes_from_kube(obj, rules)), key=lambda n: n.name)


def kube_node_name(broker_node: str) -> str:
    """The Kubernetes node a broker node lives on."""
    return broker_node.split(MIG_SEPARATOR, 1)[0]


def gpu_resource(broker_node: str) -> str:
    """The extended resource a pod requests for GPUs of ``broker_node``."""
    _, sep, profile = broker_node.partition(MIG_SEPARATOR)
    return f"{MIG_PREFIX}{profile}" if sep else GPU_RESOURCE


# ---- the watch ----------------------------------------------------------------------

Sink = Callable[[list[Node]], Awaitable[None] | None]


class InventoryWatcher:
    """Lists and watches the Kubernetes nodes and pushes broker nodes into ``sink``.

    ``api`` is a ``kubernetes_asyncio`` ``CoreV1Api``. ``sink`` takes the whole
    inventory (a list of :class:`~broker.core.model.Node`) and may be a coroutine
    function; in the broker service it is ``Broker.sync_inventory`` run in an
    executor. ``label_selector`` limits the nodes listed (e.g.
    ``nvidia.com/gpu.present=true``). ``watch_timeout`` (seconds) is how long one
    watch request lasts before it is renewed from the last version seen.
    """

    def __init__(
        self,
        api: Any,
        sink: Sink,
        rules: InventoryRules | None = None,
        *,
        label_selector: str = "",
        watch_timeout: float = 300.0,
        request_timeout: float = 30.0,
        backoff: Backoff | None = None,
    ):
        self.api = api
        self.sink = sink
        self.rules = rules or InventoryRules()
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.backoff = backoff or Backoff()
        #: Kubernetes node name -> its broker nodes, as last seen.
        self.objects: dict[str, list[Node]] = {}
        self.resource_version: str | None = None
        self.pushed: list[Node] | None = None
        #: Counters, for tests and metrics.
        self.lists = 0
        self.pushes = 0
        self.errors = 0
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True

    async def run(self) -> None:
        """List and watch until :meth:`stop` or cancellation; never raises otherwise."""
        from kubernetes_asyncio.client.exceptions import ApiException

        while not self._stopped:
            try:
                if self.resource_version is None:
                    await self.relist()
                await self.watch_once()
                self.backoff.reset()
            except asyncio.CancelledError:
                raise
            except ApiException as err:
                if err.status == 410:
                    log.info("Node watch expired (410 Gone); listing again")
                    self.resource_version = None
                    continue
                await self._failed(f"API error {err.status} {err.reason}")
            except Exception as err:
                await self._failed(f"{type(err).__name__}: {err}")

    async def _failed(self, why: str) -> None:
        self.errors += 1
        self.resource_version = None  # start over with a list: events may be lost
        pause = self.backoff.next()
        log.warning("Node inventory from Kubernetes failed (%s); retrying in %.1fs", why, pause)
        await asyncio.sleep(pause)

    async def relist(self) -> list[Node]:
        """List every node and push the inventory; the watch resumes from here."""
        reply = await self.api.list_node(
            label_selector=self.label_selector, _request_timeout=self.request_timeout
        )
        client = self.api.api_client
        self.objects = {
            item.metadata.name: nodes_from_kube(client.sanitize_for_serialization(item), self.rules)
            for item in reply.items
        }
        self.lists += 1
        nodes = self.current()
        await self._push(nodes, force=True)
        self.resource_version = reply.metadata.resource_version
        return nodes

    async def watch_once(self) -> None:
        """One watch request from :attr:`resource_version`, until the server ends it."""
        from kubernetes_asyncio import watch

        stream = watch.Watch()
        try:
            events = stream.stream(
                self.api.list_node,
                label_selector=self.label_selector,
                resource_version=self.resource_version,
                timeout_seconds=max(1, int(self.watch_timeout)),
                allow_watch_bookmarks=True,
                _request_timeout=self.watch_timeout + self.request_timeout,
            )
            async for event in events:
                if self._stopped:
                    break
                kind, raw = event["type"], event["raw_object"]
                version = (raw.get("metadata") or {}).get("resourceVersion")
                if kind == "BOOKMARK":
                    self.resource_version = version or self.resource_version
                    continue
                name = raw["metadata"]["name"]
                if kind == "DELETED":
                    self.objects.pop(name, None)
                else:
                    self.objects[name] = nodes_from_kube(raw, self.rules)
                await self._push(self.current())
                self.resource_version = version or self.resource_version
        finally:
            await stream.close()

    def current(self) -> list[Node]:
        return sorted((n for nodes in self.objects.values() for n in nodes), key=lambda n: n.name)

    async def _push(self, nodes: list[Node], *, force: bool = False) -> None:
        if not force and nodes == self.pushed:
            return
        result = self.sink(nodes)
        if inspect.isawaitable(result):
            await result
        self.pushed = nodes
        self.pushes += 1


# ---- the service's inventory backend --------------------------------------------------


class KubernetesInventory(Inventory):
    """Nodes from the Kubernetes API, kept current with a watch; drained nodes labelled
    for repair automation; pods of ended slices deleted.

    GPU nodes, cordons, taints and NotReady map to node states as
    docs/kubernetes.md says; the cluster file still gives projects, members,
    weights and policy, and its own ``[[nodes]]`` go ``down``. Needs the
    ``kubernetes`` extra and RBAC to list and watch nodes (``patch`` them with a
    ``drained_label``; list and delete pods in ``pod_namespace``).
    """

    watch_nodes = Bool(
        True,
        help="""Take the nodes from the Kubernetes API (default: yes). No: the nodes are
        the cluster file's, and only the pod cleanup (`pod_namespace`) runs, for
        notebooks on Kubernetes with a declared inventory.
        """,
    ).tag(config=True)

    api_url = Unicode(
        "",
        help="""The Kubernetes API server's URL, used without credentials (e.g. a
        `kubectl proxy`). Default: empty, the pod's service account inside a
        cluster, else the local kubeconfig.
        """,
    ).tag(config=True)

    node_selector = Unicode(
        "",
        help="""A label selector limiting the nodes taken from Kubernetes, e.g.
        `nvidia.com/gpu.present=true` (default: empty, every node; nodes
        without GPUs are left out anyway).
        """,
    ).tag(config=True)

    drained_label = Unicode(
        "slicebroker.io/drained",
        help="""The label (value `true`) put on a Kubernetes node once the broker
        has drained it, so repair automation can proceed; removed when the node
        is back. Empty: no label is written (and no `patch` on nodes is needed).
        """,
    ).tag(config=True)

    report_interval = Float(
        30.0,
        help="""Seconds between two checks for drained nodes to label (default 30).""",
    ).tag(config=True)

    pod_namespace = Unicode(
        "",
        help="""The Kubernetes namespace of the notebook pods (zero-to-jupyterhub: the
        hub's). Pods there labelled `slicebroker.io/slice-id` whose slice has ended
        are deleted: the safety net for a pod the spawner could not stop (hub down,
        state lost, a failed stop). Default: empty, no pod is ever deleted. Needs
        RBAC to list and delete pods in the namespace.
        """,
    ).tag(config=True)

    reap_interval = Float(
        60.0,
        help="""Seconds between two rounds of deleting pods of ended slices (default 60).""",
    ).tag(config=True)

    reap_min_age = Float(
        120.0,
        help="""Seconds a pod must have existed before it may be deleted as the pod of an
        ended slice (default 120), so that a pod being created is never raced.
        """,
    ).tag(config=True)

    @validate("pod_namespace")
    def _check_namespace(self, proposal):
        if proposal.value and not re.fullmatch(NAMESPACE_PATTERN, proposal.value):
            raise TraitError(
                f"pod_namespace must be a Kubernetes namespace name (lower-case letters, "
                f"digits and '-', at most 63), got {proposal.value!r}"
            )
        return proposal.value

    _check_positive = validate("report_interval", "reap_interval")(seconds_above_zero)
    _check_not_negative = validate("reap_min_age")(seconds_not_negative)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tasks: KubernetesTasks | None = None

    async def setup(self, runner: Any) -> None:
        """Make the client and the tasks, not started yet: importing the Kubernetes
        client takes about a second, during which a listening server would leave
        requests unanswered."""
        if not (self.watch_nodes or self.pod_namespace):
            return
        try:
            from .service import KubernetesTasks, core_api

            api = await core_api(self.api_url)
        except Exception as err:  # the extra not installed, no kubeconfig nor service account
            raise InventoryError(f"cannot set up the Kubernetes client: {err}") from None
        self.tasks = KubernetesTasks(
            runner,
            api,
            inventory=self.watch_nodes,
            node_selector=self.node_selector,
            drained_label=self.drained_label,
            report_interval=self.report_interval,
            pod_namespace=self.pod_namespace,
            reap_interval=self.reap_interval,
            reap_min_age=self.reap_min_age,
        )

    def start(self) -> None:
        if self.tasks is not None:
            self.tasks.start()

    async def stop(self) -> None:
        if self.tasks is not None:
            await self.tasks.stop()

    def describe(self) -> str:
        parts = [
            f"nodes from Kubernetes (selector {self.node_selector!r})"
            if self.watch_nodes
            else "nodes from the cluster file"
        ]
        if self.pod_namespace:
            parts.append(
                f"deleting pods of ended slices in namespace {self.pod_namespace} "
                f"every {self.reap_interval:g} s"
            )
        return "; ".join(parts)


__all__ = [
    "GPU_RESOURCE",
    "MIG_PREFIX",
    "NAMESPACE_PATTERN",
    "Backoff",
    "InventoryRules",
    "InventoryWatcher",
    "KubernetesInventory",
    "gpu_resource",
    "gpu_type_of",
    "inventory",
    "kube_node_name",
    "node_state",
    "nodes_from_kube",
]
