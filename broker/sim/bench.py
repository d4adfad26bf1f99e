"""How fast the simulator runs: ``python -m broker.sim.bench``.

Simulates the first ``--sample-days`` of a generated workload submitting
``--slices`` jobs per ``--days`` (by default a month of one million), on the
cluster such a month needs, and extrapolates the time to the whole month.
The extrapolation is linear in simulated time; at a load above 1 the queue
grows through the month and later passes cost more, so run two sample
lengths and compare the rates before trusting it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .engine import SimConfig, Simulation
from .policies import POLICIES
from .workloads import GeneratorConfig, generate


def measure(
    policy: str, *, slices: int, days: float, sample_days: float, seed: int = 1, quantum: float = 1
) -> dict:
    share = min(1.0, sample_days / days)
    config = GeneratorConfig(days=days * share, slices=round(slices * share))
    workload = generate(config, seed=seed)
    scheduler = POLICIES[policy](workload.accounts)
    result = Simulation(workload, scheduler, SimConfig(quantum=quantum)).run()
    stats = result.stats
    simulated_days = days * share
    return {
        "policy": policy,
        "slices_per_month": slices * 30 / days,
        "sample_days": simulated_days,
        "sample_slices": len(workload.jobs),
        "nodes": len(workload.nodes),
        "gpus": workload.capacity,
        "passes": stats["passes"],
        "max_waiting": stats["max_waiting"],
        "cpu_seconds": stats["cpu_seconds"],
        "wall_seconds": stats["wall_seconds"],
        "policy_seconds": stats["pass_seconds"],
        "ms_per_pass": 1000 * stats["pass_seconds"] / max(1, stats["passes"]),
        "extrapolated_month_cpu_seconds": stats["cpu_seconds"] / simulated_days * days,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.sim.bench", description=__doc__)
    parser.add_argument("--slices", type=int, default=1_000_000, help="jobs per --days")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--sample-days", type=float, default=0.25)
    parser.add_argument("--policies", default="fairshare")
    parser.add_argument("--quantum", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for name in args.policies.split(","):
        row = measure(
            name,
            slices=args.slices,
            days=args.days,
            sample_days=args.sample_days,
            seed=args.seed,
            quantum=args.quantum,
        )
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
