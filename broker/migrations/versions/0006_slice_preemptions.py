"""A slice's preemption budget: slices.preemptions and slices.queued_at.

A job is preempted at most ``preemption_budget`` times, and a requeued victim
waits for releases from when it went back to the queue, not from its first
submission (design.md §5.7).

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Slices already preempted before this revision start with a full budget.
    op.add_column(
        "slices", sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("slices", sa.Column("queued_at", sa.Float(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite 3.35 and later): a batch copy of the table would
    # break the foreign keys of the slices' events.
    op.drop_column("slices", "queued_at")
    op.drop_column("slices", "preemptions")
