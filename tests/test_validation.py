"""Checks on a slice request before it is queued."""

from __future__ import annotations

import pytest

from broker.core.fairshare import ProjectTree
from broker.core.model import HOUR, Account, Node, NodeState, Policy
from broker.errors import InvalidRequest
from broker.validation import validate_slice_request

TREE = ProjectTree(
    [
        Account("org"),
        Account("research", share=7, parent="org"),
        Account("vision", parent="research"),
        Account("nlp", parent="research"),
        Account("infra", share=3, parent="org"),
    ]
)
NODES = (
    Node("h-0", "h100", 8),
    Node("h-1", "h100", 8),
    Node("h-2", "h100", 4, NodeState.DRAINING),
    Node("b-0", "b200", 4),
)
POLICY = Policy(max_min_runtime=8 * HOUR, project_gpu_caps={"nlp": 12})
GPU_TYPES = ("h100", "b200", "h100-1g.10gb")


def request(**overrides) -> dict:
    """A valid interactive request, with ``overrides``."""
    fields = {
        "gpus": 1,
        "kind": "interactive",
        "min_runtime": HOUR,
        "max_runtime": None,
        "gpu_type": "h100",
        "priority": 0,
        "project": "vision",
        "tree": TREE,
        "nodes": NODES,
        "policy": POLICY,
        "known_gpu_types": GPU_TYPES,
    }
    fields.update(overrides)
    return fields


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="a one-GPU interactive session is valid"),
        pytest.param({"kind": "batch", "gpus": 20}, id="a batch slice may span nodes of its type"),
        pytest.param({"gpus": 8}, id="an interactive slice may take a whole node"),
        pytest.param({"min_runtime": 0}, id="min_runtime 0 asks for an unallocated slice"),
        pytest.param({"min_runtime": 8 * HOUR}, id="min_runtime may equal the cap"),
        pytest.param({"max_runtime": HOUR}, id="max_runtime may equal min_runtime"),
        pytest.param({"max_runtime": 2.5 * HOUR}, id="max_runtime may be a float"),
        pytest.param({"gpu_type": None, "gpus": 8}, id="no gpu_type fits the largest node"),
        pytest.param(
            {"gpu_type": None, "kind": "batch", "gpus": 24},
            id="a batch slice of no type fits in all the GPUs",
        ),
        pytest.param({"priority": -100}, id="priority may be as low as -100"),
        pytest.param({"priority": 100}, id="priority may be as high as 100"),
        pytest.param({"project": "nlp", "kind": "batch", "gpus": 12}, id="a slice at its cap"),
        pytest.param({"kind": "batch"}, id="kind may be given as text"),
    ],
)
def test_valid_requests_pass(overrides):
    validate_slice_request(**request(**overrides))


INVALID = [
    # (id, overrides, part of the message)
    ("zero GPUs are refused", {"gpus": 0}, "gpus must be a whole number >= 1, got 0"),
    ("negative GPUs are refused", {"gpus": -2}, "got -2"),
    ("a fractional GPU count is refused", {"gpus": 1.5}, "got 1.5"),
    ("a GPU count given as text is refused", {"gpus": "2"}, "got '2'"),
    ("a boolean GPU count is refused", {"gpus": True}, "got True"),
    ("an unknown kind is refused", {"kind": "debug"}, "unknown kind 'debug'"),
    ("a kind that is not text is refused", {"kind": None}, "expected interactive or batch"),
    ("a negative min_runtime is refused", {"min_runtime": -1}, "must not be negative"),
    (
        "a min_runtime over the cap names the cap in hours",
        {"min_runtime": 9 * HOUR},
        "min_runtime 9h is above the cap of 8h",
    ),
    ("a min_runtime given as text is refused", {"min_runtime": "1h"}, "number of seconds"),
    ("a boolean min_runtime is refused", {"min_runtime": False}, "number of seconds"),
    ("an infinite min_runtime is refused", {"min_runtime": float("inf")}, "number of seconds"),
    ("a zero max_runtime is refused", {"max_runtime": 0}, "max_runtime must be > 0"),
    ("a negative max_runtime is refused", {"max_runtime": -60}, "must not be negative"),
    (
        "a max_runtime below min_runtime is refused",
        {"max_runtime": 1800},
        "max_runtime 30m is below min_runtime 1h",
    ),
    ("a priority over 100 is refused", {"priority": 101}, "from -100 to 100, got 101"),
    ("a priority under -100 is refused", {"priority": -101}, "got -101"),
    ("a fractional priority is refused", {"priority": 1.5}, "got 1.5"),
    ("a boolean priority is refused", {"priority": True}, "got True"),
    ("an unknown project is refused", {"project": "visoin"}, "unknown project 'visoin'"),
    ("a project that is not text is refused", {"project": None}, "unknown project None"),
    (
        "an account with sub-projects cannot be charged",
        {"project": "research"},
        "'research' is an account with sub-projects (nlp, vision)",
    ),
    ("an unknown GPU type is refused", {"gpu_type": "h200"}, "unknown gpu_type 'h200'"),
    (
        "a known GPU type with no nodes is refused",
        {"gpu_type": "h100-1g.10gb"},
        "the cluster has no h100-1g.10gb GPUs",
    ),
    (
        "an interactive slice larger than the largest node of its type is refused",
        {"gpus": 5, "gpu_type": "b200"},
        "the largest node has 4 b200 GPUs, asked for 5",
    ),
    (
        "an interactive slice larger than any node is refused",
        {"gpus": 9, "gpu_type": None},
        "the largest node has 8 GPUs, asked for 9",
    ),
    (
        "a batch slice larger than all GPUs of its type is refused",
        {"kind": "batch", "gpus": 21},
        "the cluster has 20 h100 GPUs in all, asked for 21",
    ),
    (
        "a batch slice larger than the whole cluster is refused",
        {"kind": "batch", "gpus": 25, "gpu_type": None},
        "the cluster has 24 GPUs in all",
    ),
    ("a cluster without nodes refuses every request", {"nodes": ()}, "the cluster has no h100"),
    (
        "a slice above its project's GPU cap is refused",
        {"project": "nlp", "kind": "batch", "gpus": 13},
        "project 'nlp' may hold at most 12 GPUs at once",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [pytest.param(overrides, message, id=name) for name, overrides, message in INVALID],
)
def test_invalid_requests_are_refused_with_a_reason(overrides, message):
    with pytest.raises(InvalidRequest) as caught:
        validate_slice_request(**request(**overrides))
    assert message in str(caught.value)
    assert caught.value.status == 400
    assert caught.value.code == "invalid_request"


def test_nodes_may_be_any_iterable():
    validate_slice_request(**request(nodes=iter(NODES), known_gpu_types=iter(GPU_TYPES)))
