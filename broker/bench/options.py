"""Argparse types for the benchmarks' options: a bad figure is one line of error and
status 2, before anything runs, never a traceback half-way through a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, least: float, words: str) -> Callable[[str], float]:
    """A finite ``kind`` of at least ``least``; else an error saying it takes ``words``."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"takes {words}, not {text!r}")
        return value

    return convert


def numbers(kind: type, least: float, words: str) -> Callable[[str], list]:
    """A comma-separated list, each as :func:`number` takes it."""
    one = number(kind, least, words)

    def convert(text: str) -> list:
        try:
            return [one(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"takes {words}, comma-separated, not {text!r}"
            ) from None

    return convert


#: How many times, or things: 1 or more.
COUNT = number(int, 1, "a whole number, 1 or more")
#: How many, where none is a figure too.
SOME = number(int, 0, "a whole number, 0 or more")
#: A length of time.
SECONDS = number(float, 1e-9, "seconds, above 0")
#: Events per second.
RATE = number(float, 1e-9, "a rate above 0")
