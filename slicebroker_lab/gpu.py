"""How busy a session's own GPUs are: NVML first, ``nvidia-smi`` when NVML cannot load.

A session's GPUs are those of its ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as
the spawner sets them), or every GPU the session can see when the variable is
unset (a Kubernetes pod sees only its own). No GPU is held by two slices, so the
utilisation of those GPUs is the session's own work, whichever of its processes
(a kernel, a terminal's command) runs on them.

Two readings are taken of each GPU: its utilisation (the share of the driver's
last sample period, 1/6 s to 1 s, in which a kernel ran on it, in percent) and
its memory in use; and, per process, the memory it holds. A GPU is *busy* when
its utilisation reaches a threshold: memory alone (a model loaded, nothing
running) is not work.

:func:`read_session_gpus` is blocking (NVML and ``nvidia-smi`` both are): call it
from a thread.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

from broker.nvidia_smi import run_query

GPU_QUERY = [
    "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total",
    "--format=csv,noheader,nounits",
]
APPS_QUERY = ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class GpuUse:
    """One GPU's reading; ``None`` where the driver reports ``[N/A]``."""

    index: int
    uuid: str
    utilization_percent: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with memory on one of the session's GPUs."""

    pid: int
    gpu_uuid: str
    memory_used_mib: int | None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """The session's GPUs at one moment, and where the reading came from.

    ``source`` is ``nvml``, ``nvidia-smi`` or ``none`` (neither answered: no
    driver, or a session without GPUs); ``problem`` says why, in words.
    """

    source: str
    gpus: tuple[GpuUse, ...] = ()
    processes: tuple[GpuProcess, ...] = ()
    problem: str | None = None

    def busy(self, threshold_percent: float) -> bool:
        """Whether any of the session's GPUs is at or above ``threshold_percent``."""
        return any(
            gpu.utilization_percent is not None and gpu.utilization_percent >= threshold_percent
            for gpu in self.gpus
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gpus": [asdict(gpu) for gpu in self.gpus],
            "processes": [asdict(process) for process in self.processes],
            "problem": self.problem,
        }


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The session's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (``None``: unset, all)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    names = [name.strip() for name in value.split(",") if name.strip()]
    # CUDA stops at the first name that is not a device ("-1" hides every GPU).
    kept = []
    for name in names:
        if not (name.isdigit() or name.startswith(("GPU-", "MIG-"))):
            break
        kept.append(name)
    return kept


def _is_session_gpu(gpu: GpuUse, devices: Sequence[str] | None) -> bool:
    if devices is None:
        return True
    # CUDA takes a unique prefix of a UUID, as nvidia-smi prints them.
    return any(name == str(gpu.index) or gpu.uuid.startswith(name) for name in devices)


def _number(text: str) -> int | None:
    """An integer field of ``nvidia-smi``'s CSV; ``None`` for ``[N/A]`` and the like."""
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:
        return None


def parse_gpu_use(text: str) -> list[GpuUse]:
    """The GPUs in the answer to :data:`GPU_QUERY`; a malformed line raises ``ValueError``."""
    gpus = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 5 or not fields[0].isdigit():
            raise ValueError(
                f"line {number} of nvidia-smi's answer is not 'index, uuid, utilization, "
                f"memory used, memory total': {line!r}"
            )
        index, uuid, utilization, used, total = fields
        gpus.append(GpuUse(int(index), uuid, _number(utilization), _number(used), _number(total)))
    return gpus


def parse_processes(text: str) -> list[GpuProcess]:
    """The processes in the answer to :data:`APPS_QUERY` (malformed lines are skipped: a
    process may end while the driver lists it)."""
    processes = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit():
            processes.append(GpuProcess(int(fields[0]), fields[1], _number(fields[2])))
    return processes


def read_with_nvidia_smi(
    program: str = "nvidia-smi", run: Callable[..., Any] = subprocess.run
) -> GpuReading:
    """Every GPU of the machine, from ``nvidia-smi``."""
    answer = run_query(GPU_QUERY, run, program=program)
    if answer is None:
        return GpuReading("none", problem=f"{program} is not available or failed")
    try:
        gpus = parse_gpu_use(answer)
    except ValueError as err:
        return GpuReading("none", problem=str(err))
    processes = parse_processes(run_query(APPS_QUERY, run, program=program) or "")
    return GpuReading("nvidia-smi", tuple(gpus), tuple(processes))


def load_nvml() -> ModuleType | None:
    """NVML's Python binding (``nvidia-ml-py``), initialised; ``None`` where the library or
    the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


def read_with_nvml(nvml: ModuleType) -> GpuReading:
    """Every GPU of the machine, from an initialised NVML (see :func:`load_nvml`)."""
    gpus, processes = [], []
    try:
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            gpus.append(GpuUse(index, uuid, utilization, memory.used // _MIB, memory.total // _MIB))
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = process.usedGpuMemory
                processes.append(
                    GpuProcess(process.pid, uuid, None if used is None else used // _MIB)
                )
    except nvml.NVMLError as err:
        return GpuReading("none", problem=f"NVML: {err}")
    return GpuReading("nvml", tuple(gpus), tuple(processes))


def read_session_gpus(
    env: Mapping[str, str],
    *,
    nvml: ModuleType | None = None,
    program: str = "nvidia-smi",
    run: Callable[..., Any] = subprocess.run,
) -> GpuReading:
    """The session's own GPUs (see the module docstring): from ``nvml`` when given and it
    answers, else from ``nvidia-smi``."""
    reading = read_with_nvml(nvml) if nvml is not None else None
    if reading is None or reading.source == "none":
        reading = read_with_nvidia_smi(program, run)
    if reading.source == "none":
        return reading
    devices = visible_devices(env)
    gpus = tuple(gpu for gpu in reading.gpus if _is_session_gpu(gpu, devices))
    uuids = {gpu.uuid for gpu in gpus}
    processes = tuple(p for p in reading.processes if p.gpu_uuid in uuids)
    if not gpus:
        return GpuReading("none", problem="this session has no GPU")
    return GpuReading(reading.source, gpus, processes)


__all__ = [
    "GpuProcess",
    "GpuReading",
    "GpuUse",
    "load_nvml",
    "read_session_gpus",
    "visible_devices",
]
