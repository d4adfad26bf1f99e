"""The Kubernetes backend: notebook servers as pods on the granted node (design.md §7, §9).

:class:`KubeSliceBrokerSpawner` is KubeSpawner (as in zero-to-jupyterhub)
behind :class:`~spawner.mixin.SliceBrokerMixin`: it gets a slice first, then
KubeSpawner creates the pod, changed as follows (:meth:`slice_pod`):

- pinned to the granted node: ``nodeSelector`` ``kubernetes.io/hostname`` (the
  broker's node names are the Kubernetes node names; a MIG part
  ``<node>:<profile>`` runs on ``<node>``, see :mod:`broker.kube.inventory`);
- GPU limits (and requests) set to the grant: ``nvidia.com/gpu: <n>``, or
  ``nvidia.com/mig-<profile>: <n>`` for a MIG part; any other GPU resource a
  profile asked for is removed, so a pod never holds GPUs the broker did not grant;
- labelled with the slice id and project (``slicebroker.io/slice-id``,
  ``slicebroker.io/project``), so that an operator (and a cleanup) finds them.

``profile_list`` keeps working: KubeSpawner's ``options_form`` and
``options_from_form`` stay its own, and the mixin adds to them (its
``get_options_form()``, ``run_options_from_form()``): the form shows the profiles
above the slice form, and both sets of options are kept (KubeSpawner applies the
profile's overrides in ``start()``, after the grant; the slice's GPUs win).

The progress page shows the broker's events (queue position, the grant), then
KubeSpawner's own: the pod's events (scheduling, image pulls, start).

The spawner adds to KubeSpawner through its public interface: the
``get_pod_manifest()`` method (the pod is changed after KubeSpawner and its
profile overrides built it, so the grant wins over a profile's
``node_selector`` or ``extra_resource_limits``; ``modify_pod_hook`` stays the
admin's), ``progress()``, and the values of its ``options_form`` and
``options_from_form`` traits, read through JupyterHub's ``get_options_form()`` and
``run_options_from_form()``. The version of KubeSpawner is bounded above in the
package's extras.

The mixin does the rest: on preemption the server (the pod) is stopped after
the grace period, and ``poll()`` sees a pod that vanished (evicted, deleted by
hand) as stopped and releases its slice at once. The device plugin only counts
GPUs; which device a pod gets is its choice, so the broker's GPU indices on a
node are bookkeeping (their count is exact).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubespawner import KubeSpawner
from traitlets import Bool, Unicode

from broker.kube.inventory import GPU_RESOURCE, MIG_PREFIX, gpu_resource, kube_node_name
from broker.kube.reaper import SLICE_LABEL

from .lifecycle import Phase
from .mixin import SliceBrokerMixin

PROJECT_LABEL = "slicebroker.io/project"


def _label_value(value: Any) -> str:
    """A string that is a valid label value (63 characters of ``[A-Za-z0-9._-]``)."""
    text = "".join(c if c.isalnum() or c in "._-" else "-" for c in str(value))[:63]
    return text.strip("._-")


class KubeSliceBrokerSpawner(SliceBrokerMixin, KubeSpawner):
    """A pod on the granted node with the granted GPUs."""

    node_label = Unicode(
        "kubernetes.io/hostname",
        help="""The node label the pod is pinned with (its value: the Kubernetes node
        name of the grant). Set it to another label only if node names and that
        label's values differ in your cluster.""",
    ).tag(config=True)

    set_gpu_requests = Bool(
        True,
        help="""Also set the GPU resource's requests (Kubernetes needs requests equal to
        limits for extended resources; turning this off leaves requests to the
        defaults, which then equal the limits).""",
    ).tag(config=True)

    # ---- the pod ---------------------------------------------------------------------

    def placement_problem(self, slice_: Mapping[str, Any]) -> str | None:
        placements = slice_.get("placements") or []
        if len(placements) != 1:
            return f"a session needs its GPUs on one node; the broker placed it on {placements}"
        return None

    async def stop(self, now: bool = False) -> None:
        """Stop the pod and release the slice; while starting, only delete the pod.

        KubeSpawner calls ``stop()`` from inside its own ``start()`` to delete a
        stale pod of the same name (a 409 on create, e.g. after a hub crash);
        that must not release the slice being launched on.
        """
        if self.lifecycle.phase is Phase.LAUNCHING:
            await KubeSpawner.stop(self, now=now)
            return
        await super().stop(now=now)

    async def get_pod_manifest(self) -> Any:
        pod = await super().get_pod_manifest()
        return self.slice_pod(pod)

    def slice_pod(self, pod: Any) -> Any:
        """Pin ``pod`` (a ``V1Pod``) to the slice's node with its GPUs and labels."""
        s = self.slice or {}
        placements = s.get("placements") or []
        if not placements:
            return pod
        node = placements[0]["node"]
        count = len(placements[0]["gpu_indices"])
        resource = gpu_resource(node)
        spec = pod.spec
        spec.node_selector = {**(spec.node_selector or {}), self.node_label: kube_node_name(node)}
        container = spec.containers[0]
        if container.resources is None:
            from kubernetes_asyncio.client.models import V1ResourceRequirements

            container.resources = V1ResourceRequirements()
        limits = _without_gpus(container.resources.limits)
        limits[resource] = str(count)
        container.resources.limits = limits
        requests = _without_gpus(container.resources.requests)
        if self.set_gpu_requests:
            requests[resource] = str(count)
        container.resources.requests = requests or None
        labels = dict(pod.metadata.labels or {})
        labels[SLICE_LABEL] = str(s.get("id"))
        labels[PROJECT_LABEL] = _label_value(s.get("project") or "")
        pod.metadata.labels = labels
        return pod


def _without_gpus(resources: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        k: v
        for k, v in (resources or {}).items()
        if k != GPU_RESOURCE and not k.startswith(MIG_PREFIX)
    }


__all__ = ["PROJECT_LABEL", "SLICE_LABEL", "KubeSliceBrokerSpawner"]
