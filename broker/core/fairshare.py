"""Hierarchical fair share (design.md §4): entitlements and the top-down project order.

At each level of the project tree, siblings are ranked by
``usage_in_window / entitlement`` of their whole subtree, lower first, ties by
name; a project's rank is the order of a depth-first walk that visits children
in that order (Slurm's Fair Tree).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import InvalidConfig
from .model import Account


@dataclass(frozen=True, slots=True)
class _Level:
    """Where two projects' paths part: the two sibling accounts compared there."""

    mine: str
    theirs: str


class ProjectTree:
    """A validated tree of accounts; leaves are projects."""

    def __init__(self, accounts: Iterable[Account]):
        accounts = list(accounts)
        self.accounts: dict[str, Account] = {}
        for account in accounts:
            if not account.name:
                raise InvalidConfig("an account needs a name", "projects")
            if account.name in self.accounts:
                raise InvalidConfig(f"account {account.name!r} is declared twice", "projects")
            if not account.share > 0:
                raise InvalidConfig(
                    f"share must be > 0, got {account.share!r}", f"projects.{account.name}.share"
                )
            self.accounts[account.name] = account
        self.children: dict[str | None, list[str]] = {}
        for account in accounts:
            if account.parent is not None and account.parent not in self.accounts:
                raise InvalidConfig(
                    f"parent {account.parent!r} does not exist", f"projects.{account.name}.parent"
                )
            self.children.setdefault(account.parent, []).append(account.name)
        for names in self.children.values():
            names.sort()
        self.paths: dict[str, tuple[str, ...]] = {name: self._path(name) for name in self.accounts}
        self.entitlements: dict[str, float] = {}
        for name, path in self.paths.items():
            fraction = 1.0
            for step in path:
                parent = self.accounts[step].parent
                siblings = self.children[parent]
                fraction *= self.accounts[step].share / sum(
                    self.accounts[s].share for s in siblings
                )
            if not fraction > 0:  # shares so far apart that the product underflows
                raise InvalidConfig(
                    "share is too small next to its siblings' (entitlement rounds to 0)",
                    f"projects.{name}.share",
                )
            self.entitlements[name] = fraction
        self.projects: tuple[str, ...] = tuple(
            sorted(name for name in self.accounts if name not in self.children)
        )
        # parting()'s answers: the tree never changes, and every pass asks them of
        # each pair of projects over and over (design.md §5.2).
        self._partings: dict[tuple[str, str], _Level | None] = {}

    def _path(self, name: str) -> tuple[str, ...]:
        """Accounts from the root down to ``name``; raises on a cycle."""
        path = [name]
        seen = {name}
        parent = self.accounts[name].parent
        while parent is not None:
            if parent in seen:
                raise InvalidConfig(
                    f"the tree has a cycle: {' -> '.join([*path, parent])}",
                    f"projects.{name}.parent",
                )
            seen.add(parent)
            path.append(parent)
            parent = self.accounts[parent].parent
        return tuple(reversed(path))

    def is_project(self, name: str) -> bool:
        return name in self.accounts and name not in self.children

    def subtree_usage(self, usage: Mapping[str, float]) -> dict[str, float]:
        """Usage summed over each account's subtree."""
        totals = dict.fromkeys(self.accounts, 0.0)
        for project in self.projects:
            amount = usage.get(project, 0.0)
            for step in self.paths[project]:
                totals[step] += amount
        return totals

    def share_values(self, usage: Mapping[str, float]) -> dict[str, float]:
        """``usage / entitlement`` for every account: the value siblings are ranked by."""
        totals = self.subtree_usage(usage)
        return {name: totals[name] / self.entitlements[name] for name in self.accounts}

    def share_used(self, usage: Mapping[str, float]) -> dict[str, float]:
        """What every account used of its share: its part of all usage in the window
        over its entitlement (1 is exactly its share; 0 for all while nothing is used).

        This is the fair-share value people see. It is :meth:`share_values` divided by
        the same total for every account, so it ranks siblings exactly as they do.
        """
        totals = self.subtree_usage(usage)
        total = sum(totals[name] for name in self.children.get(None, ()))
        if not total > 0:
            return dict.fromkeys(self.accounts, 0.0)
        return {name: totals[name] / total / self.entitlements[name] for name in self.accounts}

    def project_order(self, usage: Mapping[str, float]) -> list[str]:
        """Projects in fair-share order.

        Criteria, at each level of the tree: share value (lower first), then
        account name. The walk is depth first, so a whole subtree ranks together.
        """
        values = self.share_values(usage)
        order: list[str] = []
        stack: list[str] = list(
            reversed(sorted(self.children.get(None, []), key=lambda n: (values[n], n)))
        )
        while stack:
            name = stack.pop()
            kids = self.children.get(name)
            if not kids:
                order.append(name)
                continue
            stack.extend(reversed(sorted(kids, key=lambda n: (values[n], n))))
        return order

    def parting(self, mine: str, theirs: str) -> _Level | None:
        """The sibling accounts at which the paths of two projects part (None: same project)."""
        key = (mine, theirs)
        try:
            return self._partings[key]
        except KeyError:
            pass
        level = None
        if mine != theirs:
            a, b = self.paths[mine], self.paths[theirs]
            depth = 0
            while depth < min(len(a), len(b)) and a[depth] == b[depth]:
                depth += 1
            level = _Level(a[depth], b[depth])
        self._partings[key] = level
        return level


#: Entitlements (fractions) closer than this read as unchanged: 0.0005 percentage points.
UNCHANGED = 0.0005 / 100


def entitlement_moves(before: Mapping[str, float], after: Mapping[str, float]) -> set[str]:
    """The accounts whose entitlement goes from ``before`` to ``after`` (new ones too)."""
    return {name for name in after if abs(after[name] - before.get(name, 0.0)) >= UNCHANGED}


def entitlements_with(accounts: Iterable[Account], changed: Account) -> dict[str, float]:
    """Every account's entitlement once ``changed`` takes the place of the account of its
    name (or joins the tree): what a change would do, asked before it is made.
    :class:`InvalidConfig` if the tree would not be valid (a cycle, say)."""
    tree = {account.name: account for account in accounts}
    tree[changed.name] = changed
    return ProjectTree(tree.values()).entitlements
