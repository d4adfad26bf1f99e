"""The slice that took a withdrawn one's place: slices.replaced_by.

A waiting slice replaced by one of its alternatives (POST /slices/{id}/replace)
ends cancelled and names its successor, so that whoever holds it (the spawner,
the batch runner) follows it (design.md §5.8).

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("slices", sa.Column("replaced_by", sa.Integer(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN, as in 0006: a batch copy would break the events' foreign keys.
    op.drop_column("slices", "replaced_by")
