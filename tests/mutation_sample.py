"""A seeded mutation sample over the scheduling core and the store (docs/testing.md).

Each mutant changes one operator or constant of one line (``<=`` to ``<``, ``and`` to
``or``, ``+`` to ``-``, a ``not`` dropped, ``True`` to ``False``, a whole number plus
one) in a copy of the repository, and the core's and the store's tests run against it
(SQLite only, stopping at the first failure). A mutant the tests fail on is killed; one
they pass is a survivor, named with its file, line and change. Run from the repository
root (it takes a while: a survivor costs a whole run of those tests)::

    python tests/mutation_sample.py --count 30 --seed 24
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The code mutated.
TARGETS = ("broker/core", "broker/store")
#: The tests run against each mutant: the core's and the store's.
TESTS = (
    "tests/test_hardening_mutants.py",
    "tests/test_hardening_text.py",
    "tests/test_accounting.py",
    "tests/test_scheduler.py",
    "tests/test_preemption_rule.py",
    "tests/test_preemption_waiting.py",
    "tests/test_victim_search_oracle.py",
    "tests/test_whatif.py",
    "tests/test_protection_extension.py",
    "tests/test_boundaries.py",
    "tests/test_determinism.py",
    "tests/test_store.py",
    "tests/test_store_catalog.py",
    "tests/test_edge_store.py",
    "tests/test_incremental_pass.py",
    "tests/test_properties.py",
)
#: Seconds one mutant's tests may take; past it the mutant counts as killed (a hang).
TIMEOUT_S = 300

_COMPARE_SWAPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
_BINARY_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
_BOOL_SWAPS = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Site:
    """One place a mutant changes: the file, the node's position in a walk, what changes."""

    path: str
    index: int
    line: int
    change: str


def sites(path: Path) -> list[Site]:
    """Every mutation site of the module at ``path``."""
    tree = ast.parse(path.read_text())
    found = []
    relative = str(path.relative_to(REPO_ROOT))
    for index, node in enumerate(ast.walk(tree)):
        change = _describe(node)
        if change is not None:
            found.append(Site(relative, index, node.lineno, change))
    return found


def _describe(node: ast.AST) -> str | None:
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAPS:
        old = type(node.ops[0])
        return f"{_symbol(old)} -> {_symbol(_COMPARE_SWAPS[old])}"
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_SWAPS:
        return f"{_symbol(type(node.op))} -> {_symbol(_BINARY_SWAPS[type(node.op)])}"
    if isinstance(node, ast.BoolOp):
        return f"{_symbol(type(node.op))} -> {_symbol(_BOOL_SWAPS[type(node.op)])}"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return "not dropped"
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return f"{node.value} -> {not node.value}"
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return f"{node.value} -> {node.value + 1}"
    return None


def _symbol(op: type) -> str:
    return {
        ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
        ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
        ast.Div: "/", ast.And: "and", ast.Or: "or",
    }[op]  # fmt: skip


def mutate(source: str, site: Site) -> str:
    """``source`` with ``site`` changed (as ``ast.unparse`` writes it)."""
    tree = ast.parse(source)
    for index, node in enumerate(ast.walk(tree)):
        if index != site.index:
            continue
        if isinstance(node, ast.Compare):
            node.ops = [_COMPARE_SWAPS[type(node.ops[0])]()]
        elif isinstance(node, ast.BinOp):
            node.op = _BINARY_SWAPS[type(node.op)]()
        elif isinstance(node, ast.BoolOp):
            node.op = _BOOL_SWAPS[type(node.op)]()
        elif isinstance(node, ast.UnaryOp):
            return _replace(source, tree, node, node.operand)
        elif isinstance(node.value, bool):
            node.value = not node.value
        else:
            node.value += 1
        return ast.unparse(tree)
    raise ValueError(f"no site {site}")


def _replace(source: str, tree: ast.AST, old: ast.AST, new: ast.AST) -> str:
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, name, new)
            elif isinstance(value, list):
                setattr(parent, name, [new if item is old else item for item in value])
    return ast.unparse(tree)


def run_tests(copy: Path) -> tuple[bool, float]:
    """Whether the tests pass on ``copy``, and how long they took."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    command = [sys.executable, "-m", "pytest", *TESTS, "-x", "-q", "-p", "no:cacheprovider"]
    command += ["-k", "not postgresql"]
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, cwd=copy, env=env, capture_output=True, timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - started
    return result.returncode == 0, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=30, help="mutants to sample")
    parser.add_argument("--seed", type=int, default=24, help="the sample's random seed")
    args = parser.parse_args()
    every = [
        site for target in TARGETS for path in sorted((REPO_ROOT / target).glob("*.py"))
        for site in sites(path)
    ]  # fmt: skip
    sample = sorted(random.Random(args.seed).sample(every, args.count), key=lambda s: s.path)
    print(f"{len(every)} sites in {', '.join(TARGETS)}; sampling {len(sample)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mutants-") as directory:
        copy = Path(directory) / "repo"
        shutil.copytree(REPO_ROOT, copy, ignore=shutil.ignore_patterns(".git", ".ci", "*.sqlite"))
        passed, seconds = run_tests(copy)
        if not passed:
            print("the tests fail without any mutant: nothing to measure", file=sys.stderr)
            return 1
        print(f"unmutated: the tests pass in {seconds:.0f} s", flush=True)
        survivors = []
        for number, site in enumerate(sample, 1):
            target = copy / site.path
            original = target.read_text()
            target.write_text(mutate(original, site))
            try:
                passed, seconds = run_tests(copy)
            finally:
                target.write_text(original)
            verdict = "SURVIVED" if passed else "killed"
            print(f"{number:3d} {verdict:8s} {site.path}:{site.line} {site.change} "
                  f"({seconds:.0f} s)", flush=True)  # fmt: skip
            if passed:
                survivors.append(site)
    killed = len(sample) - len(survivors)
    print(f"score: {killed}/{len(sample)} killed ({100 * killed / len(sample):.0f}%)")
    for site in survivors:
        print(f"survivor: {site.path}:{site.line} {site.change}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
