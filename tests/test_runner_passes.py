"""A submission granted at once ran the pass itself: the runner takes that pass in
as any pass (metrics, news, the live copy) and runs no second one for it."""

from __future__ import annotations

import tomllib

from servicefixtures import TEST_CONFIG

from broker.config import parse_config
from broker.service.runner import BrokerRunner
from broker.store import Broker


async def test_a_submission_granted_at_once_is_the_pass(tmp_path):
    # Deadlines far off (a 2-hour lease, 1-hour batch protection) against a timed
    # pass every 10 minutes: nothing falls due before the loop looks again.
    broker = Broker(
        f"sqlite:///{tmp_path / 'b.sqlite'}",
        parse_config(tomllib.loads(TEST_CONFIG)),
        lease=7200.0,
        grant_at_once=True,
    )
    runner = BrokerRunner(broker, pass_interval=600.0)
    runner.start()
    try:
        await runner.started()
        passes = runner.passes
        made = await runner.change(
            broker.submit, user="alice", project="vision", gpus=1, kind="batch"
        )
        assert made["state"] == "granted"
        assert runner.passes == passes + 1  # the submission's own pass, taken in
        assert runner.remembered(made["id"])["state"] == "granted"
        assert not runner.pass_requested  # and no second pass asked for it
        # With something already waiting, a submission waits for the loop's pass.
        for _ in range(3):  # the two 4-GPU nodes cannot hold three more of 4
            await runner.change(broker.submit, user="alice", project="vision", gpus=4, kind="batch")
        assert runner.pass_requested
        before = runner.passes
        await runner.run_pass()  # the loop's pass, as it will run it: one more
        assert runner.passes == before + 1
    finally:
        await runner.stop()
