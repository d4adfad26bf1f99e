"""The Slurm backend's pure parts, on tables: Slurm nodes -> broker nodes, the broker's drains
-> Slurm updates, and the broker's slices + Slurm's jobs -> what the executor does."""

from __future__ import annotations

from typing import Any

import pytest

from broker.core.model import Node, NodeState
from broker.slurm.drain import DRAINED_REASON, DrainUpdate, drain_updates
from broker.slurm.inventory import gpus_of, gres_request, inventory, node_state, nodes_from_slurm
from broker.slurm.jobs import Cancel, EndSlice, Signal, end_reason, job_comment, job_gpus, plan


def slurm_node(name: str = "gpu-a", **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "gres": "gpu:h100:4",
        "state": "idle",
        "state_flags": [],
        "reason": "",
        "partitions": ["slicebroker"],
        **fields,
    }


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:h100:4", {"h100": 4}),
        ("gpu:h100:4(S:0-1)", {"h100": 4}),
        ("gpu:4", {None: 4}),
        ("gpu:a100:2(S:0,1),gpu:h100:2,nic:1", {"a100": 2, "h100": 2}),
        ("(null)", {}),
        ("", {}),
        ("gpu:h100:0", {}),
    ],
)
def test_gpus_come_from_the_nodes_gres(gres, gpus):
    assert gpus_of(gres) == gpus


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        ({}, NodeState.READY),
        ({"state": "mixed"}, NodeState.READY),
        ({"state": "down", "state_flags": ["NOT_RESPONDING"]}, NodeState.DOWN),
        ({"state": "future"}, NodeState.DOWN),
        ({"state_flags": ["DRAIN"], "reason": "fan"}, NodeState.DRAINING),
        ({"state": "allocated", "state_flags": ["FAIL"]}, NodeState.DRAINING),
        ({"state_flags": ["MAINTENANCE"]}, NodeState.DRAINING),
        # The broker's own drain written back into Slurm: the broker holds that one itself.
        ({"state_flags": ["DRAIN"], "reason": "slicebroker: draining (x)"}, NodeState.READY),
        # ... but Slurm's failure of the same node is Slurm's.
        ({"state_flags": ["DRAIN", "FAIL"], "reason": "slicebroker: x"}, NodeState.DRAINING),
        # Not responding for a moment (a resume, a restart) is not down until Slurm says so.
        ({"state_flags": ["NOT_RESPONDING"]}, NodeState.READY),
    ],
)
def test_slurm_states_map_to_broker_states(fields, state):
    assert node_state(slurm_node(**fields)) is state


def test_a_node_with_two_gpu_types_is_a_broker_node_per_type_and_jobs_ask_for_the_type():
    nodes = nodes_from_slurm(slurm_node(gres="gpu:a100:2,gpu:H100:4"))
    assert nodes == [Node("gpu-a:H100", "h100", 4), Node("gpu-a:a100", "a100", 2)]
    assert gres_request("gpu-a:a100", 1) == "gpu:a100:1"
    assert gres_request("gpu-a", 3) == "gpu:3"


def test_only_the_brokers_partition_and_nodes_with_gpus_are_taken():
    objs = [
        slurm_node("gpu-b"),
        slurm_node("cpu-0", gres=""),
        slurm_node("gpu-other", partitions=["batch"]),
        slurm_node("gpu-a", gres="gpu:2"),
    ]
    assert inventory(objs, partition="slicebroker") == [
        Node("gpu-a", "gpu", 2),
        Node("gpu-b", "h100", 4),
    ]


def broker_node(state: str, drained_by: str | None = "admin", **fields: Any) -> dict[str, Any]:
    return {"name": "gpu-a", "state": state, "drained_by": drained_by, **fields}


@pytest.mark.parametrize(
    ("broker", "slurm", "updates"),
    [
        # The broker drains: Slurm is told, with the broker's reason.
        (
            broker_node("draining", state_reason="disk errors"),
            slurm_node(),
            [DrainUpdate("gpu-a", "drain", "slicebroker: draining (disk errors)")],
        ),
        # Drained in the broker: Slurm's reason says repair may proceed.
        (
            broker_node("drained"),
            slurm_node(state_flags=["DRAIN"], reason="slicebroker: draining (x)"),
            [DrainUpdate("gpu-a", "drain", DRAINED_REASON)],
        ),
        (broker_node("drained"), slurm_node(state_flags=["DRAIN"], reason=DRAINED_REASON), []),
        # Undrained in the broker: its own drain in Slurm is lifted ...
        (
            broker_node("ready", None),
            slurm_node(state_flags=["DRAIN"], reason=DRAINED_REASON),
            [DrainUpdate("gpu-a", "resume")],
        ),
        # ... and a drain someone set in Slurm never is.
        (broker_node("ready", None), slurm_node(state_flags=["DRAIN"], reason="fan"), []),
        (broker_node("draining", "inventory"), slurm_node(state_flags=["DRAIN"], reason="x"), []),
        # An admin's drain of a node Slurm already drains for its own reason: left as it is.
        (broker_node("draining"), slurm_node(state_flags=["DRAIN"], reason="fan"), []),
    ],
)
def test_the_brokers_drains_are_written_into_slurm(broker, slurm, updates):
    assert drain_updates([broker], [slurm]) == updates


def job(job_id: int, slice_id: int, state: str = "RUNNING", **fields: Any) -> dict[str, Any]:
    """A job of ``slice_id`` as the spawner submits it: on gpu-a with 2 GPUs."""
    return {
        "job_id": job_id,
        "comment": job_comment(slice_id),
        "job_state": state,
        "user_name": "alice",
        "nodes": "gpu-a",
        "tres_per_node": "gres:gpu:2",
        **fields,
    }


def live(slice_id: int, state: str = "granted", **fields: Any) -> dict[int, dict[str, Any]]:
    """A slice granted 2 GPUs of gpu-a."""
    placements = [{"node": "gpu-a", "gpu_indices": [0, 1]}]
    return {
        slice_id: {"id": slice_id, "state": state, "user": "alice", "placements": placements}
        | fields
    }


def test_a_preempted_slices_job_is_signalled_once_then_cancelled_at_the_grace_end():
    slices = live(1, "preempting", preempt_deadline=100.0, kind="batch")
    first = plan(slices, [job(10, 1)], now=90.0)
    assert first.signals == [Signal(10, 1, "full")] and not first.cancels
    assert plan(slices, [job(10, 1)], now=95.0, signalled={10}).signals == []
    assert plan(slices, [job(10, 1)], now=100.0, signalled={10}).cancels == [
        Cancel(10, 1, "its grace period is over")
    ]
    assert plan(slices, [job(10, 1)], now=90.0, signal=False).signals == []


def test_the_signal_scope_is_chosen_per_slice():
    slices = live(1, "preempting", preempt_deadline=100.0, kind="interactive")
    signals = plan(slices, [job(10, 1)], 90.0, full_signal=lambda s: s["kind"] == "batch").signals
    assert signals == [Signal(10, 1, "batch")]
    srun_job = job(10, 1, batch_flag=False)
    assert plan(slices, [srun_job], 90.0).signals == [Signal(10, 1, "steps")]


def test_a_job_whose_slice_ended_is_cancelled_and_other_jobs_are_left_alone():
    jobs = [job(10, 1), job(11, 2), {"job_id": 12, "comment": "", "job_state": "RUNNING"}]
    result = plan(live(2), jobs, now=0.0)
    assert result.cancels == [Cancel(10, 1, "its slice has ended")]
    assert not result.signals and not result.ends


def test_a_job_that_ended_in_slurm_ends_its_slice_with_slurms_reason():
    failed = job(10, 1, "FAILED", exit_code=3 << 8, state_reason="NonZeroExitCode")
    assert plan(live(1), [failed], 0.0).ends == [
        EndSlice(1, "job 10 FAILED in Slurm (exit code 3)")
    ]
    lost = job(11, 1, "NODE_FAIL", exit_code=9)
    assert plan(live(1), [lost], 0.0).ends == [EndSlice(1, "job 11 NODE_FAIL in Slurm (signal 9)")]
    assert end_reason(job(12, 1, "COMPLETED", exit_code=0)) == "job 12 COMPLETED in Slurm"


def test_a_job_that_ended_leaves_its_holder_end_wait_seconds_to_release_the_slice():
    done = job(10, 1, "COMPLETED", end_time=100)
    assert plan(live(1), [done], now=104.0, end_wait=5.0).ends == []
    assert plan(live(1), [done], now=105.0, end_wait=5.0).ends != []


def test_only_the_slices_user_or_a_submitter_may_end_it_and_a_running_job_keeps_it():
    other = job(10, 1, "CANCELLED", user_name="mallory")
    assert plan(live(1), [other], 0.0).ends == []
    assert plan(live(1), [other], 0.0, submit_users=["mallory"]).ends != []
    # A job that ended beside one still running (a restart of the session) ends nothing.
    assert plan(live(1), [job(10, 1, "CANCELLED"), job(11, 1)], 0.0).ends == []
    # A pending slice has no job to lose.
    assert plan(live(1, "pending"), [job(10, 1, "CANCELLED")], 0.0).ends == []


@pytest.mark.parametrize(
    ("fields", "gpus"),
    [
        ({"tres_per_node": "gres:gpu:2"}, 2),
        ({"tres_per_node": "gres:gpu:h100:3"}, 3),
        ({"tres_per_node": "gres:nic:1,gres:gpu:1"}, 1),
        ({"tres_per_job": "gres:gpu:4"}, 4),
        ({"tres_per_node": ""}, 0),
    ],
)
def test_a_jobs_gpus_come_from_its_gres_request(fields, gpus):
    assert job_gpus(fields) == gpus


def test_a_job_off_its_grant_is_cancelled_and_ends_nothing():
    other_node = job(10, 1, nodes="gpu-b")
    more_gpus = job(11, 1, tres_per_node="gres:gpu:3")
    pending = job(12, 1, "PENDING", nodes="", required_nodes="gpu-b")
    result = plan(live(1), [other_node, more_gpus, pending], 0.0)
    assert [c.job_id for c in result.cancels] == [10, 11, 12]
    assert {c.why for c in result.cancels} == {"it is not on its slice's grant"}
    # A job pending on its grant (Slurm still ending the job before it) waits.
    assert (
        plan(live(1), [job(13, 1, "PENDING", nodes="", required_nodes="gpu-a")], 0.0).cancels == []
    )
    # A job of an earlier grant (before a requeue) does not end the slice's new grant,
    # on another node or on the same one.
    assert plan(live(1), [job(14, 1, "FAILED", nodes="gpu-b")], 0.0).ends == []
    regranted = live(1, granted_at=1000.0)
    earlier = job(15, 1, "CANCELLED", submit_time=900)
    assert plan(regranted, [earlier], 0.0).ends == []
    current = job(16, 1, "FAILED", submit_time=1000)
    assert [e.slice_id for e in plan(regranted, [earlier, current], 0.0).ends] == [1]


def test_a_job_of_a_slice_that_waits_is_cancelled_a_requeue_included():
    assert plan(live(1, "pending"), [job(10, 1)], 0.0).cancels == [
        Cancel(10, 1, "its slice is not granted")
    ]


def test_a_job_naming_no_slice_is_cancelled_only_with_cancel_strays():
    stray = {"job_id": 10, "comment": "", "job_state": "RUNNING"}
    assert plan({}, [stray], 0.0).cancels == []
    assert plan({}, [stray], 0.0, cancel_strays=True).cancels == [
        Cancel(10, 0, "it names no slice")
    ]
    done = {**stray, "job_state": "COMPLETED"}
    assert plan({}, [done], 0.0, cancel_strays=True).cancels == []
