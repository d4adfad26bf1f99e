"""End to end: the embedded default's session is JupyterLab with a Python kernel, on a
real hub with a real ``jupyterhub-singleuser`` (not the tests' stand-in server)."""

from __future__ import annotations

import time

import pytest
from hubfixtures import HubProcess, proxy_available

pytestmark = pytest.mark.skipif(proxy_available() is not None, reason=str(proxy_available()))

REAL_SERVER = """
c.Spawner.cmd = ["jupyterhub-singleuser"]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = HubProcess(tmp_path_factory.mktemp("lab-hub"), extra_config=REAL_SERVER)
    try:
        yield hub.start()
    finally:
        hub.shutdown()


def test_a_session_opens_jupyterlab_with_a_python_kernel(hub):
    began = time.monotonic()
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    server = hub.wait_ready("alice", timeout=60)
    lab = hub.user_get("alice", "lab")
    took = time.monotonic() - began

    assert server["url"] == "/user/alice/"
    assert lab.status_code == 200 and "JupyterLab" in lab.text
    kernels = hub.user_get("alice", "api/kernelspecs").json()
    assert "python3" in kernels["kernelspecs"]
    assert took < 60, f"Start to Lab took {took:.1f} s"
    print(f"Start to JupyterLab: {took:.1f} s")
    hub.stop_server("alice")
