"""JupyterHub's own spawner tests pass against slicebroker's spawner (a cheap selection).

The tests come from the installed ``jupyterhub`` wheel, unmodified; the plugin
:mod:`jupyterhub_suite` puts :class:`~spawner.local.SliceBrokerSpawner` in front of
JupyterHub's mock spawners and starts a real broker for them. They run in a pytest
of their own (JupyterHub's fixtures are not ours). The whole suites, and the
differences that remain, are in docs/hub-admin.md ("JupyterHub's own spawner tests").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jupyterhub.tests
from servicefixtures import REPO_ROOT

#: Module -> the tests run from it (about 40 s on two busy cores): a real server started,
#: polled and stopped; a spawn through the REST API; one that never starts (the backend's
#: own start_timeout); the admin's options_from_form; user_options round-tripping.
SELECTION = {
    "test_spawner.py": [
        "test_spawner",
        "test_spawner_options_from_form",
        "test_predefined_options_from_form",
        "test_spawner_options_from_form_with_spawner",
    ],
    "test_api.py": [
        "test_spawn",
        "test_user_options",
        "test_never_spawn",
    ],
}


#: What a ``<testcase>`` of a JUnit report holds when the test did not pass.
NOT_PASSED = ("failure", "error", "skipped")


def _default_signals() -> None:
    """In the suite's process, before it runs: signals as a shell would leave them.

    The mock servers of JupyterHub's tests stop on SIGINT; a process that ignores or
    blocks it passes that on to its children (Python keeps an ignored SIGINT), and
    each stop then waits out the spawner's interrupt_timeout: longer than the hub's
    slow_stop_timeout, so the hub answers 202 where its test expects 204.
    """
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def test_jupyterhubs_spawner_tests_pass_with_the_broker_in_front(tmp_path: Path):
    report = tmp_path / "report.xml"
    suite = Path(jupyterhub.tests.__file__).parent
    node_ids = [
        f"{suite / module}::{name}" for module, names in SELECTION.items() for name in names
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
        # jupyterhub-singleuser and the proxy, next to this Python.
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            os.devnull,
            f"--rootdir={tmp_path}",
            "-p",
            "no:cacheprovider",
            "-p",
            "jupyterhub_suite",
            *node_ids,
            "-o",
            "asyncio_mode=auto",
            "-o",
            "asyncio_default_fixture_loop_scope=module",
            "-o",
            "asyncio_default_test_loop_scope=module",
            f"--junitxml={report}",
            "-q",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_default_signals,
    )
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {
        case.get("name"): [child.tag for child in case if child.tag in NOT_PASSED] for case in cases
    }
    not_passed = {name: tags for name, tags in outcomes.items() if tags}

    details = "\n".join(
        f"{case.get('name')}: {child.tag}: {child.get('message')}\n{(child.text or '')[-2000:]}"
        for case in ET.parse(report).getroot().iter("testcase")
        for child in case
        if child.tag in NOT_PASSED
    )
    assert not not_passed, f"{not_passed}\n{details}\n{run.stdout[-3000:]}"
    ran = {name.split("[")[0] for name in outcomes}
    wanted = {name for names in SELECTION.values() for name in names}
    assert ran == wanted, f"not run: {wanted - ran}\n{run.stdout[-3000:]}"
    assert run.returncode == 0, run.stdout[-3000:]
