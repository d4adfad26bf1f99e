"""Extending a running slice's protection (design.md §3): how far, and when it is refused.

A user who is still working when the protected period is about to end (Lab's idle
warning offers it) may extend it. The slice stays charged as before, from its grant
to its end; what the extension adds is a promise: nobody preempts it for longer.
The contract's own caps bound it, so an extension never gives more than a new
request could have asked for:

- the policy's ``max_min_runtime`` (8 h by default), counted from the grant;
- a debug session's ``debug_max_min_runtime`` (15 min), so that a session the
  debug lane served under its short terms keeps them;
- the slice's own ``max_runtime``.

Only a granted slice under contract can extend: a free one (``min_runtime = 0``)
has no protection to extend, and a preempting one is already on its way out.
"""

from __future__ import annotations

from collections.abc import Callable

from .model import Contract, Policy, Slice, SliceState
from .preemption import is_debug


class ExtensionRefused(ValueError):
    """Why a slice's protection cannot be extended. Past a cap: which (``cap_name``), the
    protection asked for from the grant, the cap and the room left, in seconds."""

    def __init__(
        self,
        reason: str,
        *,
        cap_name: str | None = None,
        wanted: float = 0.0,
        cap: float = 0.0,
        room: float = 0.0,
    ) -> None:
        super().__init__(reason)
        self.cap_name, self.wanted, self.cap, self.room = cap_name, wanted, cap, room

    def describe(self, duration: Callable[[float], str]) -> str:
        """The refusal in words, with durations as ``duration`` writes them."""
        if self.cap_name is None:
            return str(self)
        return (
            f"{duration(round(self.wanted))} of protection from the grant is above "
            f"{self.cap_name} ({duration(self.cap)}); at most {duration(round(self.room))} more"
        )


def extended_contract(slice_: Slice, by: float, now: float, policy: Policy) -> Contract:
    """``slice_``'s contract with its protection extended by ``by`` seconds from the
    later of its end and ``now``; :class:`ExtensionRefused` past a cap."""
    if by <= 0:
        raise ExtensionRefused("an extension must be longer than 0 s")
    if slice_.state is not SliceState.GRANTED or slice_.granted_at is None:
        raise ExtensionRefused(
            f"slice {slice_.id} is {slice_.state.value}: only a granted slice's "
            "protection can be extended"
        )
    if not slice_.allocated:
        raise ExtensionRefused(
            f"slice {slice_.id} is free (min_runtime 0): it has no protection to extend"
        )
    protected_until = max(slice_.granted_at + slice_.contract.min_runtime, now) + by
    wanted = protected_until - slice_.granted_at
    caps = [(policy.max_min_runtime, "the policy's max_min_runtime")]
    if is_debug(slice_, policy):
        caps.append((policy.debug_max_min_runtime, "a debug session's debug_max_min_runtime"))
    if slice_.contract.max_runtime is not None:
        caps.append((slice_.contract.max_runtime, "the slice's max_runtime"))
    cap, what = min(caps)
    if wanted > cap:
        current_end = max(slice_.granted_at + slice_.contract.min_runtime, now)
        room = max(slice_.granted_at + cap - current_end, 0.0)
        raise ExtensionRefused("above a cap", cap_name=what, wanted=wanted, cap=cap, room=room)
    return Contract(wanted, slice_.contract.resumable, slice_.contract.max_runtime)


__all__ = ["ExtensionRefused", "extended_contract"]
