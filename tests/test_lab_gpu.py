"""The session's GPUs as the Lab extension reads them (slicebroker_lab.gpu), and the rule
that makes a session active (slicebroker_lab.activity), on a machine without a GPU: a
stand-in ``nvidia-smi`` run as a real process, and an NVML that answers as
``nvidia-ml-py`` does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gpustandin import StandinGpus, uuid_of

from slicebroker_lab.activity import last_active
from slicebroker_lab.gpu import (
    parse_gpu_use,
    read_session_gpus,
    visible_devices,
)


@pytest.fixture
def gpus(tmp_path) -> StandinGpus:
    return StandinGpus(tmp_path / "standin", count=4)


def test_nvidia_smi_s_answer_is_read_with_unreported_fields_as_none():
    read = parse_gpu_use("0, GPU-aa, 37, 1024, 81559\n\n1, GPU-bb, [N/A], [N/A], 81559\n")
    assert [(g.index, g.uuid, g.utilization_percent, g.memory_used_mib) for g in read] == [
        (0, "GPU-aa", 37, 1024),
        (1, "GPU-bb", None, None),
    ]
    with pytest.raises(ValueError, match="line 2"):
        parse_gpu_use("0, GPU-aa, 37, 1024, 81559\nNo devices were found\n")


@pytest.mark.parametrize(
    ("value", "devices"),
    [(None, None), ("", []), ("0,2", ["0", "2"]), ("1,-1,2", ["1"]), ("GPU-0001", ["GPU-0001"])],
)
def test_the_session_s_devices_are_cuda_s_up_to_its_first_name_that_is_no_device(value, devices):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_devices(env) == devices


def test_only_the_session_s_own_gpus_and_their_processes_are_read(gpus):
    gpus.set(60, memory_used=2048, pids=(4242,))
    reading = read_session_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}, program=str(gpus.program))
    assert reading.source == "nvidia-smi"
    assert [g.index for g in reading.gpus] == [1, 3]
    assert reading.processes == ()  # the process is on GPU 0, another session's

    by_uuid = read_session_gpus({"CUDA_VISIBLE_DEVICES": "0"}, program=str(gpus.program))
    assert [g.uuid for g in by_uuid.gpus] == [uuid_of(0)]
    assert [(p.pid, p.memory_used_mib) for p in by_uuid.processes] == [(4242, 512)]
    prefix = uuid_of(2)[:12]  # CUDA takes a unique prefix of a UUID
    assert [
        g.index
        for g in read_session_gpus({"CUDA_VISIBLE_DEVICES": prefix}, program=str(gpus.program)).gpus
    ] == [2]
    assert [g.index for g in read_session_gpus({}, program=str(gpus.program)).gpus] == [0, 1, 2, 3]


def test_a_gpu_is_busy_from_the_threshold_up_and_memory_alone_is_not_work(gpus):
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    gpus.set(0, memory_used=70_000)
    assert not read_session_gpus(env, program=str(gpus.program)).busy(1.0)
    gpus.set(1)
    reading = read_session_gpus(env, program=str(gpus.program))
    assert reading.busy(1.0) and not reading.busy(2.0)


def test_a_session_without_a_driver_or_without_gpus_says_why(gpus, tmp_path):
    missing = read_session_gpus({}, program=str(tmp_path / "no-nvidia-smi"))
    assert missing.source == "none" and "not available" in missing.problem
    assert not missing.busy(0.0)
    hidden = read_session_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, program=str(gpus.program))
    assert hidden.source == "none" and hidden.problem == "this session has no GPU"


class FakeNvml(SimpleNamespace):
    """The calls of ``nvidia-ml-py`` the reader makes, answering for two GPUs."""

    class NVMLError(Exception):
        pass

    def __init__(self, utilization: list[int], fail: bool = False):
        super().__init__()
        self.utilization, self.fail = utilization, fail

    def nvmlDeviceGetCount(self) -> int:  # NVML's names
        if self.fail:
            raise self.NVMLError("Driver Not Loaded")
        return len(self.utilization)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # bytes in older bindings
        return uuid_of(handle).encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=3 * 1024**3, total=80 * 1024**3)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.utilization[handle], memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list:
        return [SimpleNamespace(pid=100 + handle, usedGpuMemory=None)]


def test_nvml_is_read_first_and_nvidia_smi_answers_when_nvml_fails(gpus):
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    reading = read_session_gpus(env, nvml=FakeNvml([0, 75]), program=str(gpus.program))
    assert reading.source == "nvml"
    assert [(g.index, g.utilization_percent, g.memory_used_mib) for g in reading.gpus] == [
        (1, 75, 3072)
    ]
    assert [(p.pid, p.memory_used_mib) for p in reading.processes] == [(101, None)]

    gpus.set(20)
    fallback = read_session_gpus(env, nvml=FakeNvml([0, 0], fail=True), program=str(gpus.program))
    assert fallback.source == "nvidia-smi"
    assert [g.utilization_percent for g in fallback.gpus] == [20]


def test_a_session_is_active_now_while_a_kernel_executes_else_at_its_latest_activity():
    assert last_active(100.0, 500.0, 1, [120.0]) == 500.0
    assert last_active(100.0, 500.0, 0, [120.0, None, 300.0]) == 300.0
    assert last_active(100.0, 500.0, 0, [None]) == 100.0


def test_a_reading_s_json_names_each_gpu_and_process(gpus):
    gpus.set(40, memory_used=1024, pids=(77,))
    reading = read_session_gpus({"CUDA_VISIBLE_DEVICES": "0"}, program=str(gpus.program))
    shown = reading.as_json()
    assert shown["source"] == "nvidia-smi" and shown["problem"] is None
    assert shown["gpus"] == [
        {
            "index": 0,
            "uuid": uuid_of(0),
            "utilization_percent": 40,
            "memory_used_mib": 1024,
            "memory_total_mib": 81559,
        }
    ]
    assert shown["processes"] == [{"pid": 77, "gpu_uuid": uuid_of(0), "memory_used_mib": 512}]
