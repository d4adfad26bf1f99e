"""``python -m broker.bench [pass|storepass|api|writes|failover|spawn|kube|pages|whatif] ...``:
figures as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from ..orm import SCRATCH_POSTGRES_URL
from . import api, failover, kube, pages, scheduling, spawn, storepass, whatif, writes
from .options import COUNT, RATE, SECONDS, SOME, numbers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.bench", description=__doc__)
    sub = parser.add_subparsers(dest="which")
    passes = sub.add_parser("pass", help="time of one scheduling pass (default)")
    passes.add_argument("--repeat", type=COUNT, default=100, help="passes timed per size")
    passes.add_argument(
        "--factors",
        type=numbers(int, 1, "whole numbers, 1 or more"),
        default=[1, 8],
        help="sizes as multiples of 1,024 GPUs / 3,000 slices",
    )
    stored = sub.add_parser(
        "storepass", help="the service's pass (database included) with many running slices"
    )
    stored.add_argument("--live", type=SOME, default=10_000, help="running slices")
    stored.add_argument("--repeat", type=COUNT, default=40, help="passes timed")
    stored.add_argument(
        "--ledger", type=SOME, default=50_000, help="charges in the window's ledger"
    )
    load = sub.add_parser("api", help="the HTTP API under load from concurrent clients")
    load.add_argument(
        "--db",
        "--backend",
        choices=("sqlite", "postgresql", "postgres", "both"),
        default="both",
        help="database(s)",
    )
    load.add_argument("--clients", type=COUNT, default=200, help="concurrent clients")
    load.add_argument(
        "--seconds", "--duration", type=SECONDS, default=20.0, help="length of the run (per rate)"
    )
    load.add_argument(
        "--open-loop", action="store_true", help="requests at a fixed offered rate (issue #11)"
    )
    load.add_argument("--rate", type=RATE, default=500.0, help="open loop: requests/s offered")
    load.add_argument(
        "--sweep", action="store_true", help="open loop: step the rate until p99 > 100 ms"
    )
    load.add_argument(
        "--rates",
        type=numbers(float, 1e-9, "rates above 0"),
        default=list(api.SWEEP_RATES),
        help="sweep: the offered rates to step through, comma-separated",
    )
    load.add_argument(
        "--heartbeat-every",
        type=SECONDS,
        default=30.0,
        help="open loop: seconds between a session's heartbeats",
    )
    load.add_argument(
        "--hub-heartbeats",
        action="store_true",
        help="open loop: the broker's heartbeats come as a hub sends them, every "
        "session's together (POST /heartbeats, one out at a time), not one request each",
    )
    load.add_argument("--seed", type=int, default=1, help="open loop: the schedule's random seed")
    load.add_argument("--heartbeats", type=SOME, default=2, help="heartbeats per slice held")
    load.add_argument(
        "--postgres-url",
        default=SCRATCH_POSTGRES_URL,
        help="a PostgreSQL database to create the run's database from (trust auth on "
        "127.0.0.1:5432 by default; $SLICEBROKER_TEST_POSTGRES)",
    )
    written = sub.add_parser(
        "writes", help="one request's write alone in a group commit: time and statements"
    )
    written.add_argument(
        "--db", choices=("sqlite", "postgresql", "both"), default="both", help="database(s)"
    )
    written.add_argument("--count", type=COUNT, default=300, help="writes timed per kind")
    written.add_argument(
        "--postgres-url", default=SCRATCH_POSTGRES_URL, help="as for the api benchmark"
    )
    over = sub.add_parser(
        "failover", help="SIGKILL the leader under load: time until the standby serves"
    )
    over.add_argument(
        "--db", choices=("sqlite", "postgresql", "both"), default="both", help="database(s)"
    )
    over.add_argument("--inflight", type=COUNT, default=20, help="requests kept in flight")
    over.add_argument("--rounds", type=COUNT, default=3, help="failovers (and restarts) timed")
    over.add_argument(
        "--postgres-url", default=SCRATCH_POSTGRES_URL, help="as for the api benchmark"
    )
    spawns = sub.add_parser(
        "spawn", help="what the broker adds to a notebook spawn (two real hubs, alternately)"
    )
    spawns.add_argument("--repeat", type=COUNT, default=20, help="spawns timed per hub")
    cluster = sub.add_parser(
        "kube", help="inventory sync and a pass with nodes served by a Kubernetes API fake"
    )
    cluster.add_argument("--nodes", type=COUNT, default=1000, help="GPU nodes in the fake")
    web = sub.add_parser("pages", help="the web pages: time to first paint, bytes per update")
    web.add_argument("--slices", type=SOME, default=1000, help="live slices")
    web.add_argument("--nodes", type=COUNT, default=128, help="nodes of 8 GPUs")
    web.add_argument("--repeat", type=COUNT, default=10, help="loads timed per page")
    what_if = sub.add_parser(
        "whatif", help="alternatives polled at a fixed rate: the broker's CPU, bounded and not"
    )
    what_if.add_argument("--rate", type=RATE, default=50.0, help="polls per second")
    what_if.add_argument("--seconds", type=SECONDS, default=20.0, help="length of each phase")
    what_if.add_argument("--waiting", type=COUNT, default=200, help="waiting requests polled")
    args = parser.parse_args(argv)
    if args.which == "storepass":
        report = storepass.run(live=args.live, repeat=args.repeat, ledger=args.ledger)
    elif args.which == "whatif":
        report = whatif.run(rate=args.rate, seconds=args.seconds, waiting=args.waiting)
    elif args.which == "pages":
        report = pages.run(slices=args.slices, nodes=args.nodes, repeat=args.repeat)
    elif args.which == "kube":
        report = kube.run(nodes=args.nodes)
    elif args.which == "spawn":
        report = spawn.run(repeat=args.repeat)
    elif args.which == "writes":
        report = writes.run(args.db, args.count, args.postgres_url)
    elif args.which == "failover":
        report = failover.run(args.db, args.inflight, args.rounds, args.postgres_url)
    elif args.which == "api" and (args.open_loop or args.sweep):
        report = api.run_open_loop(
            "postgresql" if args.db == "postgres" else args.db,
            args.rate,
            args.seconds,
            args.postgres_url,
            sweep=args.sweep,
            sweep_rates=args.rates,
            heartbeat_every=args.heartbeat_every,
            seed=args.seed,
            hub_heartbeats=args.hub_heartbeats,
        )
    elif args.which == "api":
        report = api.run(
            "postgresql" if args.db == "postgres" else args.db,
            args.clients,
            args.seconds,
            args.postgres_url,
            heartbeats=args.heartbeats,
        )
    elif args.which in (None, "pass"):
        repeat = getattr(args, "repeat", 100)
        factors = tuple(getattr(args, "factors", (1, 8)))
        report = scheduling.run(repeat=repeat, factors=factors)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
