"""Prometheus metrics (see :mod:`broker.service.metrics` for what is exported)."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from ...budget import gpus_kept_to_end
from ..metrics import CONTENT_TYPE, BrokerMetrics
from ..runner import DatabaseTimeout
from .base import APIHandler, Operation, log

#: How long a scrape waits for the database before it answers with the gauges of the
#: last scrape (a hung database must not fail the scrape that would show it).
DB_WAIT_S = 2.0


def _describe_metrics() -> str:
    """One line per metric family, from a fresh registry: name, type and help."""
    lines = []
    for family in BrokerMetrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        lines.append(f"- `{name}` ({family.type}): {family.documentation}")
    return "\n".join(lines)


class MetricsHandler(APIHandler):
    operations = {
        "get": Operation(
            "Get Prometheus metrics",
            "The text exposition format. Needs a token unless the broker runs with "
            "`authenticate_metrics` off. Gauges describe the present (read from the "
            "database at each scrape, or as the last scrape left them when the database "
            f"does not answer within {DB_WAIT_S:g} s); counters and histograms count since this "
            "process started.\n\n" + _describe_metrics(),
            auth="metrics",
            content={"text/plain": None},
        )
    }

    async def get(self) -> None:
        broker = self.broker

        def read():
            return broker.nodes(), broker.projects(), broker.list_slices(state="pending")

        metrics = self.runner.metrics
        try:
            nodes, projects, pending = await self.runner.run_within(DB_WAIT_S, read)
        except (DatabaseTimeout, OperationalError) as err:
            log.warning("metrics: gauges as last scraped (%s)", str(err).splitlines()[0])
        else:
            metrics.set_state(nodes, projects, pending)
        metrics.long_polls.set(len(self.runner.watchers))
        budget = broker.config.policy.preemption_budget
        metrics.gpus_kept.set(gpus_kept_to_end(self.runner.remembered_live(), budget))
        self.set_header("Content-Type", CONTENT_TYPE)
        self.finish(metrics.exposition())


default_handlers = [("/metrics", MetricsHandler)]
