"""Under CI a skipped test fails: CI installs every prerequisite, so a skip would hide one."""

from __future__ import annotations

from pathlib import Path

import pytest

SKIPPING_TEST = "import pytest\n\ndef test_needs_something():\n    pytest.skip('not here')\n"


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(SKIPPING_TEST)
    return pytester


def test_a_skip_fails_under_ci(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*skipped under CI, which must run every test*not here*"])


def test_a_skip_stays_a_skip_elsewhere(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CI", raising=False)
    suite.runpytest().assert_outcomes(skipped=1)
