"""The GPU slice inside JupyterLab: a jupyter_server extension and a prebuilt Lab extension.

The server extension (:mod:`slicebroker_lab.handlers`) answers
``GET <base_url>slicebroker/session`` on the single-user server with the
session's slice as the broker sees it, read with the session's own
environment (``SLICEBROKER_URL``, ``SLICEBROKER_TOKEN``,
``SLICEBROKER_SLICE_ID``, which the spawner sets), and
``GET``/``POST <base_url>slicebroker/activity`` with what the session last did,
its GPUs' load included (:mod:`slicebroker_lab.activity`), which the hub's idle
rule reads. The Lab extension (built
from ``js/`` into ``labextension/`` by ``build.sh``) polls it and shows the
status-bar item, the countdown dialog and the details panel.

Both live in this package's ``jupyter/`` folder, laid out as a Jupyter data and
config directory. ``pip install .`` copies them under the environment's
``share/jupyter`` and ``etc/jupyter``, where Jupyter looks. An editable install
(``pip install -e .``) copies no data files, so the spawner points the session's
``JUPYTER_PATH`` and ``JUPYTER_CONFIG_PATH`` at the folder instead
(:func:`session_env`).

Lab's terminals run a login shell, whose profile resets ``PATH`` to the system's
and so loses the environment the session runs in (and ``slicebroker`` with it).
The extension gives them a login shell that puts the environment's ``bin`` back in
front (:func:`terminal_shell`), unless the admin set
``ServerApp.terminado_settings["shell_command"]`` themselves.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The Lab extension's name (its folder under ``share/jupyter/labextensions``).
LABEXTENSION = "slicebroker-lab"
#: The hub's idle limits (seconds, 0: off) in a session's environment, by
#: :class:`spawner.culler.CullLimits` field: Lab warns before the session may stop as idle.
CULL_ENV = {
    "idle": "SLICEBROKER_CULL_IDLE",
    "busy": "SLICEBROKER_CULL_IDLE_BUSY",
    "protected": "SLICEBROKER_CULL_IDLE_PROTECTED",
}
#: A session that comes back after a preemption ("1"), and for a session brought back,
#: the slice it restores and when that one ended (ISO 8601): Lab says so.
RESTORE_ENV = "SLICEBROKER_RESTORE"
RESTORES_ENV = "SLICEBROKER_RESTORES"
RESTORES_ENDED_ENV = "SLICEBROKER_RESTORES_ENDED_AT"
#: This package's Jupyter data and config folder.
JUPYTER_DIR = Path(__file__).resolve().parent / "jupyter"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the built Lab extension is (for ``jupyter labextension develop``)."""
    return [{"src": f"jupyter/labextensions/{LABEXTENSION}", "dest": LABEXTENSION}]


def installed(prefix: str = sys.prefix) -> bool:
    """Whether the Lab extension is installed under ``prefix`` (a regular install)."""
    return (Path(prefix) / "share" / "jupyter" / "labextensions" / LABEXTENSION).is_dir()


def session_env(env: Mapping[str, str]) -> dict[str, str]:
    """Variables that make a session started from this environment load both extensions.

    Empty for a regular install. For an editable one, ``JUPYTER_PATH`` and
    ``JUPYTER_CONFIG_PATH`` (as in ``env``) with this package's folder in front.
    """
    if installed():
        return {}
    return {
        name: os.pathsep.join(filter(None, [str(JUPYTER_DIR), env.get(name)]))
        for name in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH")
    }


#: Shells whose ``-l -c`` and ``export`` are POSIX's: those :func:`terminal_shell` wraps.
POSIX_SHELLS = frozenset({"sh", "bash", "dash", "ksh", "zsh"})


def environment_bin() -> str:
    """The folder of this environment's commands (where ``slicebroker`` is)."""
    found = shutil.which("slicebroker")
    return os.path.dirname(found) if found else os.path.dirname(sys.executable)


def terminal_shell(shell: str, bin_dir: str) -> list[str] | None:
    """A login ``shell`` (its profile read, as Jupyter's terminals have it) that then puts
    ``bin_dir`` first on ``PATH`` and goes on as an interactive shell; ``None`` for a
    shell that is not POSIX (it keeps Jupyter's default)."""
    if os.path.basename(shell) not in POSIX_SHELLS:
        return None
    keep = f'PATH={shlex.quote(bin_dir)}:"$PATH"; export PATH; exec {shlex.quote(shell)} -i'
    return [shell, "-l", "-c", keep]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext slicebroker_lab`` in a kernel: ``%slicebroker_keep`` and what a
    preemption kept, restored (:mod:`slicebroker_lab.keep`)."""
    from .keep import load_ipython_extension as load

    load(ipython)


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    return [{"module": "slicebroker_lab"}]


def _link_jupyter_server_extension(serverapp: Any) -> None:
    """Give Lab's terminals a shell that finds ``slicebroker`` (linked before any extension
    loads: the terminals read their shell when they load)."""
    settings = dict(serverapp.terminado_settings or {})
    if "shell_command" in settings:
        return  # the admin's choice
    shell = terminal_shell(os.environ.get("SHELL") or shutil.which("sh") or "sh", environment_bin())
    if shell is not None:
        serverapp.terminado_settings = {**settings, "shell_command": shell}


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Add the ``slicebroker/session`` route to the server."""
    from .handlers import setup_handlers

    setup_handlers(serverapp)
