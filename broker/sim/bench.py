"""How fast the simulator runs: ``python -m broker.sim.bench``.

Simulates the first ``--sample-days`` of a generated workload submitting
``--slices`` jobs per ``--days`` (by default a month of one million), on the
cluster such a month needs, and extrapolates the time to the whole month.
Two extrapolations: the whole sample's CPU time scaled to the month, and the
policy's time in the sample's last quarter (cluster full, queue building) at
its rate per simulated hour. Both are linear in simulated time; at a load
above 1 the queue grows through the month and later passes cost more, so
both are lower bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ..bench.options import SECONDS, number
from .engine import SimConfig, Simulation
from .policies import POLICIES
from .workloads import GeneratorConfig, generate


def measure(
    policy: str, *, slices: int, days: float, sample_days: float, seed: int = 1, quantum: float = 1
) -> dict:
    share = min(1.0, sample_days / days)
    config = GeneratorConfig(days=days * share, slices=round(slices * share))
    workload = generate(config, seed=seed)
    timed = _Timed(POLICIES[policy](workload.accounts))
    result = Simulation(workload, timed, SimConfig(quantum=quantum)).run()
    stats = result.stats
    simulated_days = days * share
    # the last quarter of the sample: the cluster full, the queue building up
    since = workload.end * 0.75
    tail = [seconds for at, seconds in timed.passes if at >= since]
    tail_hours = (workload.end - since) / 3600
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
        "last_quarter_passes_per_hour": len(tail) / tail_hours if tail_hours else None,
        "last_quarter_ms_per_pass": 1000 * sum(tail) / len(tail) if tail else None,
        "last_quarter_extrapolated_month_policy_seconds": (
            sum(tail) / tail_hours * 24 * days if tail_hours else None
        ),
    }


class _Timed:
    """A policy that notes when each pass ran and how long it took."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.policy = inner.policy
        self.passes: list[tuple[float, float]] = []
        # The engine tells a policy that keeps an index what changed (FairShare.expect);
        # timed, it must be told too, or it compares every live slice each pass.
        expect = getattr(inner, "expect", None)
        if expect is not None:
            self.expect = expect
        self.still_quiet = inner.still_quiet

    def __call__(self, snapshot, /):
        started = time.perf_counter()
        decisions = self.inner(snapshot)
        self.passes.append((snapshot.now, time.perf_counter() - started))
        return decisions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.sim.bench", description=__doc__)
    days = number(float, 1e-9, "days, above 0")
    parser.add_argument(
        "--slices",
        type=number(int, 1, "a whole number, 1 or more"),
        default=1_000_000,
        help="jobs per --days",
    )
    parser.add_argument(
        "--days", type=days, default=30.0, help="days the --slices arrive over (default 30)"
    )
    parser.add_argument(
        "--sample-days",
        type=days,
        default=0.25,
        help="days simulated, from the start (default 0.25: the first 6 hours)",
    )
    parser.add_argument(
        "--policies",
        default="fairshare",
        help=f"comma-separated, of {', '.join(POLICIES)} (default: fairshare)",
    )
    parser.add_argument(
        "--quantum", type=SECONDS, default=1.0, help="seconds events are rounded to (default 1)"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    # parser.error prints one line of usage and the message, and exits with status 2.
    if unknown or not names:
        parser.error(
            f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}"
        )
    for name in names:
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
