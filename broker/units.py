"""Units shown to people: GPU time in GPU-hours, through one function everywhere.

The broker counts in GPU-seconds (usage, charges); people read GPU-hours. Every
place that shows GPU time to a person — the web pages, the spawn form, the
pending page, the charge the command line reports — formats it with
:func:`gpu_hours`, so the same quantity reads the same wherever it appears. (The
command line's tables keep two decimals, so that a column lines up.) A project's
fair-share value is a ratio, not GPU time: :func:`share_used` writes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: Seconds in an hour: GPU-seconds per GPU-hour.
HOUR = 3600.0
#: How GPU-hours are written after a number.
UNIT = "GPU-h"


def gpu_hours(gpu_seconds: float | None, *, unit: bool = True) -> str:
    """``gpu_seconds`` as GPU-hours for people: ``0.25 GPU-h``, ``12.5 GPU-h``, ``1,234 GPU-h``.

    Two decimals below 100 GPU-hours, one below 1,000, none above (with thousands
    separators), so that a value never reads in scientific notation. ``None`` (or
    a value that is not finite) is ``—``. ``unit=False`` leaves out ``GPU-h``,
    for tables whose header names the unit.
    """
    if gpu_seconds is None or not math.isfinite(gpu_seconds):
        return "—"
    hours = gpu_seconds / HOUR
    size = abs(hours)
    if size >= 1000:
        text = f"{hours:,.0f}"
    elif size >= 100:
        text = f"{hours:.1f}"
    else:
        text = f"{hours:.2f}"
    if text.lstrip("-").strip("0.,") == "" and text.startswith("-"):
        text = text[1:]  # no "-0.00"
    return f"{text} {UNIT}" if unit else text


def share_used(value: float | None, *, words: bool = True) -> str:
    """A fair-share value as people read it: ``1.20× its share``, the project's part of
    all GPU time used in the window over its entitlement (1 is exactly its share, lower
    is served first). ``words=False`` leaves out "its share", for tables whose header
    says it. ``None`` is ``—``."""
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.2f}×" + (" its share" if words else "")


def duration_text(seconds: float) -> str:
    """A length of time as people read a limit or a protection: ``8 h``, ``15 min``,
    ``1 h 30 min``, ``1 min 30 s``, ``45 s`` (never rounded: a 90 s limit is not 2 min)."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours} h" if hours else "", f"{minutes} min" if minutes else ""]
    parts.append(f"{secs} s" if secs or not (hours or minutes) else "")
    return " ".join(part for part in parts if part)


def count(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless it is one: ``1 node``, ``0 nodes``, ``2 nodes``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def instead_text(change: str, fields: Mapping[str, Any], request: Mapping[str, Any]) -> str:
    """One alternative to a waiting request (``GET /slices/{id}/alternatives``) in words,
    against the request as it is: ``1 GPU instead of 2``, ``2 h protection instead of
    8 h``, ``a 15 min debug session``, ``charged to nlp``."""
    if change == "gpus":
        return f"{count(fields['gpus'], 'GPU')} instead of {request.get('gpus')}"
    if change == "gpu_type":
        return f"{fields['gpu_type']} instead of {request.get('gpu_type') or 'any type'}"
    if change == "min_runtime":
        was = duration_text(request.get("min_runtime") or 0)
        return f"{duration_text(fields['min_runtime'])} protection instead of {was}"
    if change == "debug":
        return f"a {duration_text(fields['min_runtime'])} debug session"
    return f"charged to {fields['project']}"
