"""Workloads: the Helios loader, the generic CSV format and the design.md §1 generator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from broker.core.fairshare import ProjectTree
from broker.core.model import HOUR, NodeState, SliceKind
from broker.errors import InvalidConfig
from broker.sim.workloads import (
    GeneratorConfig,
    Job,
    classify,
    generate,
    load_alibaba,
    load_csv,
    load_helios,
    load_tree_csv,
    write_csv,
)

# An excerpt of the Helios trace ships with the tests (tests/data/README.md says whence).
HELIOS = Path(__file__).resolve().parent / "data" / "helios_excerpt.csv"


@pytest.mark.parametrize(
    ("gpus", "runtime", "expected"),
    [
        pytest.param(1, 300, (SliceKind.INTERACTIVE, 900.0, False), id="small and short: debug"),
        pytest.param(2, 900, (SliceKind.INTERACTIVE, 900.0, False), id="2 GPUs, 15 min: debug"),
        pytest.param(4, 300, (SliceKind.BATCH, 900.0, False), id="4 GPUs is batch"),
        pytest.param(1, 1800, (SliceKind.BATCH, HOUR, False), id="up to an hour: whole run"),
        pytest.param(8, 5 * HOUR, (SliceKind.BATCH, HOUR, True), id="long: resumable"),
    ],
)
def test_classify_marks_small_short_jobs_as_debug_sessions(gpus, runtime, expected):
    assert classify(gpus, runtime) == expected


def test_helios_loader_keeps_gpu_jobs_and_sizes_the_cluster_for_the_load():
    w = load_helios(HELIOS, load=2.5)
    assert len(w.jobs) == 1_216  # GPU jobs of the excerpt's 1,500
    assert w.jobs[0].submit == 0 and all(
        a.submit <= b.submit for a, b in zip(w.jobs, w.jobs[1:], strict=False)
    )
    assert w.end / 86400 == pytest.approx(1.89, abs=0.01)
    assert w.offered_load() == pytest.approx(2.5, rel=0.03)
    assert max(j.gpus for j in w.jobs) == 32 <= w.capacity
    kinds = Counter(j.kind for j in w.jobs)
    debug = sum(1 for j in w.jobs if j.gpus <= 2 and j.duration <= 900)
    assert kinds[SliceKind.INTERACTIVE] == debug
    tree = ProjectTree(w.accounts)
    assert {j.project for j in w.jobs} <= set(tree.projects)
    users = {j.user: j.project for j in w.jobs}
    assert all(users[j.user] == j.project for j in w.jobs)  # one project per user


def test_helios_loader_says_where_it_looked_when_the_trace_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="Helios trace not found"):
        load_helios(tmp_path / "nope.csv")


ALIBABA_PODS = """\
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,12000,16384,1,1000,,LS,Running,0,90000,0
p1,6000,12288,1,460,,LS,Running,500000,500600,500010
p2,6000,12288,1,460,,LS,Running,500001,500301,500011
p3,4000,8192,0,0,,BE,Running,500002,500900,500002
p4,8000,32768,8,1000,,BE,Failed,500003,510003,500003
p5,8000,32768,2,1000,,LS,Pending,500004,510004,
p6,6000,12288,1,460,,LS,Running,500005,507205,500005
"""
ALIBABA_NODES = """\
sn,cpu_milli,memory_mib,gpu,model
n0,64000,262144,2,P100
n1,96000,786432,8,G2
n2,64000,262144,0,CPU
n3,96000,393216,4,V100M16
"""


def test_alibaba_loader_reads_pods_as_whole_gpu_jobs_on_the_traces_own_nodes(tmp_path):
    (tmp_path / "openb_pods.csv").write_text(ALIBABA_PODS)
    (tmp_path / "openb_nodes.csv").write_text(ALIBABA_NODES)
    w = load_alibaba(tmp_path / "openb_pods.csv", days=1.0, failures=False)
    # CPU-only p3 and never-scheduled p5 are left out; the rest in creation order
    assert [j.gpus for j in w.jobs] == [1, 1, 1, 8, 1]  # a GPU share asks for a whole GPU
    assert [j.duration for j in w.jobs] == [90000.0, 590.0, 290.0, 10000.0, 7200.0]
    assert all(a.submit <= b.submit for a, b in zip(w.jobs, w.jobs[1:], strict=False))
    assert w.end <= 86400.0
    # best effort is free work; the rest is classified as Helios jobs are
    free = w.jobs[3]
    assert (free.min_runtime, free.resumable) == (0.0, True)
    assert w.jobs[1].kind is SliceKind.INTERACTIVE and w.jobs[1].min_runtime == 900.0
    # p1 and p2 share one spec and come one after the other: one deployment, one user
    assert w.jobs[1].user == w.jobs[2].user != w.jobs[4].user
    # the nodes come from the trace's list (GPU nodes only), with room for the 8-GPU pod
    assert {(n.gpu_type, n.gpu_count) for n in w.nodes} <= {("p100", 2), ("g2", 8), ("v100m16", 4)}
    assert max(n.gpu_count for n in w.nodes) == 8


def test_simulate_alibaba_runs_on_the_pod_list_and_its_node_list(tmp_path, capsys):
    from broker.sim.cli import main

    (tmp_path / "openb_pods.csv").write_text(ALIBABA_PODS)
    (tmp_path / "openb_nodes.csv").write_text(ALIBABA_NODES)
    out = tmp_path / "out.json"
    argv = ["alibaba", "--trace", str(tmp_path / "openb_pods.csv"), "--days", "1", "--no-failures"]
    assert main([*argv, "--policies", "fairshare", "--quiet", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["policies"]["fairshare"]["summary"]
    assert 1 <= summary["completed"] <= 5  # of the 5 GPU pods
    capsys.readouterr()


def test_alibaba_loader_says_where_it_looked_when_the_trace_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="Alibaba pod list not found"):
        load_alibaba(tmp_path / "nope.csv")


def test_generic_csv_round_trips_and_fills_in_what_is_missing(tmp_path):
    jobs = [
        Job(0, 0.0, "ann", "p00", 1, 600.0, SliceKind.INTERACTIVE, 900.0),
        Job(1, 5.0, "bob", "p01", 16, 7200.0, SliceKind.BATCH, 3600.0, True, 86400.0, 2),
        Job(2, 9.0, "cid", "p02", 1, 86400.0, SliceKind.INTERACTIVE, 8 * HOUR, idle=True),
    ]
    path = tmp_path / "jobs.csv"
    write_csv(jobs, path)
    w = load_csv(path, nodes=4, failures=False)
    assert w.jobs == tuple(jobs) and w.capacity == 32
    minimal = tmp_path / "minimal.csv"
    minimal.write_text("submit,gpus,duration\n0,1,120\n30,8,7200\n")
    w = load_csv(minimal, nodes=1, failures=False)
    assert [(j.kind, j.min_runtime, j.resumable) for j in w.jobs] == [
        classify(1, 120),
        classify(8, 7200),
    ]
    assert w.jobs[0].user == "u0" and w.jobs[0].project == w.jobs[1].project


def test_generic_csv_round_trips_times_at_full_precision(tmp_path):
    # 1,821,773.25 s written with 6 significant digits read back as 1,821,770 s
    jobs = [
        Job(0, 1_821_773.25, "ann", "p00", 2, 3 * HOUR + 0.1, SliceKind.BATCH, 1234.5678),
        Job(1, 1_821_773.2500000002, "bob", "p01", 8, 86_400.0 / 7, max_runtime=2e6 / 3),
    ]
    path = tmp_path / "precise.csv"
    write_csv(jobs, path)
    assert load_csv(path, nodes=1, failures=False).jobs == tuple(jobs)
    generated = generate(GeneratorConfig(days=1, slices=200, users=10), seed=5).jobs
    write_csv(generated, path)
    assert load_csv(path, nodes=1, failures=False).jobs == generated


def test_generic_csv_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("submit,gpus,duration\n0,1,120\n5,two,60\n")
    with pytest.raises(InvalidConfig, match=r"bad\.csv:3"):
        load_csv(path, nodes=1)
    path.write_text("submit,gpus\n0,1\n")
    with pytest.raises(InvalidConfig, match="missing column"):
        load_csv(path, nodes=1)


def test_a_tree_file_gives_the_projects_and_their_shares(tmp_path):
    tree = tmp_path / "tree.csv"
    tree.write_text("name,share,parent\nlab,1,\nnlp,3,lab\nvision,1,lab\n")
    accounts = load_tree_csv(tree)
    assert ProjectTree(accounts).entitlements["nlp"] == pytest.approx(0.75)
    jobs = tmp_path / "jobs.csv"
    jobs.write_text("submit,gpus,duration,project\n0,1,60,nlp\n1,1,60,robotics\n")
    with pytest.raises(InvalidConfig, match="robotics"):
        load_csv(jobs, tree=accounts, nodes=1)


def test_generator_has_the_conditions_of_spec_section_1():
    config = GeneratorConfig(days=7, slices=3000, load=2.5)
    w = generate(config, seed=7)
    assert len({j.user for j in w.jobs}) > 100  # about 150 users, some quiet ones
    assert w.offered_load() == pytest.approx(2.5, rel=0.05)
    debug = [j for j in w.jobs if j.kind is SliceKind.INTERACTIVE and not j.idle]
    assert any(j.min_runtime == 15 * 60 and j.gpus <= 2 for j in debug)
    assert any(j.idle for j in w.jobs)  # squatters
    assert any(e.state is NodeState.DOWN for e in w.node_events)  # a node breaks
    assert any(e.state is NodeState.DRAINING for e in w.node_events)
    assert any(j.min_runtime == 0 for j in w.jobs)  # free, preemptible work


def test_generator_random_sources_are_per_purpose():
    base = GeneratorConfig(days=3, slices=500)
    a = generate(base, seed=1)
    assert generate(base, seed=1) == a
    calmer = generate(GeneratorConfig(days=3, slices=500, drains_per_day=3.0), seed=1)
    assert calmer.jobs == a.jobs and calmer.node_events != a.node_events
