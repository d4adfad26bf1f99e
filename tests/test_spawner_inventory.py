"""spawner.inventory: nvidia-smi's answer -> broker nodes -> a cluster file the broker accepts."""

from __future__ import annotations

import subprocess
import tomllib
from types import SimpleNamespace

import pytest

from broker.config import DEMO_CONFIG, load_config, parse_config
from spawner.inventory import (
    QUERY,
    Gpu,
    LocalNode,
    cluster_toml,
    discover,
    dumps_toml,
    gpu_type_name,
    local_nodes,
    node_gpu_map,
    parse_gpus,
    query_gpus,
)

# `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader` as the driver prints it.
DGX_H100 = """\
0, NVIDIA H100 80GB HBM3, 81559 MiB
1, NVIDIA H100 80GB HBM3, 81559 MiB
2, NVIDIA H100 80GB HBM3, 81559 MiB
3, NVIDIA H100 80GB HBM3, 81559 MiB
4, NVIDIA H100 80GB HBM3, 81559 MiB
5, NVIDIA H100 80GB HBM3, 81559 MiB
6, NVIDIA H100 80GB HBM3, 81559 MiB
7, NVIDIA H100 80GB HBM3, 81559 MiB
"""
MIXED_WORKSTATION = """\
0, NVIDIA A100-SXM4-80GB, 81920 MiB
1, NVIDIA GeForce RTX 4090, 24564 MiB
2, NVIDIA A100-SXM4-80GB, 81920 MiB
"""


def test_parse_reads_every_gpu_of_a_dgx():
    gpus = parse_gpus(DGX_H100)
    assert len(gpus) == 8
    assert gpus[0] == Gpu(0, "NVIDIA H100 80GB HBM3", 81559)
    assert [g.index for g in gpus] == list(range(8))


def test_parse_skips_blank_lines_and_keeps_unknown_memory():
    assert parse_gpus("\n0, NVIDIA H200, [N/A]\n\n") == [Gpu(0, "NVIDIA H200", None)]


def test_parse_names_a_line_it_cannot_read():
    with pytest.raises(ValueError, match="line 2"):
        parse_gpus("0, NVIDIA H200, 143771 MiB\nNo devices were found\n")


@pytest.mark.parametrize(
    ("model", "gpu_type"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA L40S", "l40s"),
        ("", "gpu"),
    ],
)
def test_gpu_type_names_are_short_and_stable(model, gpu_type):
    assert gpu_type_name(model) == gpu_type


def test_a_machine_of_one_model_is_one_node_named_after_the_host():
    nodes = local_nodes(parse_gpus(DGX_H100), "gpu-07.cluster.example.org")
    assert nodes == [LocalNode("gpu-07", "h100", tuple(range(8)))]
    assert node_gpu_map(nodes) == {}


def test_a_machine_of_several_models_is_one_node_per_model_with_a_gpu_map():
    nodes = local_nodes(parse_gpus(MIXED_WORKSTATION), "ws")
    assert nodes == [LocalNode("ws-a100", "a100", (0, 2)), LocalNode("ws-rtx4090", "rtx4090", (1,))]
    assert node_gpu_map(nodes) == {"ws-a100": [0, 2], "ws-rtx4090": [1]}


def test_the_cluster_file_keeps_the_demo_projects_and_lists_the_gpus():
    text = cluster_toml(local_nodes(parse_gpus(MIXED_WORKSTATION), "ws"))
    config = parse_config(tomllib.loads(text))
    demo = load_config(DEMO_CONFIG)

    assert [(n.name, n.gpu_type, n.gpu_count) for n in config.nodes] == [
        ("ws-a100", "a100", 2),
        ("ws-rtx4090", "rtx4090", 1),
    ]
    assert config.gpu_type_weights["a100"] == 1.0 and config.gpu_type_weights["b200"] == 2.0
    assert config.accounts == demo.accounts
    assert config.members == demo.members
    assert config.policy == demo.policy
    assert config.defaults == demo.defaults


def test_toml_round_trips_the_demo_configuration():
    with open(DEMO_CONFIG, "rb") as file:
        data = tomllib.load(file)
    assert tomllib.loads(dumps_toml(data)) == data
    assert tomllib.loads(dumps_toml({"a.b": {"c d": [1, 2.5, 'x"y']}})) == {
        "a.b": {"c d": [1, 2.5, 'x"y']}
    }


def test_discover_writes_the_file_for_the_gpus_found(tmp_path):
    found = discover(tmp_path / "cluster.toml", query=lambda: DGX_H100, host="box")
    assert found.discovered and found.config_path == tmp_path / "cluster.toml"
    assert load_config(found.config_path).nodes[0].gpu_count == 8
    assert "box: 8 x h100" in found.describe()


def test_without_gpus_the_declared_demo_inventory_is_used(tmp_path):
    found = discover(tmp_path / "cluster.toml", query=lambda: None)
    assert not found.discovered
    assert found.config_path == DEMO_CONFIG
    assert not (tmp_path / "cluster.toml").exists()
    assert "declared inventory" in found.describe()


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (SimpleNamespace(returncode=0, stdout=DGX_H100), DGX_H100),
        (SimpleNamespace(returncode=9, stdout=""), None),  # driver not loaded
        (FileNotFoundError("nvidia-smi"), None),
        (subprocess.TimeoutExpired(QUERY, 20), None),
    ],
)
def test_the_query_runs_nvidia_smi_and_survives_its_failures(outcome, expected):
    def run(command, **_kwargs):
        assert command == QUERY
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    assert query_gpus(run) == expected
