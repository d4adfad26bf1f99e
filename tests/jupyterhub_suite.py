"""JupyterHub's own spawner tests, run against slicebroker's spawner (a pytest plugin).

JupyterHub's wheel ships its test suite (``jupyterhub.tests``). This plugin runs it,
unmodified, with :class:`~spawner.local.SliceBrokerSpawner` in front of every spawner
the suite uses, and a real broker behind it::

    PYTHONPATH=tests python -m pytest -p jupyterhub_suite \\
        --pyargs jupyterhub.tests.test_spawner -o asyncio_mode=auto

Before the suite's modules are imported, each spawner class of
``jupyterhub.tests.mocking`` (``MockSpawner``, ``SlowSpawner``, ``FormSpawner``, ...)
and the ``SimpleLocalProcessSpawner`` that ``test_spawner.py`` imports is replaced by
``class X(SliceBrokerSpawner, X)``. A broker subprocess (a node of 64 GPUs, one
project for every user through the group :data:`HUB_GROUP`) answers the spawner,
which finds it through ``SLICEBROKER_URL`` and ``SLICEBROKER_TOKEN`` as a hub's
spawner does. The failures that remain are the documented differences
(docs/hub-admin.md, "JupyterHub's spawner tests"); ``tests/test_spawner_jupyterhub.py``
runs a selection in the suite.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from servicefixtures import BrokerService, start_service

#: The group every hub user is put in, and the one project's members.
HUB_GROUP = "hub-users"

CLUSTER = f"""\
admins = ["root"]

[policy]
window = "7d"
max_min_runtime = "8h"
grace_period = "2s"
debug_max_gpus = 64

[defaults.interactive]
min_runtime = "15m"

[gpu_types]
h100 = 1.0

[[nodes]]
name = "n0"
gpu_type = "h100"
gpus = 64

[projects.hub]
groups = ["{HUB_GROUP}"]
"""

#: The spawner classes of ``jupyterhub.tests.mocking`` the suite's fixtures pick.
MOCK_SPAWNERS = (
    "MockSpawner",
    "SlowSpawner",
    "NeverSpawner",
    "BadSpawner",
    "CustomBadSpawner",
    "SlowBadSpawner",
    "CustomInputSpawner",
    "FormSpawner",
    "FalsyCallableFormSpawner",
    "InstrumentedSpawner",
)

_broker: BrokerService | None = None


def with_slices(backend: type) -> type:
    """``class Name(SliceBrokerSpawner, backend)`` whose users are all in :data:`HUB_GROUP`."""
    from spawner.local import SliceBrokerSpawner

    def _user_groups(self: Any) -> list[str]:
        return sorted({*SliceBrokerSpawner._user_groups(self), HUB_GROUP})

    namespace = {"__module__": backend.__module__, "_user_groups": _user_groups}
    return type(backend.__name__, (SliceBrokerSpawner, backend), namespace)


def pytest_configure(config: pytest.Config) -> None:
    global _broker
    from jupyterhub import spawner as spawner_module
    from jupyterhub.tests import mocking

    for name in MOCK_SPAWNERS:
        setattr(mocking, name, with_slices(getattr(mocking, name)))
    spawner_module.SimpleLocalProcessSpawner = with_slices(spawner_module.SimpleLocalProcessSpawner)

    directory = Path(tempfile.mkdtemp(prefix="jupyterhub-suite-broker-"))
    _broker = start_service(directory, config=CLUSTER, pass_interval=1.0)
    os.environ["SLICEBROKER_URL"] = _broker.url.rstrip("/")
    os.environ["SLICEBROKER_TOKEN"] = _broker.token("hub", agent=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _broker is not None:
        _broker.stop()
