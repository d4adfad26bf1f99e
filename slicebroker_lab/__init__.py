"""The GPU slice inside JupyterLab: a jupyter_server extension and a prebuilt Lab extension.

The server extension (:mod:`slicebroker_lab.handlers`) answers
``GET <base_url>slicebroker/session`` on the single-user server with the
session's slice as the broker sees it, read with the session's own
environment (``SLICEBROKER_URL``, ``SLICEBROKER_TOKEN``,
``SLICEBROKER_SLICE_ID``, which the spawner sets). The Lab extension (built
from ``js/`` into ``labextension/`` by ``build.sh``) polls it and shows the
status-bar item, the countdown dialog and the details panel.

Both live in this package's ``jupyter/`` folder, laid out as a Jupyter data and
config directory. ``pip install .`` copies them under the environment's
``share/jupyter`` and ``etc/jupyter``, where Jupyter looks. An editable install
(``pip install -e .``) copies no data files, so the spawner points the session's
``JUPYTER_PATH`` and ``JUPYTER_CONFIG_PATH`` at the folder instead
(:func:`session_env`).
"""

from __future__ import annotations

import os
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


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    return [{"module": "slicebroker_lab"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Add the ``slicebroker/session`` route to the server."""
    from .handlers import setup_handlers

    setup_handlers(serverapp)
