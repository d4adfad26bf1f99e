"""``python -m broker.sim``: the same as ``slicebroker simulate``."""

from .cli import add_parser, main, run

__all__ = ["add_parser", "main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
