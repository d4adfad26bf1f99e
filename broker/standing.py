"""Fair share now (design.md §5.2): what each account may hold of the cluster at
this moment, and how far it is from that.

The 7-day window (:mod:`broker.fairshare`) orders who is served first from free
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
    _partings: dict = field(default_factory=dict)

    @classmethod
    def now(cls, tree: ProjectTree, capacity: float, wanting: Iterable[str]) -> Standings:
        """Fair shares of ``capacity`` weighted GPUs among the projects in ``wanting``."""
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
        return cls(tree, fair)

    def record(self, project: str, weighted_gpus: float) -> None:
        """``project`` holds ``weighted_gpus`` more (fewer, if negative) from now on."""
        for account in self.tree.paths[project]:
            self.held[account] = self.held.get(account, 0.0) + weighted_gpus

    def standing(self, account: str, change: float = 0.0) -> float:
        """Weighted GPUs held ÷ fair share now, after holding ``change`` more."""
        held = self.held.get(account, 0.0) + change
        fair = self.fair.get(account, 0.0)
        if fair > 0:
            return held / fair
        return math.inf if held > 1e-9 else 0.0

    def may_take(
        self, mine: str, theirs: str, gained: float, lost: float, *, gang: bool = False
    ) -> bool:
        """Whether project ``mine`` may take running GPUs from project ``theirs``.

        Compared where their paths part in the tree (so GPUs never move from an
        organisation below its share to one above it), after ``mine`` gains
        ``gained`` weighted GPUs and ``theirs`` loses ``lost``, either

        1. ``mine``'s standing is still at or below ``theirs``' (Kueue's
           LessThanOrEqualToFinalShare, on GPUs held now): the move narrows the
           gap between the two, so the same GPUs never go back; or
        2. ``mine``'s standing is strictly below ``theirs``' before the move
           (Kueue's LessThanInitialShare): a victim of many GPUs may go for a
           request of few, where rule 1 alone would let one large job hold a
           project's GPUs against every smaller request. Two projects at the
           same standing never take from each other under either rule.

        A ``gang`` (a request larger than any node) is bigger than most projects'
        fair share, so neither rule would ever let it in: it may also take from
        an account holding more than its fair share now (its standing above 1),
        once the nodes reserved for it fall due.

        Larger ``gained`` or ``lost`` only make it harder: with both 0 it is at
        its most lenient.
        """
        key = (mine, theirs)
        level = self._partings.get(key)
        if level is None:
            level = self._partings[key] = self.tree.parting(mine, theirs)
        if level is None:
            return False  # one project: its own order decides, not fair share
        theirs_now = self.standing(level.theirs)
        if gang and theirs_now > 1.0:
            return True
        mine_after = self.standing(level.mine, gained)
        return mine_after <= self.standing(level.theirs, -lost) or mine_after < theirs_now
