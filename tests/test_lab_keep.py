"""``%slicebroker_keep`` (slicebroker_lab/keep.py) in real IPython kernels: variables a
kernel marked and saved come back in the next kernel of the same notebook, once."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from jupyter_client.manager import start_new_kernel

from slicebroker_lab.keep import cpu_copy, keep_file


@contextmanager
def kernel(keep_dir: Path, notebook: str = "work/analysis.ipynb") -> Iterator:
    """A real Python kernel running for ``notebook``, as Jupyter Server starts one."""
    env = {**os.environ, "SLICEBROKER_KEEP_DIR": str(keep_dir), "JPY_SESSION_NAME": notebook}
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    try:
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def run(client, code: str) -> str:
    """What ``code`` printed (stdout), after checking it raised nothing."""
    printed: list[str] = []

    def hook(message: dict) -> None:
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])
        assert message["msg_type"] != "error", message["content"]

    reply = client.execute_interactive(code, timeout=60, output_hook=hook)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(printed)


def test_kept_variables_come_back_in_the_next_kernel_of_the_notebook(tmp_path):
    with kernel(tmp_path) as first:
        marked = run(
            first,
            "%load_ext slicebroker_lab\n"
            "class Point:\n"
            "    def __init__(self, x): self.x = x\n"
            "answer, point, twice = 42, Point(3), (lambda v: 2 * v)\n"
            "counter = (n for n in range(3))\n"
            "scratch = 'not kept'\n"
            "%slicebroker_keep answer point twice counter nowhere",
        )
        assert "not defined, not kept: nowhere" in marked
        saved = run(first, "%slicebroker_save")
    # A class and a function defined in the notebook are kept (dill); a generator is not.
    assert "saved answer, point, twice to" in saved
    assert "could not save: counter (TypeError)" in saved
    assert keep_file("work/analysis.ipynb", str(tmp_path)).exists()

    with kernel(tmp_path) as second:
        restored = run(second, "%load_ext slicebroker_lab")
        assert "restored answer, point, twice" in restored
        assert run(second, "print(answer, point.x, twice(5), 'scratch' in dir())") == (
            "42 3 10 False\n"
        )
    with kernel(tmp_path) as third:  # once: a later kernel starts afresh
        assert "restored" not in run(third, "%load_ext slicebroker_lab")
        assert run(third, "print('answer' in dir())") == "False\n"
    with kernel(tmp_path, "other.ipynb") as other:  # another notebook's are its own
        assert "restored" not in run(other, "%load_ext slicebroker_lab")


class _GpuTensor:
    """A tensor's face as keep.py sees it: on a GPU, with a CPU copy to give."""

    is_cuda = True

    def detach(self):
        return self

    def cpu(self):
        return "on the CPU"


def test_a_tensor_on_a_gpu_is_kept_as_its_cpu_copy():
    assert cpu_copy(_GpuTensor()) == "on the CPU"
    assert cpu_copy([1, 2]) == [1, 2]


def test_a_kept_file_that_cannot_be_read_is_set_aside_with_a_line_not_a_traceback(tmp_path):
    kept = keep_file("work/analysis.ipynb", str(tmp_path))
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(b"cut short")
    with kernel(tmp_path) as fresh:
        said = run(fresh, "%load_ext slicebroker_lab")
    assert said.startswith("slicebroker: the kept variables could not be read back (")
    assert not kept.exists() and kept.with_suffix(".unreadable").exists()
