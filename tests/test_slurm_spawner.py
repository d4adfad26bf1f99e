"""Notebook servers through a real hub onto a real Slurm: SlurmSliceBrokerSpawner (batchspawner's
SlurmSpawner behind the mixin) with the broker's nodes from Slurm (one Slurm and one hub per
module). The server is the stand-in (spawner.standin) run by batchspawner-singleuser in the job."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hubfixtures import HubProcess, proxy_available, wait_until
from slurmfixtures import NODE, PARTITION, SlurmCluster, slurm_cluster, slurm_missing

from broker.slurm.jobs import slice_of_job

pytest.importorskip("batchspawner")  # the slurm extra; CI installs it (the test extra)

from spawner.slurm import SlurmSliceBrokerSpawner

pytestmark = pytest.mark.skipif(
    (slurm_missing() or proxy_available()) is not None,
    reason=slurm_missing() or proxy_available() or "",
)

CLUSTER = """\
admins = ["admin"]

[policy]
window = "7d"
max_min_runtime = "1h"
grace_period = "4s"

[defaults.interactive]
min_runtime = "15m"
resumable = false

[defaults.batch]
min_runtime = "2s"
resumable = true

[gpu_types]
h100 = 1.0

[projects.root]

[projects.vision]
parent = "root"
users = ["alice", "bob"]
"""

HUB_CONFIG = """
import batchspawner  # noqa: F401 - registers batchspawner's API route in the hub
from traitlets import default

from spawner.slurm import SlurmSliceBrokerSpawner


class TestSlurmSpawner(SlurmSliceBrokerSpawner):
    # The test's users have no system accounts: no home, shell or user from the system.

    def user_env(self, env):
        return env

    @default("req_homedir")
    def _homedir(self):
        return {workdir!r}


c.JupyterHub.spawner_class = TestSlurmSpawner
c.SlurmSliceBrokerSpawner.exec_prefix = ""
# The job finds batchspawner-singleuser and the stand-in on the hub's paths; Slurm's
# commands (the hub's and the job's) find the test's Slurm by SLURM_CONF.
c.Spawner.env_keep = ["PATH", "PYTHONPATH", "SLURM_CONF"]
c.SlurmSliceBrokerSpawner.cmd = [{standin!r}]
c.SlurmSliceBrokerSpawner.state_exechost_exp = "127.0.0.1"
c.SlurmSliceBrokerSpawner.startup_poll_interval = 0.1
c.SliceBrokerMixin.max_gpus = 4  # the Slurm node's, not the cluster file's (it has none)
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from slurm_cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module")
def hub(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubProcess]:
    workdir = tmp_path_factory.mktemp("hub")
    # batchspawner-singleuser runs a Python script found on PATH or by path.
    standin = workdir / "standin"
    standin.write_text("from spawner.standin import main\n\nmain()\n")
    standin.chmod(0o755)
    hub = HubProcess(
        workdir,
        cluster=CLUSTER,
        broker_args=[
            "--pass-interval=1",
            "--lease=15",
            "--max-wait=5",
            "--BrokerApp.inventory_class=broker.slurm.inventory.SlurmInventory",
            f"--SlurmInventory.slurm_conf={slurm.conf}",
            "--SlurmInventory.poll_interval=0.5",
            "--SlurmInventory.job_interval=0.3",
            "--SlurmInventory.submit_users=root",
            "--SlurmInventory.command_timeout=3",
        ],
        extra_config=HUB_CONFIG.format(workdir=str(workdir), standin=str(standin)),
    )
    # The hub's own Slurm commands (sbatch, squeue, scancel) find Slurm by SLURM_CONF.
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(slurm.conf)
    try:
        hub.start()
        yield hub
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        hub.shutdown()


def slice_job(slurm: SlurmCluster, slice_id: int) -> dict[str, Any] | None:
    return next((j for j in slurm.jobs() if slice_of_job(j) == slice_id), None)


def test_a_notebook_runs_as_a_slurm_job_on_its_grant_and_one_that_waits_sees_the_queue(
    hub: HubProcess, slurm: SlurmCluster
):
    response = hub.start_server("alice", project="vision", gpus=2, protected="15m")
    assert response.status_code in (201, 202), response.text
    hub.wait_ready("alice", 60)
    s = hub.slice_of("alice")
    (placement,) = s["placements"]
    job = slice_job(slurm, s["id"])
    assert job is not None, slurm.jobs()
    assert (job["job_state"], job["nodes"], job["partition"]) == ("RUNNING", NODE, PARTITION)
    assert placement["node"] == NODE
    env = hub.user_get("alice", "env").json()
    assert env["SLURM_JOB_ID"] == str(job["job_id"])
    assert env["SLICEBROKER_SLICE_ID"] == str(s["id"])
    assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == len(placement["gpu_indices"]) == 2

    # 4 GPUs do not fit beside alice's 2: bob waits in the broker's queue, not in Slurm's.
    hub.start_server("bob", project="vision", gpus=4, protected="15m")
    events = hub.progress_events("bob", until=lambda e: "1st in the queue" in e.get("message", ""))
    queue = [e for e in events if "in the queue" in e.get("message", "")]
    assert queue and "estimated start" in queue[-1]["message"], events
    waiting = hub.slice_of("bob")
    assert waiting["state"] == "pending"
    assert slice_job(slurm, waiting["id"]) is None, "a job reached Slurm before its grant"

    hub.stop_server("alice")
    assert slice_job(slurm, s["id"])["job_state"] == "CANCELLED"
    assert hub.broker("GET", f"/slices/{s['id']}")["end_reason"] == "released"
    hub.wait_ready("bob", 60)
    job = slice_job(slurm, waiting["id"])
    assert (job["job_state"], job["nodes"]) == ("RUNNING", NODE)
    hub.stop_server("bob")


def test_a_preempted_session_gets_its_signal_keeps_its_grace_then_its_job_is_cancelled(
    hub: HubProcess, slurm: SlurmCluster
):
    hub.start_server("bob", project="vision", gpus=1, protected="2s")
    hub.wait_ready("bob", 60)
    s = hub.slice_of("bob")
    job_id = slice_job(slurm, s["id"])["job_id"]
    hub.broker("POST", f"/nodes/{NODE}/drain")
    try:
        preempting = hub.wait_slice(s["id"], "granted", 15)
        assert (preempting["state"], preempting["preempt_reason"]) == ("preempting", "drain")
        wait_until(
            lambda: (
                f"Job {job_id} of slice {s['id']}: SIGTERM sent (the batch script)"
                in hub.log_text()
            ),
            10,
            "the session's job to get the preemption signal",
        )
        assert time.time() < preempting["preempt_deadline"]
        assert hub.user_get("bob", "env").status_code == 200, "the server left before its grace"
        wait_until(lambda: hub.server("bob") is None, 30, "the hub to see the server stopped")
        assert time.time() >= preempting["preempt_deadline"]
        wait_until(lambda: (slice_job(slurm, s["id"]) or {}).get("job_state") == "CANCELLED", 20)
        assert hub.broker("GET", f"/slices/{s['id']}")["end_reason"] == "preempted"
        wait_until(
            lambda: hub.broker("GET", "/nodes")["nodes"][0]["state"] == "drained",
            10,
            "the empty node to be drained",
        )
    finally:
        hub.broker("POST", f"/nodes/{NODE}/undrain")


def test_a_slurm_restart_under_a_running_session_loses_neither_the_session_nor_its_slice(
    hub: HubProcess, slurm: SlurmCluster
):
    hub.start_server("alice", project="vision", gpus=1, protected="15m")
    hub.wait_ready("alice", 60)
    s = hub.slice_of("alice")
    job_id = slice_job(slurm, s["id"])["job_id"]
    query = f"squeue -h -j {job_id}"
    slurm.stop_slurm()
    failed = hub.log_text().count("Slurm jobs round failed")
    wait_until(
        lambda: hub.log_text().count("Slurm jobs round failed") > failed,
        15,
        "the broker to find Slurm away",
    )
    slurm.start_slurm()
    polls = hub.log_text().count(query)
    wait_until(lambda: hub.log_text().count(query) > polls, 20, "the hub to poll the job")
    assert (slice_job(slurm, s["id"]) or {}).get("job_state") == "RUNNING"
    assert hub.server("alice")["ready"]
    assert hub.user_get("alice", "env").status_code == 200
    assert hub.broker("GET", f"/slices/{s['id']}")["state"] == "granted"
    hub.stop_server("alice")


def test_the_job_script_is_pinned_to_the_grant_whatever_the_user_options_say():
    spawner = SlurmSliceBrokerSpawner()
    spawner.slice = {"id": 7, "placements": [{"node": "gpu-b:a100", "gpu_indices": [2, 3]}]}
    assert spawner.placement_subvars() == {
        "partition": "slicebroker",
        "nodelist": "gpu-b",
        "gres": "gpu:a100:2",
        "comment": "slicebroker:slice=7",
    }
    assert "--nodelist={{nodelist}}" in spawner.batch_submit_cmd
