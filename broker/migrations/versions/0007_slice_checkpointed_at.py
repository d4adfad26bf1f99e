"""A slice's last reported checkpoint: slices.checkpointed_at.

Among otherwise equal victims, the one with the least work since its grant or
its last checkpoint is preempted first (design.md §5.3).

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("slices", sa.Column("checkpointed_at", sa.Float(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN, as in 0006: a batch copy would break the events' foreign keys.
    op.drop_column("slices", "checkpointed_at")
