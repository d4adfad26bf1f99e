"""``slicebroker simulate``: run policies side by side on a workload and report.

Wired into ``slicebroker`` with :func:`add_parser` (it sets ``handler``), and
runnable alone as ``python -m broker.sim``. Errors a user can fix are one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from ..core.model import HOUR, PASS_INTERVAL, Policy
from ..errors import InvalidConfig
from .engine import Result, SimConfig, Simulation
from .policies import POLICIES
from .report import comparison, goals_markdown, seeds_markdown, table, write_report
from .workloads import (
    ALIBABA_DAYS,
    DEFAULT_LOAD,
    GeneratorConfig,
    Workload,
    generate,
    load_alibaba,
    load_csv,
    load_helios,
    load_tree_csv,
)

USAGE_ERROR = 2

EXAMPLES = """\
examples:
  slicebroker simulate helios --trace helios.csv --report docs/sim
  slicebroker simulate generate --slices 20000 --days 30 --report docs/sim
  slicebroker simulate csv --trace jobs.csv --tree tree.csv --nodes 40 --json out.json
  slicebroker simulate alibaba --trace openb_pod_list.csv --report docs/sim
  python -m broker.sim helios --trace helios.csv --policies fairshare --limit 2000
  python -m broker.sim helios --trace helios.csv --policies fairshare --limit 4000 --seeds 1,2,3
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``simulate`` to a ``slicebroker``-style subparsers object."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay or generate a workload and compare scheduling policies",
        description="Run the real scheduling pass and baseline policies side by side on a "
        "workload with a simulated clock, and report waits, occupancy, owed GPU-hours, "
        "preemptions and drains (see docs/simulator.md).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(handler=run)
    return parser


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "workload",
        choices=("helios", "alibaba", "generate", "csv"),
        help="helios: the Helios trace; alibaba: Alibaba's GPU pods (openb); generate: the "
        "conditions of design.md §1; csv: a trace in the generic CSV format",
    )
    parser.add_argument(
        "--trace",
        metavar="PATH",
        help="the trace file, required but for generate (helios: the Helios trace as CSV; "
        "alibaba: the pod list, its node list beside it; csv: jobs; see docs/simulator.md)",
    )
    parser.add_argument("--tree", metavar="PATH", help="csv: project tree (name,share,parent)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)} (default: all)",
    )
    size = parser.add_argument_group("cluster")
    size.add_argument(
        "--load",
        type=float,
        default=DEFAULT_LOAD,
        help="size the cluster so that the jobs ask this many times its GPU-time "
        f"(default {DEFAULT_LOAD}: demand 2-3x capacity, design.md §1)",
    )
    size.add_argument("--nodes", type=int, help="a cluster of this many nodes instead")
    size.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    size.add_argument("--no-failures", action="store_true", help="no drains or node failures")
    gen = parser.add_argument_group("generate")
    gen.add_argument(
        "--days",
        type=float,
        help=f"generate: length (default 30); alibaba: days the arrivals are pressed into "
        f"(default {ALIBABA_DAYS:g})",
    )
    gen.add_argument("--slices", type=int, default=20_000, help="jobs submitted (default 20000)")
    gen.add_argument("--users", type=int, default=150, help="users (default 150)")
    parser.add_argument("--limit", type=int, help="helios, alibaba: only the first N GPU jobs")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random source")
    parser.add_argument(
        "--seeds",
        help="run once per seed (comma-separated, e.g. 1,2,3) and print each headline "
        "figure per seed and its mean, instead of --seed's one run",
    )
    sim = parser.add_argument_group("simulation")
    sim.add_argument(
        "--quantum",
        type=float,
        default=1.0,
        help="seconds of events handled together before one pass (default 1)",
    )
    sim.add_argument(
        "--tick",
        type=float,
        default=PASS_INTERVAL,
        help="a pass at least this often (s) while work waits; by default the "
        "service's own pass interval",
    )
    sim.add_argument("--grace", type=float, default=60.0, help="preemption grace period (s)")
    sim.add_argument(
        "--debug-headroom",
        type=int,
        default=0,
        metavar="N",
        help="free GPUs kept for debug sessions (policy debug_headroom; 0)",
    )
    sim.add_argument(
        "--debug-first",
        action="store_true",
        help="debug sessions the lane admits take free GPUs ahead of batch (policy debug_first)",
    )
    sim.add_argument(
        "--preemption-backoff",
        type=float,
        default=2.0,
        metavar="F",
        help="a preempted job's next protection is F times its last, up to max_min_runtime "
        "(policy preemption_backoff; 2, 1 = off)",
    )
    sim.add_argument(
        "--batch-preemption-delay",
        type=float,
        default=15 * 60.0,
        metavar="S",
        help="seconds a batch request waits for releases before it may preempt "
        "(policy batch_preemption_delay; 900)",
    )
    sim.add_argument(
        "--debug-preemption-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds a debug session waits for releases before it may preempt "
        "(policy debug_preemption_delay; 0)",
    )
    sim.add_argument(
        "--preemption-budget",
        type=int,
        default=5,
        metavar="K",
        help="preemptions a job may suffer, drains aside (policy preemption_budget; 5, "
        "0 = no budget)",
    )
    sim.add_argument(
        "--fair-share-margin",
        type=float,
        default=0.0,
        metavar="M",
        help="a fair-share move is judged as if the request moved its project by at least M "
        "shares (policy fair_share_margin; 0 = off)",
    )
    sim.add_argument(
        "--max-reservations",
        type=int,
        default=8,
        metavar="N",
        help="blocked requests, highest ranked first, that get a backfill reservation each "
        "pass (policy max_reservations; 8)",
    )
    sim.add_argument(
        "--debug-grace",
        type=float,
        default=20.0,
        metavar="S",
        help="grace of a batch slice preempted for a debug session (s) "
        "(policy debug_grace_period; 20)",
    )
    sim.add_argument(
        "--restart-cost",
        type=float,
        default=5 * 60.0,
        metavar="S",
        help="seconds a preempted (or failed) resumable job spends restarting on its GPUs "
        "before it works again (default 300)",
    )
    sim.add_argument(
        "--checkpoint-interval",
        type=float,
        default=30 * 60.0,
        metavar="S",
        help="seconds of work between a resumable job's checkpoints, at a random phase per "
        "job; a preempted job loses its work since the last one (default 1800; 0: nothing lost)",
    )
    sim.add_argument(
        "--report-checkpoints",
        action="store_true",
        help="resumable jobs report each checkpoint to the broker (slicebroker checkpoint), "
        "which then takes, among otherwise equal victims, the one with the least work since",
    )
    sim.add_argument(
        "--drain-deadline",
        type=float,
        default=12.0,
        help="hours after which an unfinished drain needs a human (default 12)",
    )
    sim.add_argument(
        "--warmup",
        type=float,
        help="hours at the start left out of the figures, the cluster starting empty "
        "(default: 24, or a tenth of the run if shorter)",
    )
    sim.add_argument(
        "--check", action="store_true", help="assert design.md §5 invariants each pass"
    )
    sim.add_argument(
        "--jobs", type=int, default=1, help="policies (with --seeds: seeds) simulated in parallel"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--report", metavar="DIR", help="write JSON, Markdown and PNG plots here")
    out.add_argument("--json", metavar="FILE", help="write the figures as JSON here")
    out.add_argument("--no-plots", action="store_true", help="with --report: no PNG files")
    out.add_argument(
        "--name", help="name of the report files (default: the workload's, e.g. helios)"
    )
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")
    out.add_argument(
        "--verbose",
        action="store_true",
        help="log node events, drains and interventions on stderr, stamped with simulated time",
    )


def build_workload(args: argparse.Namespace) -> Workload:
    common = {"nodes": args.nodes, "load": args.load, "gpus_per_node": args.gpus_per_node}
    if args.workload != "generate" and not args.trace:
        raise InvalidConfig(f"{args.workload} needs --trace PATH")
    if args.workload == "helios":
        return load_helios(
            args.trace,
            seed=args.seed,
            failures=not args.no_failures,
            limit=args.limit,
            **common,
        )
    if args.workload == "alibaba":
        return load_alibaba(
            args.trace,
            days=args.days or ALIBABA_DAYS,
            seed=args.seed,
            failures=not args.no_failures,
            limit=args.limit,
            **common,
        )
    if args.workload == "csv":
        tree = load_tree_csv(args.tree) if args.tree else None
        return load_csv(
            args.trace, tree=tree, seed=args.seed, failures=not args.no_failures, **common
        )
    config = GeneratorConfig(
        days=args.days or 30.0,
        slices=args.slices,
        users=args.users,
        load=args.load,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
    )
    if args.no_failures:
        config = replace(config, drains_per_day=0.0, breaks=0)
    return generate(config, seed=args.seed)


def _simulate(
    workload: Workload, name: str, config: SimConfig, policy: Policy, verbose: bool = False
) -> Result:
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else None
    # The workload's objects live all run: keep the collector from scanning them again
    # and again as the run allocates.
    gc.freeze()
    return Simulation(workload, POLICIES[name](workload.accounts, policy), config, log=log).run()


def run(args: argparse.Namespace) -> int:
    """Run the comparison described by ``args``; the exit status."""
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        print(
            f"error: unknown policy {', '.join(unknown) or '(none)'}; choose from "
            f"{', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return USAGE_ERROR
    if not 0 <= args.fair_share_margin <= 1:
        print("error: --fair-share-margin takes shares, from 0 to 1", file=sys.stderr)
        return USAGE_ERROR
    if not args.preemption_backoff >= 1:  # also refuses nan
        print("error: --preemption-backoff takes a factor, 1 or more", file=sys.stderr)
        return USAGE_ERROR
    # Checked before the workload is built, which can take a while. Above 0 and
    # finite where 0 or less had divided by zero or stood the clock still (a tick or
    # quantum of 0 never moves it on); else 0 or more. None: not given.
    above, not_negative = "above 0", "0 or more"
    for option, value, what, bound in (
        ("--load", args.load, "a factor", above),
        ("--days", args.days, "days", above),
        ("--quantum", args.quantum, "seconds", above),
        ("--tick", args.tick, "seconds", above),
        ("--drain-deadline", args.drain_deadline, "hours", above),
        ("--slices", args.slices, "a count", above),
        ("--users", args.users, "a count", above),
        ("--limit", args.limit, "a count", above),
        ("--nodes", args.nodes, "a count", above),
        ("--gpus-per-node", args.gpus_per_node, "a count", above),
        ("--jobs", args.jobs, "a count", above),
        ("--debug-headroom", args.debug_headroom, "a number of GPUs", not_negative),
        ("--preemption-budget", args.preemption_budget, "a count", not_negative),
        ("--max-reservations", args.max_reservations, "a count", not_negative),
        ("--batch-preemption-delay", args.batch_preemption_delay, "seconds", not_negative),
        ("--debug-preemption-delay", args.debug_preemption_delay, "seconds", not_negative),
        ("--debug-grace", args.debug_grace, "seconds", not_negative),
        ("--restart-cost", args.restart_cost, "seconds", not_negative),
        ("--checkpoint-interval", args.checkpoint_interval, "seconds", not_negative),
        ("--grace", args.grace, "seconds", not_negative),
        ("--warmup", args.warmup, "hours", not_negative),
    ):
        if value is None:
            continue
        fits = math.isfinite(value) and value > 0 if bound is above else value >= 0  # not nan
        if not fits:
            print(f"error: {option} takes {what}, {bound}", file=sys.stderr)
            return USAGE_ERROR
    seeds = [args.seed]
    if args.seeds is not None:
        seeds = _seed_list(args.seeds)
        if seeds is None:
            print(f"error: --seeds takes distinct seeds such as 1,2,3, got {args.seeds!r}",
                  file=sys.stderr)  # fmt: skip
            return USAGE_ERROR
        if args.report:
            print("error: --report writes one run: give it --seed, not --seeds", file=sys.stderr)
            return USAGE_ERROR
    say = _teller(args.quiet)
    workloads: dict[int, tuple[argparse.Namespace, Workload]] = {}
    for seed in seeds:
        one = argparse.Namespace(**{**vars(args), "seed": seed})
        try:
            workloads[seed] = (one, build_workload(one))
        except FileNotFoundError as err:
            print(f"error: {err} (pass --trace PATH)", file=sys.stderr)
            return USAGE_ERROR
        except (InvalidConfig, ValueError, KeyError) as err:
            print(f"error: {err}", file=sys.stderr)
            return USAGE_ERROR
    if args.seeds is not None:
        compared = _compare_seeds(workloads, names, args.jobs)
        print(seeds_markdown(compared))
        if args.json:
            by_seed = {str(seed): data for seed, data in compared.items()}
            Path(args.json).write_text(json.dumps({"seeds": by_seed}, indent=1) + "\n")
        return 0
    workload, results = _simulate_all(args, workloads[args.seed][1], names, say)
    data = comparison(workload, results)
    print(table(data))
    if "fairshare" in names:
        print()
        print(goals_markdown(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    if args.report:
        for path in write_report(args.report, workload, results, plots=not args.no_plots):
            say(f"wrote {path}")
    return 0


def _teller(quiet: bool) -> Callable[[str], None]:
    """Where progress goes: standard error, or nowhere with ``--quiet``."""
    return (lambda _: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))


def _compare_seeds(
    workloads: dict[int, tuple[argparse.Namespace, Workload]], names: list[str], jobs: int
) -> dict[int, dict]:
    """Each seed's comparison (:func:`~broker.sim.report.comparison`) of the policies
    ``names`` on its workload, ``jobs`` seeds at once, each in a process of its own."""
    if jobs <= 1:
        return {seed: _seed_comparison(*found, names) for seed, found in workloads.items()}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {
            seed: pool.submit(_seed_comparison, *found, names) for seed, found in workloads.items()
        }
        return {seed: future.result() for seed, future in futures.items()}


def _seed_comparison(args: argparse.Namespace, workload: Workload, names: list[str]) -> dict:
    """One seed's comparison; its policies one after the other (``--jobs`` spreads
    the seeds)."""
    alone = argparse.Namespace(**{**vars(args), "jobs": 1})
    return comparison(*_simulate_all(alone, workload, names, _teller(args.quiet)))


def _simulate_all(
    args: argparse.Namespace, workload: Workload, names: list[str], say: Callable[[str], None]
) -> tuple[Workload, list[Result]]:
    """Each policy of ``names`` simulated on ``workload`` as ``args`` says (progress
    told to ``say``); the workload as named for the report, and the results."""
    warmup = args.warmup * HOUR if args.warmup is not None else min(24 * HOUR, workload.end / 10)
    if args.name:
        workload = replace(workload, name=args.name)
    config = SimConfig(
        warmup=warmup,
        quantum=args.quantum,
        tick=args.tick,
        drain_deadline=args.drain_deadline * HOUR,
        restart_cost=args.restart_cost,
        checkpoint_interval=args.checkpoint_interval,
        report_checkpoints=args.report_checkpoints,
        seed=args.seed,
        check=args.check,
    )
    policy = Policy(
        grace_period=args.grace,
        debug_headroom=args.debug_headroom,
        debug_first=args.debug_first,
        preemption_backoff=args.preemption_backoff,
        batch_preemption_delay=args.batch_preemption_delay,
        debug_preemption_delay=args.debug_preemption_delay,
        preemption_budget=args.preemption_budget or None,
        fair_share_margin=args.fair_share_margin,
        max_reservations=args.max_reservations,
        debug_grace_period=args.debug_grace,
    )
    say(
        f"{workload.name}: {len(workload.jobs):,} jobs, {len(workload.nodes)} nodes "
        f"({workload.capacity} GPUs), offered load {workload.offered_load():.2f}"
    )
    results: list[Result] = []
    if args.jobs > 1 and len(names) > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [
                pool.submit(_simulate, workload, n, config, policy, args.verbose) for n in names
            ]
            for future in futures:
                results.append(future.result())
                say(_progress(results[-1]))
    else:
        for name in names:
            started = time.perf_counter()
            results.append(_simulate(workload, name, config, policy, args.verbose))
            say(_progress(results[-1]) + f" [{time.perf_counter() - started:.1f} s]")
    return workload, results


def _seed_list(text: str) -> list[int] | None:
    """``--seeds``: distinct whole numbers, comma-separated; None if it is not that."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        return None
    return seeds if seeds and len(set(seeds)) == len(seeds) else None


def _progress(result: Result) -> str:
    s = result.stats
    return (
        f"  {result.policy}: {s['passes']:,} passes, {s['pass_seconds']:.1f} s in the policy, "
        f"{s['wall_seconds']:.1f} s in all"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m broker.sim",
        description="Compare scheduling policies on a workload (slicebroker simulate).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    return run(parser.parse_args(argv))
