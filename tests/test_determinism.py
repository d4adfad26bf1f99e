"""The same snapshot gives the same decisions in every process.

Python salts the hash of strings per process (``PYTHONHASHSEED``), so a set or
dict of node, project or user names iterated in hash order gives a different
order in another process: a restarted broker, or a simulator run, would then
decide differently from the same state. Two processes with different seeds run
the same passes here and must print the same decisions.

Run as a script, this file prints the decisions of :func:`passes` as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from builders import HOUR, MIN, NOW, pending, running, snapshot

from broker.core.fairshare import ProjectTree
from broker.core.model import Account, Decisions, Node, NodeState, Policy, SliceKind
from broker.core.scheduler import schedule
from broker.core.transitions import apply

WEIGHTS = {"h100": 1.0, "b200": 2.0}


def cluster() -> tuple[list[Node], list[Account], dict]:
    """Nodes, a project tree and live slices that make a pass do a bit of everything:
    grants, gangs, preemptions of every kind, reservations, drains."""
    names = ["gpu-east-1", "gpu-west-2", "rack7-a", "rack7-b", "zeta", "alpha", "m", "q9"]
    nodes = [Node(n, "h100" if i % 3 else "b200", 8 if i % 2 else 4) for i, n in enumerate(names)]
    nodes += [Node(f"drain-{n}", "h100", 4, NodeState.DRAINING) for n in ("x", "y", "z", "w")]
    accounts = [
        Account("research", 2.0),
        Account("ops", 1.0),
        Account("vision", 1.0, "research"),
        Account("nlp", 1.0, "research"),
        Account("robotics", 3.0, "research"),
        Account("infra", 1.0, "ops"),
    ]
    live = [
        running("infra", "gpu-west-2", tuple(range(8)), min_runtime=MIN, granted_ago=HOUR),
        running("nlp", "rack7-b", (0, 1, 2, 3), min_runtime=0.0),
        running("nlp", "rack7-b", (4, 5), min_runtime=HOUR, granted_ago=2 * HOUR, priority=-1),
        running("vision", "zeta", (0,), min_runtime=0.0, user="bob"),
        running("robotics", "m", (0, 1, 2, 3, 4, 5, 6, 7), min_runtime=HOUR, granted_ago=MIN),
        running("vision", "drain-x", (0, 1), min_runtime=MIN, granted_ago=HOUR),
        running("infra", "drain-y", (0,), min_runtime=8 * HOUR, granted_ago=MIN),
        running("infra", "q9", (0, 1, 2, 3), kind=SliceKind.BATCH, granted_ago=HOUR),
    ]
    live += [
        pending("vision", 2, kind=SliceKind.INTERACTIVE, min_runtime=15 * MIN, user="ann"),
        pending("nlp", 8, priority=1),
        pending("robotics", 12, resumable=True),
        pending("infra", 1, min_runtime=0.0),
        pending("vision", 4, gpu_type="b200", max_runtime=2 * HOUR),
        pending("nlp", 1, kind=SliceKind.INTERACTIVE, min_runtime=10 * MIN, user="carl"),
        pending("robotics", 16),
        pending("infra", 3, min_runtime=0.0, kind=SliceKind.INTERACTIVE),
    ]
    # Ids of their own: the builders' counter depends on what ran before in this process.
    return nodes, accounts, {i: replace(s, id=i) for i, s in enumerate(live, start=1)}


def passes(count: int = 8) -> list[dict]:
    """``count`` passes, 20 minutes apart, each applied before the next."""
    nodes_list, accounts, live = cluster()
    nodes = {n.name: n for n in nodes_list}
    tree = ProjectTree(accounts)
    usage = {"vision": 4e5, "nlp": 1e5, "robotics": 9e5, "infra": 2e4}
    policy = Policy(grace_period=30.0, max_reservations=4, project_gpu_caps={"infra": 14})
    now, out = NOW, []
    for _ in range(count):
        snap = replace(
            snapshot(list(nodes.values()), accounts, list(live.values()), usage=usage, now=now),
            gpu_type_weights=WEIGHTS,
            policy=policy,
        )
        decisions = schedule(snap, tree)
        out.append(as_data(decisions))
        applied = apply(live, nodes, decisions, now, WEIGHTS)
        live, nodes = applied.slices, applied.nodes
        now += 20 * MIN
    return out


def as_data(decisions: Decisions) -> dict:
    """Everything a pass decided, in the order it decided it (not its timings)."""
    data = dataclasses.asdict(decisions)
    del data["phase_seconds"]
    data["queue"] = [list(entry) for entry in decisions.queue]
    return data


def decisions_with_seed(seed: str) -> str:
    process = subprocess.run(
        [sys.executable, __file__],
        # The broker of this checkout, whatever is installed.
        env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return process.stdout


def test_two_processes_with_different_hash_seeds_decide_the_same():
    first, second = decisions_with_seed("0"), decisions_with_seed("1")
    decided = json.loads(first)
    # The passes do what they are here for, so the comparison means something.
    assert any(d["node_changes"] for d in decided), "a drain is reported"
    assert any(d["preemptions"] for d in decided)
    assert any(r["promised"] is False for d in decided for r in d["reservations"])
    assert any(len(g["placements"]) > 1 for d in decided for g in d["grants"]), "a gang"
    assert first == second


def test_the_script_prints_what_this_process_decides():
    assert json.loads(decisions_with_seed("0")) == json.loads(json.dumps(passes()))


if __name__ == "__main__":
    json.dump(passes(), sys.stdout)
