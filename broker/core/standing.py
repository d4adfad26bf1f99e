"""Fair share now (design.md §5.2): what each account may hold of the cluster at
this moment, and how far it is from that.

The 7-day window (:mod:`broker.core.fairshare`) orders who is served first from free
GPUs. Whether one project may take running GPUs from another is judged on the
present instead: a week's usage barely moves when one job changes hands, so a
rule on the window lets two projects trade the same GPUs back and forth.

An account's *fair share now* is its entitlement of the cluster's weighted GPUs,
with the shares of accounts that want nothing now (they hold no charged GPUs and
wait for none) handed to their siblings that do, level by level from the top.
Its *standing* is the weighted GPUs its subtree holds ÷ its fair share now:
1.0 is exactly its share, above 1.0 more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from .fairshare import ProjectTree


@dataclass
class Standings:
    """Fair share now and GPUs held, per account, during one pass.

    ``held`` moves as the pass grants and preempts (:meth:`record`), so that each
    decision sees the cluster as the earlier ones left it.
    """

    tree: ProjectTree
    fair: dict[str, float]  # weighted GPUs each account's fair share is now
    held: dict[str, float] = field(default_factory=dict)
    margin: float = 0.0  # the policy's fair_share_margin, in shares (see may_take)
    # may_take_at_all's answers for these holdings; a new dict whenever they move,
    # never changed in place, so that the index can keep it for the next pass.
    lenient: dict[tuple[str, str, bool], bool] = field(default_factory=dict, compare=False)
    # above_share's answer for these holdings (None: not worked out since they moved).
    _above: set[str] | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def now(
        cls, tree: ProjectTree, capacity: float, wanting: Iterable[str], margin: float = 0.0
    ) -> Standings:
        """Fair shares of ``capacity`` weighted GPUs among the projects in ``wanting``;
        ``margin``: the policy's ``fair_share_margin``."""
        wants = set()
        for project in wanting:
            wants.update(tree.paths[project])
        fair: dict[str, float] = dict.fromkeys(tree.accounts, 0.0)
        level: list[tuple[str | None, float]] = [(None, capacity)]
        while level:
            parent, amount = level.pop()
            siblings = [name for name in tree.children.get(parent, ()) if name in wants]
            total_share = sum(tree.accounts[name].share for name in siblings)
            for name in siblings:
                fair[name] = amount * tree.accounts[name].share / total_share
                level.append((name, fair[name]))
        return cls(tree, fair, margin=margin)

    def record(self, project: str, weighted_gpus: float) -> None:
        """``project`` holds ``weighted_gpus`` more (fewer, if negative) from now on."""
        for account in self.tree.paths[project]:
            self.held[account] = self.held.get(account, 0.0) + weighted_gpus
        self.lenient = {}
        self._above = None

    def standing(self, account: str, change: float = 0.0) -> float:
        """Weighted GPUs held ÷ fair share now, after holding ``change`` more."""
        held = self.held.get(account, 0.0) + change
        fair = self.fair.get(account, 0.0)
        if fair > 0:
            return held / fair
        return math.inf if held > 1e-9 else 0.0

    def over_share(self) -> set[str]:
        """Projects of which the subtree, or an account above it, holds more than
        its fair share now."""
        return {
            project
            for project in self.tree.projects
            if any(self.standing(account) > 1.0 for account in self.tree.paths[project])
        }

    def above_share(self) -> set[str]:
        """Projects that hold more than their own fair share now: the only ones
        :meth:`may_take` ever lets anyone take from."""
        if self._above is None:
            self._above = {p for p in self.tree.projects if self.standing(p) > 1.0}
        return self._above

    def may_take_at_all(self, mine: str, theirs: str, gang: bool = False) -> bool:
        """:meth:`may_take` at its most lenient (nothing gained or lost): False means
        no move from ``theirs`` to ``mine`` is allowed, whatever its size. Kept in
        ``lenient``: the victim searches and release estimates ask it of every
        project, for every request."""
        key = (mine, theirs, gang)
        answer = self.lenient.get(key)
        if answer is None:
            answer = self.lenient[key] = self.may_take(mine, theirs, 0.0, 0.0, gang=gang)
        return answer

    def may_take(
        self,
        mine: str,
        theirs: str,
        gained: float,
        lost: float,
        *,
        gang: bool = False,
        lost_before: float = 0.0,
    ) -> bool:
        """Whether project ``mine`` may take running GPUs from project ``theirs``.

        ``theirs`` must be above its own fair share now, and so must its account
        where the two paths part, after the ``lost_before`` (of ``lost``) that
        earlier victims of the same request already cost it: a project at or
        under its share is never a victim of fair share, whoever asks
        (design.md §5.7). The last victim may still take it below its share:
        with whole jobs of several GPUs, requiring it to stay at or above blocks
        most moves.

        Compared where their paths part in the tree (so GPUs never move from an
        organisation below its share to one above it): after ``mine`` gains
        ``gained`` weighted GPUs and ``theirs`` loses ``lost``, ``mine``'s standing
        must still be at or below ``theirs``' (Kueue's LessThanOrEqualToFinalShare,
        on GPUs held now). So a move only narrows the gap between the two and
        keeps their order: the same GPUs never go back. Two projects at the same
        standing never take from each other.

        One overshoot is allowed, for work whose jobs are larger than the gap: an
        account under its share may end above ``theirs`` if ``theirs`` stays at or
        above its own share and the gap between the two narrows (a share of 12
        GPUs holding one 8-GPU job may take a second from an account that keeps
        its share). Neither may then overshoot the other back: the one above its
        share may not overshoot, and the other may only narrow the gap.

        Kueue's other strategy, LessThanInitialShare (``mine`` with the request
        below ``theirs`` before the move), is left out on purpose: with a victim
        of many GPUs for a request of few it lets the move overshoot however far,
        taking ``theirs`` below its share, and the two then take the victims back
        and forth (measured on Helios: one 8-GPU job preempted 96 times in 3,000
        jobs).

        Siblings compare as siblings, cousins as their organisations, with one
        exception: a project under its own share now may also take from a cousin
        above its own share whose organisation (where the paths part) is above its
        share too, if the two projects' standings, compared as projects, keep the
        rule above. Otherwise a project under its share inside an organisation that
        its siblings keep above its share could only take from those siblings,
        whose GPUs, spread over nodes as 1-GPU jobs, rarely make its shape
        (design.md §5.7). A cousin at or under its share, or in an organisation at
        or under its share, is never taken.

        With a ``margin`` (the policy's ``fair_share_margin``, in shares), a request
        is judged as if it moved ``mine`` by at least that much: a small one must
        find ``mine`` that far below ``theirs``, so two projects near the same
        standing do not trade small jobs back and forth as their other work comes
        and goes. A request that alone moves ``mine`` by more is judged as without
        a margin: lumpy work (jobs near a project's share) cannot move in smaller
        steps. An overshoot must narrow the gap by more than the margin, whatever
        the request's size.

        A ``gang`` (a request larger than any node) is bigger than most projects'
        fair share, so that rule would never let it in. Once the nodes reserved
        for it fall due, it may also take them while ``mine`` holds less than its
        fair share now and ``theirs`` more than its own.

        Larger ``gained``, ``lost`` or ``lost_before`` only make it harder: with
        all 0 it is at its most lenient.
        """
        level = self.tree.parting(mine, theirs)
        if level is None:
            return False  # one project: its own order decides, not fair share
        if self.standing(theirs, -lost_before) <= 1.0:
            return False
        if level.theirs != theirs and self.standing(level.theirs, -lost_before) <= 1.0:
            return False
        if gang and self.standing(level.mine) < 1.0 < self.standing(level.theirs):
            return True
        mine_after = self._after(level.mine, gained)
        theirs_after = self.standing(level.theirs, -lost)
        if mine_after <= theirs_after:
            return True
        # Work in steps larger than the gap (8-GPU jobs on a share of 12): an account
        # under its share may overshoot one that stays at or above its own, if the
        # gap narrows (by more than the margin). Neither can then overshoot the other
        # back: one is above its share, and the other only narrows the gap.
        mine_now = self.standing(level.mine)
        if mine_now < 1.0 <= theirs_after and (
            mine_after - theirs_after < self.standing(level.theirs) - mine_now - self.margin
        ):
            return True
        # Refused as organisations (mostly: siblings keep the requester's above its
        # share), a project under its own share may still take from a cousin,
        # compared as projects; the checks above keep the cousin and its
        # organisation above their shares.
        return (
            level.mine != mine
            and self.standing(mine) < 1.0
            and self._after(mine, gained) <= self.standing(theirs, -lost)
        )

    def _after(self, account: str, gained: float) -> float:
        """``account``'s standing after gaining ``gained``, for :meth:`may_take`: at
        least its standing now plus the margin."""
        after = self.standing(account, gained)
        if self.margin:
            return max(after, self.standing(account) + self.margin)
        return after
