"""``python -m broker.bench pass``: the state it times the service's case from."""

from __future__ import annotations

import pytest

from broker.bench.__main__ import main
from broker.bench.scheduling import Scale, settled, synthetic_snapshot
from broker.core.scheduler import schedule
from broker.sim.bench import main as simulator_bench


def test_the_settled_snapshot_is_one_its_next_pass_leaves_alone():
    start = synthetic_snapshot(Scale(nodes=8, projects=6, slices=150))
    assert schedule(start).preemptions  # the synthetic state is not one a pass left
    calm, passes = settled(start)
    decided = schedule(calm)
    assert passes > 1 and calm.now > start.now
    assert (decided.grants, decided.preemptions, decided.endings) == ((), (), ())
    assert sum(s.holds_gpus for s in calm.slices) > 0 and decided.queue  # still full, work waits


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pass", "--repeat", "0"], "argument --repeat: takes a whole number, 1 or more, not '0'"),
        (
            ["pass", "--factors", "1,x"],
            "argument --factors: takes whole numbers, 1 or more, comma-separated, not '1,x'",
        ),
        (["api", "--open-loop", "--rate", "0"], "argument --rate: takes a rate above 0, not '0'"),
        (
            ["api", "--rates", "50,nan"],
            "argument --rates: takes rates above 0, comma-separated, not '50,nan'",
        ),
        (
            ["api", "--clients", "-1"],
            "argument --clients: takes a whole number, 1 or more, not '-1'",
        ),
        (["whatif", "--seconds", "inf"], "argument --seconds: takes seconds, above 0, not 'inf'"),
        (
            ["storepass", "--live", "-1"],
            "argument --live: takes a whole number, 0 or more, not '-1'",
        ),
    ],
)
def test_a_bad_figure_is_one_line_and_status_2_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sample-days", "0"], "argument --sample-days: takes days, above 0, not '0'"),
        (["--days", "nan"], "argument --days: takes days, above 0, not 'nan'"),
        (["--slices", "0"], "argument --slices: takes a whole number, 1 or more"),
        (["--policies", "ours"], "unknown policy ours; choose from fairshare, priority"),
        (["--policies", ","], "unknown policy (none)"),
    ],
)
def test_the_simulators_bench_refuses_a_bad_figure_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        simulator_bench(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
