"""``python -m broker.bench [pass] [--repeat N]``: print benchmark figures as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from . import scheduling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.bench", description=__doc__)
    sub = parser.add_subparsers(dest="which")
    passes = sub.add_parser("pass", help="time of one scheduling pass (default)")
    passes.add_argument("--repeat", type=int, default=100, help="passes timed per size")
    passes.add_argument(
        "--factors", default="1,8", help="sizes as multiples of 1,024 GPUs / 3,000 slices"
    )
    args = parser.parse_args(argv)
    if args.which in (None, "pass"):
        repeat = getattr(args, "repeat", 100)
        factors = tuple(int(f) for f in getattr(args, "factors", "1,8").split(","))
        report = scheduling.run(repeat=repeat, factors=factors)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
