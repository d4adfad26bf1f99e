"""End to end: the budget- and queue-aware culler (``python -m spawner.culler``) as a
hub-managed service with only the scopes it needs, on a real hub (SPEC §7).

The hub runs the culler with a 1-hour limit while nobody waits and a 2-second
limit while requests wait: an idle session survives as long as the cluster is
quiet, and is stopped (its slice released, its GPUs granted to the waiting
request) once someone waits.
"""

from __future__ import annotations

import pytest
from hubfixtures import HubProcess, proxy_available, wait_until

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))

CULLER = ["--timeout=1h", "--busy-timeout=2s", "--over-share-timeout=2s", "--cull-every=0.5"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = HubProcess(tmp_path_factory.mktemp("culler-hub"), culler_args=CULLER)
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def sweeps(hub) -> int:
    """Culler sweeps so far, from the hub's access log (the hub hides query values)."""
    return hub.log_text().count("GET /hub/api/users?state=[secret] (slicebroker-culler")


def test_an_idle_session_is_culled_once_others_wait_and_its_slice_is_released(hub):
    hub.start_server("alice", project="vision", gpus=2, protected="15m")
    hub.wait_ready("alice")
    held = hub.slice_of("alice")
    # While nobody waits, sweeps pass over the idle session.
    seen = sweeps(hub)
    wait_until(lambda: sweeps(hub) >= seen + 3, 30, "three culler sweeps")
    assert hub.server("alice")["ready"]

    hub.start_server("carol", project="nlp", gpus=2, protected="15m")
    wait_until(lambda: hub.server("alice") is None, 30, "the culler to stop alice's server")
    hub.wait_ready("carol")
    released = hub.broker("GET", f"/slices/{held['id']}")

    assert released["state"] == "ended" and released["end_reason"] == "released"
    assert released["charged_gpu_seconds"] == pytest.approx(
        2 * (released["ended_at"] - released["granted_at"]), abs=1e-6
    )
    assert hub.slice_of("carol")["state"] == "granted"
    assert "culling alice: idle" in hub.log_text()
    assert "1 waiting, project vision" in hub.log_text()
    hub.stop_server("carol")
