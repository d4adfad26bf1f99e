"""Clean up notebook pods whose slice is over (design.md §7: no GPU stays held by a dead session).

The spawner stops a pod when its slice ends; this is the safety net for when it
cannot (the hub was down, its state was lost, a stop failed): :class:`PodReaper`
lists the pods labelled with a slice id (``slicebroker.io/slice-id``, set by
:class:`spawner.kube.KubeSliceBrokerSpawner`) and deletes those whose slice is
no longer live in the broker. A pod younger than ``min_age`` is left alone, so
that a pod created for a slice granted a moment ago is never raced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from ..rounds import Backoff

log = logging.getLogger(__name__)

SLICE_LABEL = "slicebroker.io/slice-id"

LiveSlices = Callable[[], Awaitable[set[int]]]


class PodReaper:
    """Deletes pods of ended slices in ``namespace``.

    ``api`` is a ``kubernetes_asyncio`` ``CoreV1Api`` (pods: ``list``,
    ``delete``); ``live_slices`` an async callable returning the ids of the
    broker's live slices (pending, granted, preempting). ``min_age`` and
    ``interval`` are seconds.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        live_slices: LiveSlices,
        *,
        min_age: float = 120.0,
        interval: float = 60.0,
        request_timeout: float = 30.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.api = api
        self.namespace = namespace
        self.live_slices = live_slices
        self.min_age = min_age
        self.interval = interval
        self.request_timeout = request_timeout
        self.backoff = backoff or Backoff()
        self.clock = clock or (lambda: datetime.now(UTC).timestamp())
        self.deleted = 0

    async def reap_once(self) -> list[str]:
        """One round; returns the pods deleted. A failed delete is retried next round."""
        from kubernetes_asyncio.client.exceptions import ApiException

        reply = await self.api.list_namespaced_pod(
            self.namespace, label_selector=SLICE_LABEL, _request_timeout=self.request_timeout
        )
        live = await self.live_slices()
        now = self.clock()
        deleted = []
        for pod in reply.items:
            meta = pod.metadata
            try:
                slice_id = int((meta.labels or {}).get(SLICE_LABEL, ""))
            except ValueError:
                continue
            created = meta.creation_timestamp
            if slice_id in live or (created and now - created.timestamp() < self.min_age):
                continue
            try:
                await self.api.delete_namespaced_pod(
                    meta.name, self.namespace, _request_timeout=self.request_timeout
                )
            except ApiException as err:
                if err.status != 404:
                    log.warning("Deleting pod %s failed (%s %s)", meta.name, err.status, err.reason)
                continue
            log.info("Deleted pod %s: its slice %s is over", meta.name, slice_id)
            deleted.append(meta.name)
        self.deleted += len(deleted)
        return deleted

    async def run(self) -> None:
        """Rounds every :attr:`interval` seconds until cancelled; errors back off."""
        while True:
            pause = self.interval
            try:
                await self.reap_once()
                self.backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                pause = self.backoff.next()
                log.warning("Pod cleanup failed (%s); retrying in %.1fs", err, pause)
            await asyncio.sleep(pause)


__all__ = ["SLICE_LABEL", "PodReaper"]
