"""Kernel variables a session keeps across a preemption: ``%slicebroker_keep``.

In a notebook of a session that comes back after a preemption (the form's "Bring it
back after a preemption")::

    %load_ext slicebroker_lab
    %slicebroker_keep df model

When the session is preempted, JupyterLab asks every kernel to save (``%slicebroker_save``,
also run by hand): the kept variables are written with ``dill`` to the session's disk,
one file per notebook, tensors on a GPU as CPU copies. In the session brought back,
``%load_ext slicebroker_lab`` loads them again into the new kernel, once, and says what
it restored.

What cannot come back: generators, sockets, threads, processes, database connections and
other live handles (an open file is reopened by name, not at its data); CUDA state (a
model's parameters are kept only as the tensors they are, so keep ``model.state_dict()``,
or the model moved to the CPU); anything dill cannot serialise (named when saving);
variables that were not marked. The kernel's other state —
imports, the history, everything else in memory — starts afresh.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import dill
from IPython.core.magic import Magics, line_magic, magics_class

#: Where kept variables are written (default ``~/.slicebroker/kept``).
KEEP_DIR_ENV = "SLICEBROKER_KEEP_DIR"
#: The notebook a kernel runs for, as Jupyter Server names it in the kernel's environment.
NOTEBOOK_ENV = "JPY_SESSION_NAME"


def keep_file(notebook: str, directory: str | None = None) -> Path:
    """The file that holds the kept variables of ``notebook`` (one per notebook path)."""
    root = Path(directory or os.path.expanduser("~/.slicebroker/kept"))
    digest = hashlib.sha256(notebook.encode()).hexdigest()[:16]
    return root / f"{Path(notebook).stem or 'kernel'}-{digest}.dill"


def cpu_copy(value: Any) -> Any:
    """``value``, or a CPU copy of it where it is a tensor on a GPU (any framework with
    ``is_cuda`` and ``cpu()``, PyTorch's among them)."""
    if getattr(value, "is_cuda", False) and callable(getattr(value, "cpu", None)):
        return value.detach().cpu() if callable(getattr(value, "detach", None)) else value.cpu()
    return value


@magics_class
class KeepMagics(Magics):
    """``%slicebroker_keep`` and ``%slicebroker_save`` (see the module docstring)."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.kept: list[str] = []
        notebook = os.environ.get(NOTEBOOK_ENV) or "kernel"
        self.path = keep_file(notebook, os.environ.get(KEEP_DIR_ENV))

    @line_magic
    def slicebroker_keep(self, line: str) -> None:
        """Mark variables to keep across a preemption: ``%slicebroker_keep df model``;
        with no names, list those marked."""
        names = line.split()
        missing = [name for name in names if name not in self.shell.user_ns]
        for name in names:
            if name not in missing and name not in self.kept:
                self.kept.append(name)
        if missing:
            print(f"slicebroker: not defined, not kept: {', '.join(missing)}")
        print(f"slicebroker: kept across a preemption: {', '.join(self.kept) or 'nothing'}")

    @line_magic
    def slicebroker_save(self, line: str = "") -> None:
        """Write the kept variables to the session's disk now (Lab runs it at a preemption)."""
        namespace = self.shell.user_ns
        values = {name: cpu_copy(namespace[name]) for name in self.kept if name in namespace}
        failed = []
        try:
            # Together, so that variables that share objects still share them once loaded.
            blob = dill.dumps(values)
        except Exception:  # dill raises whatever an object's reduction raises
            for name, value in list(values.items()):
                try:
                    dill.dumps(value)
                except Exception as err:
                    failed.append(f"{name} ({type(err).__name__})")
                    del values[name]
            blob = dill.dumps(values)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        with open(partial, "wb") as out:
            dill.dump({"saved_at": time.time(), "values": blob}, out)
        partial.replace(self.path)  # a kernel killed while writing leaves the last whole file
        print(f"slicebroker: saved {', '.join(values) or 'nothing'} to {self.path}")
        if failed:
            print(f"slicebroker: could not save: {', '.join(failed)}")

    def restore(self) -> None:
        """Load the kept variables of this notebook, once, if a preemption saved any."""
        if not self.path.exists():
            return
        try:
            with open(self.path, "rb") as kept:
                saved = dill.load(kept)
            values = dill.loads(saved["values"])
        except Exception as err:  # a file cut short, or of code that changed since
            self.path.replace(self.path.with_suffix(".unreadable"))
            print(f"slicebroker: the kept variables could not be read back ({err}); kept aside")
            return
        self.path.replace(self.path.with_suffix(".restored"))  # loaded once, not every start
        self.shell.user_ns.update(values)
        self.kept = list(values)
        when = time.strftime("%H:%M:%S", time.localtime(saved["saved_at"]))
        print(f"slicebroker: restored {', '.join(self.kept) or 'nothing'} (kept at {when})")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext slicebroker_lab``: the magics, and what a preemption kept, restored."""
    magics = KeepMagics(ipython)
    ipython.register_magics(magics)
    magics.restore()
