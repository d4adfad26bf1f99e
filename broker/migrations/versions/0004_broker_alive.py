"""When a broker last ran a pass: broker_alive.alive_at.

A lease never lapses because of the broker's own trouble: a pass that finds the
last one further back than a normal gap (a restart, a database outage) first
extends every live lease by that long.

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "broker_alive",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alive_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_alive")),
    )


def downgrade() -> None:
    op.drop_table("broker_alive")
