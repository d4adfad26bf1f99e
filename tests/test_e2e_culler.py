"""End to end: culling keeps its word, on a real hub (design.md §3 idleness, §7).

The spawner checks its session every half second against short limits: a
protected session idle for 3 s is stopped only while a waiting request could
use its GPUs. While the only node drains, the waiting request cannot run, so
the idle session is kept however long it idles; once the node takes work
again, the session is stopped, the user is told why (``culled_idle``), and the
waiting request gets the GPUs.

bob's sessions run the real ``jupyterhub-singleuser`` with the Lab extension, whose
GPUs a stand-in ``nvidia-smi`` reports: while they are busy the session is active
however old the hub's own activity, and once they idle it is stopped.
"""

from __future__ import annotations

import re

import pytest
from gpustandin import StandinGpus
from hubfixtures import HubProcess, proxy_available, wait_until

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))

LIMITS = """
c.SliceBrokerMixin.cull_idle_protected = "3s"
c.SliceBrokerMixin.cull_idle_busy = "2s"
c.SliceBrokerMixin.cull_idle_timeout = "1h"
c.SliceBrokerMixin.cull_interval = 0.5
c.Spawner.group_overrides = {{
    "gpu": {{
        "groups": ["real-singleuser"],
        "spawner_override": {{
            "cmd": ["jupyterhub-singleuser"],
            "args": [
                "--ServerApp.allow_root=True",
                "--SliceBrokerLab.nvidia_smi={nvidia_smi}",
                "--SliceBrokerLab.gpu_sample_interval=0.2",
                "--SliceBrokerLab.use_nvml=False",
            ],
        }},
    }}
}}
c.JupyterHub.load_groups["real-singleuser"] = {{"users": ["bob"]}}
"""


@pytest.fixture(scope="module")
def gpus(tmp_path_factory) -> StandinGpus:
    return StandinGpus(tmp_path_factory.mktemp("gpus"), count=2)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gpus):
    config = LIMITS.format(nvidia_smi=gpus.program)
    hub = HubProcess(tmp_path_factory.mktemp("culler-hub"), extra_config=config)
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def idle_checks(hub: HubProcess, name: str) -> list[tuple[int, str]]:
    """(idle seconds, waiting request or "") of each idle check of ``name``'s session so far."""
    return [(idle, waiter) for idle, waiter, _ in idle_reads(hub, name)]


def idle_reads(hub: HubProcess, name: str) -> list[tuple[int, str, str]]:
    """(idle seconds, waiting request or "", where the idleness was read) of each idle
    check of ``name``'s session so far."""
    return [
        (int(idle), waiter, source)
        for idle, waiter, source in re.findall(
            rf"Idle check of {name}: idle (\d+) s, limit \S+ s, "
            r"(?:waiting request (\d+) could use its GPUs|no waiting request could use its GPUs)"
            r" \(idleness from (the session|the hub)\)",
            hub.log_text(),
        )
    ]


def test_a_protected_idle_session_is_culled_only_when_a_waiting_request_could_use_it(hub):
    hub.start_server("alice", project="vision", gpus=2, protected="15m")
    hub.wait_ready("alice")
    held = hub.slice_of("alice")
    hub.broker("POST", "/nodes/test-0/drain", json={"reason": "maintenance"})

    # The only node drains: carol's request cannot run, whoever stops.
    hub.start_server("carol", project="nlp", gpus=2, protected="15m")
    waiting = wait_until(lambda: hub.slice_of("carol"), 30, "carol's request")
    assert waiting["state"] == "pending"
    wait_until(
        lambda: sum(idle >= 5 for idle, _ in idle_checks(hub, "alice")) >= 3,
        60,
        "three idle checks of alice past the limit",
    )
    assert hub.server("alice")["ready"]
    assert all(waiter == "" for _, waiter in idle_checks(hub, "alice"))

    # The node takes work again: carol's request could use alice's GPUs now.
    hub.broker("POST", "/nodes/test-0/undrain", json={})
    wait_until(lambda: hub.server("alice") is None, 30, "the hub to stop alice's idle session")
    hub.wait_ready("carol")

    released = hub.broker("GET", f"/slices/{held['id']}")
    assert released["state"] == "ended"
    assert released["ended_at"] < released["protected_until"]  # culled while protected
    assert f"waiting request {waiting['id']} could use its GPUs" in hub.log_text()
    home = hub.login("alice").get(f"{hub.url}/hub/home", timeout=10).text
    assert "Your GPU session was stopped as idle" in home
    assert "still within its protected period" in home
    hub.stop_server("carol")


def test_a_session_busy_on_its_gpus_is_kept_however_old_its_hub_activity(hub, gpus):
    gpus.set(90, memory_used=30_000)
    hub.start_server("bob", project="vision", gpus=2, protected="15m")
    hub.wait_ready("bob", timeout=90)
    held = hub.slice_of("bob")

    # carol waits for bob's GPUs, bob's hub activity is the spawn's: only the GPU keeps it.
    hub.start_server("carol", project="nlp", gpus=2, protected="15m")
    waiting = wait_until(lambda: hub.slice_of("carol"), 30, "carol's request")
    assert waiting["state"] == "pending"
    try:
        wait_until(
            lambda: sum(w == str(waiting["id"]) for _, w, _ in idle_reads(hub, "bob")) >= 6,
            120,
            "six idle checks of bob with carol waiting",
        )
    except AssertionError as err:  # say what the checks saw, and where carol's request is
        carol = hub.broker("GET", f"/slices/{waiting['id']}")
        raise AssertionError(f"{err}: checks {idle_reads(hub, 'bob')[-8:]}, carol {carol}") from err
    assert hub.server("bob")["ready"]
    checks = [(idle, source) for idle, w, source in idle_reads(hub, "bob") if w]
    assert all(source == "the session" and idle < 3 for idle, source in checks), checks

    # The GPUs idle: after the protected limit (3 s) the session is stopped for carol.
    gpus.set(0, memory_used=30_000)
    wait_until(lambda: hub.server("bob") is None, 60, "the hub to stop bob's idle session")
    hub.wait_ready("carol")
    assert hub.broker("GET", f"/slices/{held['id']}")["state"] == "ended"
    assert "Culling bob: idle" in hub.log_text()
    hub.stop_server("carol")
