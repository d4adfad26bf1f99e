"""A stand-in ``nvidia-smi`` for machines without a GPU: it answers the two queries the
Lab extension asks (``--query-gpu`` and ``--query-compute-apps``, CSV without header or
units) from a JSON file the test rewrites, so that the GPUs' load changes under a
running session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_SCRIPT = """#!{python}
import json, sys
state = json.load(open({state!r}))
query = next((a for a in sys.argv[1:] if a.startswith("--query-")), "")
if query.startswith("--query-gpu="):
    for g in state["gpus"]:
        print(f"{{g['index']}}, {{g['uuid']}}, {{g['utilization']}}, {{g['memory_used']}}, 81559")
elif query.startswith("--query-compute-apps="):
    for p in state["processes"]:
        print(f"{{p['pid']}}, {{p['gpu_uuid']}}, {{p['memory_used']}}")
else:
    sys.exit("stand-in nvidia-smi: unknown query " + " ".join(sys.argv[1:]))
"""


def uuid_of(index: int) -> str:
    return f"GPU-{index:08d}-standin"


class StandinGpus:
    """``count`` GPUs whose utilisation the test sets; ``program`` is the stand-in's path."""

    def __init__(self, folder: Path, count: int = 8):
        folder.mkdir(parents=True, exist_ok=True)
        self.state = folder / "gpus.json"
        self.program = folder / "nvidia-smi"
        self.count = count
        self.set(0)
        self.program.write_text(_SCRIPT.format(python=sys.executable, state=str(self.state)))
        self.program.chmod(0o755)

    def set(self, utilization: int, memory_used: int = 0, pids: tuple[int, ...] = ()) -> None:
        """Every GPU at ``utilization`` percent with ``memory_used`` MiB; ``pids`` on GPU 0."""
        gpus = [
            {"index": i, "uuid": uuid_of(i), "utilization": utilization, "memory_used": memory_used}
            for i in range(self.count)
        ]
        processes = [{"pid": pid, "gpu_uuid": uuid_of(0), "memory_used": 512} for pid in pids]
        staged = self.state.with_suffix(".tmp")
        staged.write_text(json.dumps({"gpus": gpus, "processes": processes}))
        staged.replace(self.state)  # whole, for a reading taken meanwhile
