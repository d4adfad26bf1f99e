"""The cluster configuration file and ``slicebroker check-config``."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from broker.cli import main
from broker.config import (
    _POLICY_KEYS,
    BUILTIN_DEFAULTS,
    DEMO_CONFIG,
    KindDefaults,
    Members,
    format_duration,
    load_config,
    parse_config,
    parse_duration,
)
from broker.core.model import HOUR, Node, Policy, SliceKind
from broker.errors import InvalidConfig

ROOT = Path(__file__).resolve().parents[1]

# Building blocks of small configuration files.
GPU_TYPES = "[gpu_types]\nh100 = 1.0\n"
NODE = '[[nodes]]\nname = "gpu-01"\ngpu_type = "h100"\ngpus = 8\n'
PROJECT = "[projects.solo]\n"
MINIMAL = GPU_TYPES + NODE + PROJECT

# org -> research (7) -> a1 (1), a2 (1); org -> infra (3) -> b1 (2), b2 (1)
TREE = """
[projects.org]
[projects.research]
parent = "org"
share = 7
[projects.infra]
parent = "org"
share = 3
[projects.a1]
parent = "research"
users = ["alice", "bob"]
[projects.a2]
parent = "research"
share = 1.0
groups = ["nlp-team"]
[projects.b1]
parent = "infra"
share = 2
[projects.b2]
parent = "infra"
"""


def parse(text: str):
    return parse_config(tomllib.loads(text), source="test.toml")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


# ---- durations --------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param(90, 90.0, id="a bare integer is seconds"),
        pytest.param(2.5, 2.5, id="a bare float is seconds"),
        pytest.param("90", 90.0, id="numeric text is seconds"),
        pytest.param("90s", 90.0, id="s is seconds"),
        pytest.param("15m", 900.0, id="m is minutes"),
        pytest.param("2h", 7200.0, id="h is hours"),
        pytest.param("7d", 7 * 86400.0, id="d is days"),
        pytest.param("1w", 7 * 86400.0, id="w is weeks"),
        pytest.param("1h30m", 5400.0, id="units combine"),
        pytest.param("1h 30m", 5400.0, id="units combine with spaces"),
        pytest.param("1.5h", 5400.0, id="a unit may have a fraction"),
        pytest.param(" 2H ", 7200.0, id="case and surrounding blanks do not matter"),
        pytest.param(0, 0.0, id="zero is a duration"),
    ],
)
def test_parse_duration_reads(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("", "invalid duration", id="empty text is refused"),
        pytest.param("5 minutes", "invalid duration", id="spelled-out units are refused"),
        pytest.param("5y", "invalid duration", id="an unknown unit is refused"),
        pytest.param("1 5m", "invalid duration", id="a number without a unit inside is refused"),
        pytest.param("-5m", "invalid duration", id="negative text is refused"),
        pytest.param(-1, "must not be negative", id="a negative number is refused"),
        pytest.param(float("inf"), "finite", id="infinity is refused"),
        pytest.param(float("nan"), "finite", id="not-a-number is refused"),
        pytest.param(True, "expected a duration", id="a boolean is refused"),
        pytest.param(None, "expected a duration", id="nothing is refused"),
        pytest.param([60], "expected a duration", id="an array is refused"),
    ],
)
def test_parse_duration_refuses(value, message):
    with pytest.raises(ValueError, match=message):
        parse_duration(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(8 * HOUR, "8h", id="whole hours"),
        pytest.param(5400, "1h30m", id="hours and minutes"),
        pytest.param(7 * 86400, "7d", id="days"),
        pytest.param(90, "1m30s", id="minutes and seconds"),
        pytest.param(0, "0s", id="zero"),
        pytest.param(0.5, "0.5s", id="a fraction of a second"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


# ---- valid files ------------------------------------------------------------


def test_entitlement_is_the_product_of_share_fractions_down_the_path():
    config = parse(GPU_TYPES + NODE + TREE)
    entitlements = config.tree.entitlements
    assert entitlements["org"] == pytest.approx(1.0)
    assert entitlements["research"] == pytest.approx(0.70)
    assert entitlements["a1"] == pytest.approx(0.35)
    assert entitlements["a2"] == pytest.approx(0.35)
    assert entitlements["b1"] == pytest.approx(0.20)
    assert entitlements["b2"] == pytest.approx(0.10)
    assert config.tree.projects == ("a1", "a2", "b1", "b2")
    assert [a.name for a in config.accounts] == [
        "org",
        "research",
        "infra",
        "a1",
        "a2",
        "b1",
        "b2",
    ]


def test_members_are_kept_per_project_and_every_project_has_an_entry():
    config = parse(GPU_TYPES + NODE + TREE)
    assert config.members["a1"] == Members(frozenset({"alice", "bob"}), frozenset())
    assert config.members["a2"] == Members(frozenset(), frozenset({"nlp-team"}))
    assert config.members["b1"] == Members()
    assert set(config.members) == {"a1", "a2", "b1", "b2"}


@pytest.mark.parametrize(
    ("user", "groups", "admitted"),
    [
        pytest.param("alice", [], True, id="a listed user is admitted"),
        pytest.param("eve", ["nlp-team"], True, id="a member of a listed group is admitted"),
        pytest.param("eve", ["other"], False, id="anyone else is not"),
        pytest.param("nlp-team", [], False, id="a group name is not a user name"),
    ],
)
def test_members_admit(user, groups, admitted):
    members = Members(frozenset({"alice"}), frozenset({"nlp-team"}))
    assert members.admits(user, groups) is admitted


def test_projects_for_lists_the_projects_a_user_may_charge():
    config = parse(GPU_TYPES + NODE + TREE)
    assert config.projects_for("alice") == ("a1",)
    assert config.projects_for("zoe", ["nlp-team"]) == ("a2",)
    assert config.projects_for("zoe") == ()


def test_a_minimal_file_gets_the_builtin_policy_and_defaults():
    config = parse(MINIMAL)
    assert config.policy == Policy()
    assert config.defaults == BUILTIN_DEFAULTS
    assert config.admins == frozenset()
    assert config.nodes == (Node("gpu-01", "h100", 8),)
    assert config.gpu_type_weights == {"h100": 1.0}
    assert config.source == "test.toml"
    assert config.members == {"solo": Members()}


def test_nodes_are_optional_since_inventory_may_be_discovered():
    config = parse(GPU_TYPES + PROJECT)
    assert config.nodes == ()


def test_every_policy_key_is_read_with_its_units():
    config = parse(
        MINIMAL
        + """
[policy]
window = "14d"
half_life = "3d"
max_min_runtime = "4h"
grace_period = 30
debug_max_gpus = 1
debug_max_min_runtime = "10m"
debug_lane_fraction = 0.1
debug_headroom = 2
max_reservations = 0
[policy.project_gpu_caps]
solo = 4
"""
    )
    assert config.policy == Policy(
        window=14 * 86400.0,
        half_life=3 * 86400.0,
        max_min_runtime=4 * HOUR,
        grace_period=30.0,
        debug_max_gpus=1,
        debug_max_min_runtime=600.0,
        debug_lane_fraction=0.1,
        max_reservations=0,
        project_gpu_caps={"solo": 4},
        debug_headroom=2,
    )


def test_kind_defaults_override_only_the_keys_given():
    config = parse(
        MINIMAL
        + """
[defaults.interactive]
min_runtime = "15m"
max_runtime = "8h"
[defaults.batch]
resumable = false
"""
    )
    assert config.defaults[SliceKind.INTERACTIVE] == KindDefaults(900.0, False, 8 * HOUR)
    assert config.defaults[SliceKind.BATCH] == KindDefaults(2 * HOUR, False, None)
    assert config.defaults[SliceKind.BATCH].contract().allocated


def test_a_mig_profile_is_a_gpu_type_when_quoted():
    config = parse(
        '[gpu_types]\n"h100-1g.10gb" = 0.15\n'
        '[[nodes]]\nname = "mig-01"\ngpu_type = "h100-1g.10gb"\ngpus = 7\n' + PROJECT
    )
    assert config.nodes == (Node("mig-01", "h100-1g.10gb", 7),)
    assert config.gpu_type_weights == {"h100-1g.10gb": 0.15}


def test_admins_are_read():
    config = parse('admins = ["root", "ops"]\n' + MINIMAL)
    assert config.admins == {"root", "ops"}
    assert config.is_admin("ops")
    assert not config.is_admin("alice")


def test_the_demo_file_is_valid_and_as_documented():
    config = load_config(DEMO_CONFIG)
    assert config.nodes == (Node("demo-0", "h100", 8),)
    assert config.gpu_type_weights == {"h100": 1.0, "b200": 2.0}
    assert config.tree.entitlements["vision"] == pytest.approx(0.35)
    assert len(config.tree.projects) == 4
    assert len(config.tree.paths["vision"]) == 3
    assert config.members["nlp"].groups == {"nlp-team"}


# ---- invalid files ----------------------------------------------------------

INVALID = [
    # (id, file text, where, part of the message)
    ("a misspelt top-level key is named", "polcy = {}\n" + MINIMAL, "polcy", "'policy'"),
    (
        "a misspelt policy key is named",
        MINIMAL + "[policy]\nwindw = '7d'\n",
        "policy.windw",
        "did you mean 'window'",
    ),
    (
        "a misspelt project key is named",
        GPU_TYPES + "[projects.nlp]\nshares = 3\n",
        "projects.nlp.shares",
        "did you mean 'share'",
    ),
    (
        "a misspelt node key is named",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\ngpu = 8\n',
        "nodes[0].gpu",
        "unknown key 'gpu'",
    ),
    (
        "a nested project table explains how sub-accounts are declared",
        GPU_TYPES + "[projects.ai2]\n[projects.ai2.nlp]\nshare = 1\n",
        "projects.ai2.nlp",
        'parent = "ai2"',
    ),
    (
        "a node with zero GPUs is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\ngpus = 0\n',
        "nodes[0].gpus",
        ">= 1, got 0",
    ),
    (
        "a node with a negative GPU count is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\ngpus = -8\n',
        "nodes[0].gpus",
        ">= 1, got -8",
    ),
    (
        "a fractional GPU count is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\ngpus = 8.0\n',
        "nodes[0].gpus",
        "whole number",
    ),
    (
        "a GPU count given as text is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\ngpus = "8"\n',
        "nodes[0].gpus",
        "got a string",
    ),
    (
        "the third node is named by its index",
        GPU_TYPES
        + PROJECT
        + NODE
        + '[[nodes]]\nname = "b"\ngpu_type = "h100"\ngpus = 8\n'
        + '[[nodes]]\nname = "c"\ngpu_type = "h100"\ngpus = true\n',
        "nodes[2].gpus",
        "got a boolean",
    ),
    (
        "a node without a GPU count is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h100"\n',
        "nodes[0]",
        "missing key 'gpus'",
    ),
    (
        "a node with an undeclared GPU type is refused",
        GPU_TYPES + PROJECT + '[[nodes]]\nname = "a"\ngpu_type = "h10O"\ngpus = 8\n',
        "nodes[0].gpu_type",
        "'h10O' is not declared in [gpu_types] (did you mean 'h100'?)",
    ),
    (
        "nodes are refused when no GPU type is declared at all",
        PROJECT + NODE,
        "nodes[0].gpu_type",
        "not declared in [gpu_types]",
    ),
    (
        "two nodes with the same name are refused",
        MINIMAL + NODE,
        "nodes[1].name",
        "'gpu-01' is declared twice (first as nodes[0])",
    ),
    (
        "nodes as a single table are refused",
        GPU_TYPES + PROJECT + '[nodes]\nname = "a"\n',
        "nodes",
        "[[nodes]]",
    ),
    (
        "a zero GPU type weight is refused",
        "[gpu_types]\nh100 = 0\n" + PROJECT,
        "gpu_types.h100",
        "number > 0",
    ),
    (
        "an unquoted MIG profile explains the quoting",
        "[gpu_types]\nh100-1g.10gb = 0.15\n" + PROJECT,
        "gpu_types.h100-1g",
        '"h100-1g.10gb"',
    ),
    ("a file without projects is refused", GPU_TYPES + NODE, "projects", "no projects"),
    (
        "a zero share is refused",
        MINIMAL + "[projects.nlp]\nshare = 0\n",
        "projects.nlp.share",
        "number > 0, got 0",
    ),
    (
        "a negative share is refused",
        MINIMAL + "[projects.nlp]\nshare = -1\n",
        "projects.nlp.share",
        "number > 0, got -1",
    ),
    (
        "a share given as text is refused",
        MINIMAL + '[projects.nlp]\nshare = "3"\n',
        "projects.nlp.share",
        "got a string",
    ),
    (
        "a parent that does not exist is refused",
        MINIMAL + '[projects.nlp]\nparent = "ai3"\n',
        "projects.nlp.parent",
        "'ai3' does not exist",
    ),
    (
        "a cycle in the tree is refused",
        MINIMAL + '[projects.a]\nparent = "b"\n[projects.b]\nparent = "a"\n',
        "projects.a.parent",
        "cycle",
    ),
    (
        "an account that is its own parent is refused",
        MINIMAL + '[projects.a]\nparent = "a"\n',
        "projects.a.parent",
        "cycle: a -> a",
    ),
    (
        "members on an account with sub-accounts are refused",
        MINIMAL + '[projects.org]\nusers = ["alice"]\n[projects.nlp]\nparent = "org"\n',
        "projects.org.users",
        "members belong on projects",
    ),
    (
        "groups on an account with sub-accounts are refused",
        MINIMAL + '[projects.org]\ngroups = ["staff"]\n[projects.nlp]\nparent = "org"\n',
        "projects.org.groups",
        "sub-accounts (nlp)",
    ),
    (
        "users given as one string are refused",
        MINIMAL + '[projects.nlp]\nusers = "alice"\n',
        "projects.nlp.users",
        "array of strings",
    ),
    (
        "an empty user name is refused",
        MINIMAL + '[projects.nlp]\nusers = ["alice", ""]\n',
        "projects.nlp.users[1]",
        "non-empty string",
    ),
    (
        "an account name with a slash is refused",
        MINIMAL + '[projects."a/b"]\n',
        'projects."a/b"',
        "letters, digits",
    ),
    (
        "a default min_runtime above max_min_runtime is refused",
        MINIMAL + '[policy]\nmax_min_runtime = "4h"\n[defaults.batch]\nmin_runtime = "6h"\n',
        "defaults.batch.min_runtime",
        "6h is above the cap policy.max_min_runtime (4h)",
    ),
    (
        "a default max_runtime below its min_runtime is refused",
        MINIMAL + '[defaults.interactive]\nmin_runtime = "2h"\nmax_runtime = "1h"\n',
        "defaults.interactive.max_runtime",
        "1h is below min_runtime (2h)",
    ),
    (
        "an unknown slice kind in defaults is refused",
        MINIMAL + '[defaults.debug]\nmin_runtime = "15m"\n',
        "defaults.debug",
        "unknown slice kind 'debug'",
    ),
    (
        "resumable given as text is refused",
        MINIMAL + '[defaults.batch]\nresumable = "yes"\n',
        "defaults.batch.resumable",
        "true or false",
    ),
    (
        "a debug lane fraction of zero is refused",
        MINIMAL + "[policy]\ndebug_lane_fraction = 0\n",
        "policy.debug_lane_fraction",
        "(0, 1]",
    ),
    (
        "a negative debug headroom is refused",
        MINIMAL + "[policy]\ndebug_headroom = -1\n",
        "policy.debug_headroom",
        "whole number",
    ),
    (
        "a debug lane fraction above one is refused",
        MINIMAL + "[policy]\ndebug_lane_fraction = 5\n",
        "policy.debug_lane_fraction",
        "(0, 1]",
    ),
    (
        "a debug contract cap above max_min_runtime is refused",
        MINIMAL + '[policy]\nmax_min_runtime = "10m"\n',
        "policy.debug_max_min_runtime",
        "15m is above max_min_runtime (10m)",
    ),
    (
        "a cap on an unknown project is refused",
        MINIMAL + "[policy.project_gpu_caps]\nsolos = 4\n",
        "policy.project_gpu_caps.solos",
        "no project 'solos' (did you mean 'solo'?)",
    ),
    (
        "a cap on an account with sub-accounts is refused",
        MINIMAL + '[projects.nlp]\nparent = "org"\n[projects.org]\n'
        "[policy.project_gpu_caps]\norg = 4\n",
        "policy.project_gpu_caps.org",
        "caps apply to projects",
    ),
    (
        "a zero cap is refused",
        MINIMAL + "[policy.project_gpu_caps]\nsolo = 0\n",
        "policy.project_gpu_caps.solo",
        ">= 1",
    ),
    (
        "an invalid duration is refused",
        MINIMAL + '[policy]\nwindow = "7 days"\n',
        "policy.window",
        "invalid duration '7 days'",
    ),
    (
        "a zero window is refused",
        MINIMAL + "[policy]\nwindow = 0\n",
        "policy.window",
        "duration > 0",
    ),
    (
        "a negative grace period is refused",
        MINIMAL + "[policy]\ngrace_period = -5\n",
        "policy.grace_period",
        "must not be negative",
    ),
    (
        "a negative reservation count is refused",
        MINIMAL + "[policy]\nmax_reservations = -1\n",
        "policy.max_reservations",
        ">= 0",
    ),
    (
        "a policy given as a value instead of a table is refused",
        "policy = 3\n" + MINIMAL,
        "policy",
        "expected a table",
    ),
    (
        "admins given as one string are refused",
        'admins = "root"\n' + MINIMAL,
        "admins",
        "array of strings",
    ),
]


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [pytest.param(text, where, message, id=name) for name, text, where, message in INVALID],
)
def test_invalid_files_name_the_key_and_the_mistake(tmp_path, text, where, message):
    with pytest.raises(InvalidConfig) as caught:
        load_config(write(tmp_path, text))
    assert caught.value.where == where
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        pytest.param(
            "a = \n", "line 1, column 5", "invalid TOML: Invalid value", id="a value missing"
        ),
        pytest.param(
            PROJECT + "[projects.solo]\n",
            "line 2, column 15",
            "invalid TOML: Cannot declare",
            id="a table declared twice",
        ),
        pytest.param(
            "share = 1\nshare = 2\n",
            "line 2, column 10",
            "invalid TOML: Cannot overwrite a value",
            id="a key given twice",
        ),
        pytest.param(
            'admins = ["root',
            "end of document",
            "invalid TOML: Unterminated string",
            id="a string left open at the end",
        ),
    ],
)
def test_toml_syntax_errors_give_line_and_column(tmp_path, text, where, message):
    with pytest.raises(InvalidConfig) as caught:
        load_config(write(tmp_path, text))
    assert caught.value.where == where
    assert message in str(caught.value)


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(InvalidConfig, match="no such file"):
        load_config(tmp_path / "nope.toml")


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'admins = ["j\xf6rg"]\n')
    with pytest.raises(InvalidConfig, match="not UTF-8"):
        load_config(path)


def test_parse_config_refuses_a_non_table():
    with pytest.raises(InvalidConfig, match="expected a table"):
        parse_config([])  # type: ignore[arg-type]


# ---- slicebroker check-config -----------------------------------------------


def test_check_config_summarises_a_valid_file(capsys):
    assert main(["check-config", str(DEMO_CONFIG)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "ok" in out.splitlines()[0]
    vision = next(line for line in out.splitlines() if line.strip().startswith("vision"))
    assert "35.0%" in vision
    assert "alice, bob" in vision
    assert any("h100" in line and "8 GPUs on 1 node" in line for line in out.splitlines())


def test_check_config_prints_one_line_for_an_invalid_file(tmp_path, capsys):
    path = write(tmp_path, MINIMAL + "[projects.nlp]\nshare = 0\n")
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: {path}: projects.nlp.share: expected a share, a number > 0, got 0\n"


def test_check_config_prints_one_line_for_a_syntax_error(tmp_path, capsys):
    path = write(tmp_path, "[policy\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: line 1, column 8: invalid TOML: ")
    assert err.count("\n") == 1


def test_check_config_prints_one_line_for_a_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.toml"
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}: no such file\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([], "required: COMMAND", id="no command is a usage error"),
        pytest.param(["check-config"], "required: FILE", id="check-config without a file"),
        pytest.param(["frobnicate"], "invalid choice", id="an unknown command"),
        pytest.param(["check-config", "a", "b"], "unrecognized arguments", id="an extra argument"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert err.count("\n") == 1


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "check-config" in capsys.readouterr().out


def test_the_module_runs_as_a_command(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "broker.cli", "check-config", str(DEMO_CONFIG)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "35.0%" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "broker.cli", "check-config", str(tmp_path / "nope.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "Traceback" not in bad.stderr


def test_a_retired_policy_key_loads_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="broker.config"):
        config = parse(MINIMAL + '[policy]\nfairshare_horizon = "1h"\n')
    assert config.policy == Policy()
    assert "policy.fairshare_horizon is retired" in caplog.text
    assert "GPUs projects hold now" in caplog.text


@pytest.mark.parametrize(("value", "message"), [(0.5, "a factor ≥ 1"), ("2", "a factor ≥ 1")])
def test_preemption_backoff_is_a_factor_of_at_least_one(value, message):
    with pytest.raises(InvalidConfig, match=message) as err:
        parse(MINIMAL + f"[policy]\npreemption_backoff = {value!r}\n".replace("'", '"'))
    assert err.value.where == "policy.preemption_backoff"
    assert parse(MINIMAL + "[policy]\npreemption_backoff = 1.5\n").policy.preemption_backoff == 1.5


def test_the_rules_of_preemption_by_waiting_are_set_in_the_policy_table():
    policy = parse(
        MINIMAL
        + "[policy]\n"
        + 'batch_preemption_delay = "30m"\ninteractive_preemption_delay = "2m"\n'
        + 'debug_preemption_delay = "0s"\ndebug_grace_period = "15s"\npreemption_budget = 2\n'
    ).policy
    assert (
        policy.batch_preemption_delay,
        policy.interactive_preemption_delay,
        policy.debug_preemption_delay,
        policy.debug_grace_period,
        policy.preemption_budget,
    ) == (1800.0, 120.0, 0.0, 15.0, 2)
    # 0 turns the budget off; the defaults when nothing is set
    assert parse(MINIMAL + "[policy]\npreemption_budget = 0\n").policy.preemption_budget is None
    assert parse(MINIMAL).policy.preemption_budget == 5
    assert parse(MINIMAL + "[policy]\ndebug_first = true\n").policy.debug_first is True
    assert parse(MINIMAL).policy.debug_first is False
    margin = parse(MINIMAL + "[policy]\nfair_share_margin = 0.5\n").policy.fair_share_margin
    assert (margin, parse(MINIMAL).policy.fair_share_margin) == (0.5, 0.0)
    assert parse(MINIMAL + "[policy]\nfair_share_margin = 0\n").policy.fair_share_margin == 0.0


def test_the_lease_lapse_limit_reads_from_the_policy_with_its_defaults():
    policy = parse(MINIMAL + "[policy]\nlease_lapse_floor = 3\nlease_lapse_fraction = 0\n").policy
    assert (policy.lease_lapse_floor, policy.lease_lapse_fraction) == (3, 0.0)
    default = parse(MINIMAL).policy
    assert (default.lease_lapse_floor, default.lease_lapse_fraction) == (10, 0.05)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("preemption_budget", "-1", "a number of preemptions"),
        ("preemption_budget", "1.5", "a number of preemptions"),
        ("batch_preemption_delay", '"soon"', "duration"),
        ("debug_first", '"yes"', "expected true or false"),
        ("fair_share_margin", "-0.1", "a margin in shares, a number ≥ 0, got -0.1"),
        ("fair_share_margin", "1.5", "a margin in shares from 0 to 1"),
        ("fair_share_margin", "nan", "a margin in shares, a number ≥ 0, got nan"),
        ("fair_share_margin", '"half"', "a margin in shares, a number ≥ 0, got a string"),
        ("fair_share_margin", "true", "a margin in shares, a number ≥ 0, got a boolean"),
        ("lease_lapse_floor", "0", "a number of slices per minute, a whole number >= 1"),
        ("lease_lapse_floor", "2.5", "a number of slices per minute"),
        ("lease_lapse_fraction", "1.5", "a fraction of the leased slices per minute in [0, 1]"),
        ("lease_lapse_fraction", "-0.1", "a fraction in [0, 1], a number ≥ 0, got -0.1"),
    ],
)
def test_a_wrong_preemption_setting_is_refused_where_it_is(key, value, message):
    with pytest.raises(InvalidConfig) as err:
        parse(MINIMAL + f"[policy]\n{key} = {value}\n")
    assert err.value.where == f"policy.{key}"
    assert message in str(err.value)


def test_every_policy_key_the_file_takes_has_a_row_in_the_configuration_page():
    page = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    policy = page.split("## `[policy]`", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `\[?(?:policy\.)?([a-z_]+)\]?` \|", policy, re.M))
    assert set(_POLICY_KEYS) - rows == set()
