"""``slicebroker run``: real runner processes, real commands, a real broker subprocess.

Commands are small Python scripts that write marker files; the tests wait on
those files (and on the runner's output), never on fixed sleeps. The broker
runs short contracts: protected for 2 s, then a 1 s grace period.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from servicefixtures import TEST_CONFIG, BrokerService, fill_cluster, running_service, service_env

CONFIG = TEST_CONFIG.replace('grace_period = "2s"', 'grace_period = "1s"')
assert CONFIG != TEST_CONFIG

#: The command the tests run: records its run in DIR, then does what MODE says.
COMMAND = r"""
import json, os, signal, sys, time
directory, mode = sys.argv[1], sys.argv[2]
run = os.environ["SLICEBROKER_RUN"]

def mark(name, **extra):
    path = os.path.join(directory, f"{name}-{run}")
    with open(path + ".tmp", "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.startswith(("SLICEBROKER_", "CUDA_"))}
                  | extra, f)
    os.rename(path + ".tmp", path)

def on_term(signum, frame):
    mark("term")
    sys.exit(3)

if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_term)
mark("started")
if mode.startswith("exit-"):
    time.sleep(float(os.environ.get("HOLD", "0")))
    sys.exit(int(mode[5:]))
if mode == "wait-once" and run != "1":
    sys.exit(0)
while True:
    time.sleep(60)
"""


@pytest.fixture
def service(tmp_path: Path) -> Iterator[BrokerService]:
    with running_service(tmp_path / "broker", config=CONFIG, lease=1.5, pass_interval=1) as service:
        yield service


@pytest.fixture
def long_lease_service(tmp_path: Path) -> Iterator[BrokerService]:
    """For tests whose blocking slices have no heartbeat: they must not be lost
    (lease over) while a loaded machine starts the runner."""
    with running_service(tmp_path / "broker", config=CONFIG, lease=60, pass_interval=1) as service:
        yield service


class Runner:
    """A ``slicebroker run`` process; its stderr goes to a file."""

    def __init__(
        self, service: BrokerService, directory: Path, user: str, args: list[str], env: dict
    ):
        self.directory = directory
        self.stderr_path = directory / "runner.err"
        env = service_env(
            {"SLICEBROKER_URL": service.url, "SLICEBROKER_TOKEN": service.token(user), **env}
        )
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "broker.cli", "run", *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"the runner did not finish:\n{self.stderr}") from None

    def marker(self, name: str) -> dict[str, str]:
        path = self.directory / name
        wait_until(path.exists, f"{name} to be written", self)
        return json.loads(path.read_text())


def start_runner(
    service: BrokerService,
    tmp_path: Path,
    mode: str,
    *options: str,
    user: str = "alice",
    project: str = "vision",
    gpus: int = 2,
    env: dict[str, str] | None = None,
) -> Runner:
    directory = tmp_path / "markers"
    directory.mkdir(exist_ok=True)
    args = ["--project", project, "--gpus", str(gpus), "--min-runtime", "2s", "--poll", "1"]
    command = ["--", sys.executable, "-c", COMMAND, str(directory), mode]
    return Runner(service, directory, user, [*args, *options, *command], env or {})


def wait_until(condition: Callable[[], object], what: str, runner: Runner | None = None) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        if runner is not None and runner.process.poll() is not None:
            raise AssertionError(f"the runner exited before {what}:\n{runner.stderr}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def get_slice(service: BrokerService, slice_id: str | int) -> dict:
    return service.get(f"/slices/{slice_id}", token=service.admin_token).json()


# ---- running ---------------------------------------------------------------------------


def test_command_runs_on_the_granted_gpus_and_its_status_is_the_runners(service, tmp_path):
    # The command outlives two leases (1.5 s each): heartbeats keep the slice.
    runner = start_runner(service, tmp_path, "exit-7", env={"HOLD": "3.2"})

    assert runner.wait() == 7
    seen = runner.marker("started-1")
    slice_ = get_slice(service, seen["SLICEBROKER_SLICE_ID"])
    (placement,) = slice_["placements"]
    assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, placement["gpu_indices"]))
    assert len(placement["gpu_indices"]) == 2
    assert json.loads(seen["SLICEBROKER_PLACEMENTS"]) == slice_["placements"]
    assert seen["SLICEBROKER_PROJECT"] == "vision"
    assert seen["SLICEBROKER_PROTECTED_UNTIL"] == time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(slice_["protected_until"])
    )
    assert (slice_["state"], slice_["end_reason"]) == ("ended", "released")
    assert slice_["ended_at"] - slice_["granted_at"] > 3  # held past two leases, never lost
    assert f"slice {slice_['id']} granted: {placement['node']} GPUs" in runner.stderr


def test_in_a_session_a_command_alone_runs_on_the_sessions_project_and_the_batch_defaults(
    service, tmp_path
):
    directory = tmp_path / "markers"
    directory.mkdir()
    command = ["--", sys.executable, "-c", COMMAND, str(directory), "exit-0"]
    runner = Runner(service, directory, "alice", command, {"SLICEBROKER_PROJECT": "vision"})

    assert runner.wait() == 0, runner.stderr
    slice_ = get_slice(service, runner.marker("started-1")["SLICEBROKER_SLICE_ID"])
    # The cluster's [defaults.batch]: protected 1 h, resumable.
    assert (slice_["project"], slice_["gpus"], slice_["kind"]) == ("vision", 1, "batch")
    assert (slice_["min_runtime"], slice_["resumable"]) == (3600.0, True)
    assert "requested: 1 GPU for project vision, protected 1h, resumable" in runner.stderr


def test_outside_a_session_a_run_without_a_project_is_one_line_status_2(service, tmp_path):
    runner = Runner(service, tmp_path, "alice", ["--", "true"], {"SLICEBROKER_PROJECT": ""})

    assert runner.wait() == 2
    assert runner.stderr.strip().splitlines() == [
        "error: no project: pass --project P (in a hub session, $SLICEBROKER_PROJECT "
        "names the session's project)"
    ]


def test_a_waiting_runner_shows_its_place_then_runs_when_gpus_free(long_lease_service, tmp_path):
    service = long_lease_service
    blockers = fill_cluster(service)
    runner = start_runner(service, tmp_path, "exit-0", gpus=4)
    wait_until(lambda: "position 1 in the queue" in runner.stderr, "a queue position", runner)
    line = next(x for x in runner.stderr.splitlines() if "position 1" in x)
    assert re.search(r"project at \d+\.\d\d× its share", line), line

    service.delete(f"/slices/{blockers[0]}", token=service.admin_token)
    assert runner.wait() == 0
    assert runner.marker("started-1")["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_waiting_runner_follows_its_request_replaced_by_an_alternative(
    long_lease_service, tmp_path
):
    service = long_lease_service
    blockers = fill_cluster(service)
    runner = start_runner(service, tmp_path, "exit-0", gpus=4)
    wait_until(lambda: "position 1 in the queue" in runner.stderr, "a queue position", runner)
    waiting = int(runner.stderr.split("slice ", 1)[1].split()[0])
    # alice takes "2 GPUs instead of 4" (slicebroker sooner --take): one step, broker-side
    two = {"project": "vision", "gpus": 2, "kind": "batch", "min_runtime": 3600}
    reply = service.post(f"/slices/{waiting}/replace", token=service.token("alice"), json=two)
    assert reply.status_code == 201, reply.text
    new = reply.json()["id"]
    wait_until(lambda: f"replaced by slice {new}" in runner.stderr, "the runner to follow", runner)

    service.delete(f"/slices/{blockers[0]}", token=service.admin_token)
    assert runner.wait() == 0
    assert runner.marker("started-1")["SLICEBROKER_SLICE_ID"] == str(new)
    assert len(runner.marker("started-1")["CUDA_VISIBLE_DEVICES"].split(",")) == 2


def test_a_gang_sees_every_placement_and_this_hosts_gpus(tmp_path):
    host = socket.gethostname().split(".")[0]
    config = CONFIG.replace('name = "n1"', f'name = "{host}"')
    with running_service(tmp_path / "broker", config=config, pass_interval=1) as service:
        env = {"CUDA_VISIBLE_DEVICES": "inherited"}
        runner = start_runner(service, tmp_path, "exit-0", gpus=8, env=env)  # both nodes
        assert runner.wait() == 0
    seen = runner.marker("started-1")
    placements = json.loads(seen["SLICEBROKER_PLACEMENTS"])
    assert sorted(p["node"] for p in placements) == sorted(["n0", host])
    assert all(p["gpu_indices"] == [0, 1, 2, 3] for p in placements)
    assert seen["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # this host's share of the gang
    assert f"{host} GPUs 0,1,2,3" in runner.stderr and "n0 GPUs 0,1,2,3" in runner.stderr


def test_the_broker_refusing_the_request_is_one_line_status_1(service, tmp_path):
    runner = start_runner(service, tmp_path, "exit-0", project="nlp")  # alice: not a member
    assert runner.wait() == 1
    (line,) = runner.stderr.strip().splitlines()
    assert line == "error: 'alice' is not a member of project 'nlp' (HTTP 403, forbidden)"
    assert not list(runner.directory.glob("started-*"))


def test_a_command_that_cannot_start_is_one_line_status_127_and_the_slice_released(
    service, tmp_path
):
    args = ["--project", "vision", "--gpus", "1", "--min-runtime", "2s", "--", "no-such-cmd"]
    runner = Runner(service, tmp_path, "alice", args, {})
    assert runner.wait() == 127
    line = runner.stderr.strip().splitlines()[-1]
    assert line == "error: cannot run 'no-such-cmd': No such file or directory"
    slice_id = runner.stderr.split("slice ", 1)[1].split()[0]
    assert get_slice(service, slice_id)["end_reason"] == "released"


# ---- preemption ------------------------------------------------------------------------


def drain_where(service: BrokerService, seen: dict[str, str]) -> dict:
    """Drain the node the command runs on; the slice as it was."""
    slice_ = get_slice(service, seen["SLICEBROKER_SLICE_ID"])
    node = slice_["placements"][0]["node"]
    answer = service.post(f"/nodes/{node}/drain", token=service.admin_token, json={})
    assert answer.status_code == 200, answer.text
    return slice_


def test_a_preempted_resumable_command_gets_sigterm_then_runs_again(service, tmp_path):
    runner = start_runner(service, tmp_path, "wait-once", "--resumable", gpus=4)
    first = drain_where(service, runner.marker("started-1"))

    term = runner.marker("term-1")  # SIGTERM once the 2 s protection ended
    second = runner.marker("started-2")
    assert runner.wait() == 0  # the second run's status

    assert term["SLICEBROKER_SLICE_ID"] == str(first["id"])
    first = get_slice(service, first["id"])
    assert (first["preempt_reason"], first["end_reason"]) == ("drain", "released")
    again = get_slice(service, second["SLICEBROKER_SLICE_ID"])
    assert again["id"] != first["id"]  # the command gave the GPUs back early: a new request
    # ... in the first one's place, its preemption counted, as a requeued slice's would be
    assert (again["submitted_at"], again["preemptions"]) == (first["submitted_at"], 1)
    assert f"requested slice {again['id']} with the same terms, in its place" in runner.stderr
    # protected twice as long (preemption_backoff), as the broker's requeue would
    assert (again["min_runtime"], again["resumable"], again["gpus"]) == (4.0, True, 4)
    assert again["placements"][0]["node"] != first["placements"][0]["node"]  # not the drained one
    assert second["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert f"slice {first['id']} preempted (drain)" in runner.stderr
    assert again["end_reason"] == "released"


def test_a_node_going_down_requeues_the_same_slice_and_the_command_runs_again(service, tmp_path):
    runner = start_runner(service, tmp_path, "wait-once", "--resumable", "--grace-kill", "5")
    first = get_slice(service, runner.marker("started-1")["SLICEBROKER_SLICE_ID"])
    node = first["placements"][0]["node"]
    service.post(f"/nodes/{node}/down", token=service.admin_token, json={"reason": "test"})

    assert runner.marker("term-1")  # at once: a down node has no grace period
    second = runner.marker("started-2")
    assert runner.wait() == 0

    assert second["SLICEBROKER_SLICE_ID"] == str(first["id"])  # requeued by the broker
    again = get_slice(service, first["id"])
    assert again["placements"][0]["node"] != node
    assert "lost its GPUs and was requeued" in runner.stderr
    assert again["end_reason"] == "released"


def test_a_command_ignoring_sigterm_is_killed_at_the_deadline(service, tmp_path):
    runner = start_runner(service, tmp_path, "ignore-term", "--no-resumable")
    slice_ = drain_where(service, runner.marker("started-1"))

    assert runner.wait() == 128 + signal.SIGKILL
    slice_ = get_slice(service, slice_["id"])
    assert slice_["state"] == "ended"
    assert "SIGKILL" in runner.stderr
    assert "not resumable" in runner.stderr
    # killed at the deadline: the slice never outlived its grace period
    assert slice_["ended_at"] <= slice_["granted_at"] + 2 + 1 + 1.5


# ---- the runner interrupted ---------------------------------------------------------------


def test_sigterm_to_the_runner_is_passed_on_and_the_slice_released(service, tmp_path):
    runner = start_runner(service, tmp_path, "wait")
    seen = runner.marker("started-1")

    runner.process.send_signal(signal.SIGTERM)

    assert runner.wait() == 3  # the command's status: its handler exits 3
    assert runner.marker("term-1")
    slice_ = get_slice(service, seen["SLICEBROKER_SLICE_ID"])
    assert (slice_["state"], slice_["end_reason"]) == ("ended", "released")
    charged = slice_["charged_gpu_seconds"] / 3600
    assert f"slice {slice_['id']} released, charged {charged:.2f} GPU-h" in runner.stderr


def test_ctrl_c_while_waiting_withdraws_the_request(long_lease_service, tmp_path):
    service = long_lease_service
    fill_cluster(service)
    runner = start_runner(service, tmp_path, "exit-0", gpus=4)
    wait_until(lambda: "waiting" in runner.stderr, "the runner to wait", runner)

    runner.process.send_signal(signal.SIGINT)

    assert runner.wait() == 128 + signal.SIGINT
    slice_id = runner.stderr.split("slice ", 1)[1].split()[0]
    assert get_slice(service, slice_id)["end_reason"] == "cancelled"
    assert not list(runner.directory.glob("started-*"))
    assert f"slice {slice_id} released, charged 0.00 GPU-h" in runner.stderr
