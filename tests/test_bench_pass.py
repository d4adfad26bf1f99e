"""``python -m broker.bench pass``: the state it times the service's case from."""

from __future__ import annotations

from broker.bench.scheduling import Scale, settled, synthetic_snapshot
from broker.core.scheduler import schedule


def test_the_settled_snapshot_is_one_its_next_pass_leaves_alone():
    start = synthetic_snapshot(Scale(nodes=8, projects=6, slices=150))
    assert schedule(start).preemptions  # the synthetic state is not one a pass left
    calm, passes = settled(start)
    decided = schedule(calm)
    assert passes > 1 and calm.now > start.now
    assert (decided.grants, decided.preemptions, decided.endings) == ((), (), ())
    assert sum(s.holds_gpus for s in calm.slices) > 0 and decided.queue  # still full, work waits
