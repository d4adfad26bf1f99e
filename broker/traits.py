"""Range checks shared by every traitlets option of seconds (the service's, the
inventories', the spawner's), so that each says the same thing in one line.

Used as ``_check = validate("name", ...)(seconds_above_zero)`` in a class body.
"""

from __future__ import annotations

from typing import Any

from traitlets import TraitError


def seconds_above_zero(_owner: Any, proposal: Any) -> float:
    """The proposed seconds, if above 0 (nan refused); else a :class:`TraitError`."""
    if not proposal.value > 0:
        raise TraitError(f"{proposal.trait.name} must be > 0 seconds, got {proposal.value}")
    return proposal.value


def seconds_not_negative(_owner: Any, proposal: Any) -> float:
    """The proposed seconds, if 0 or more (nan refused); else a :class:`TraitError`."""
    if not proposal.value >= 0:
        raise TraitError(f"{proposal.trait.name} must be >= 0 seconds, got {proposal.value}")
    return proposal.value
