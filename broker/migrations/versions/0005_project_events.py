"""Project events: every change of the project tree, with who made it and when.

The database is the record of the project tree and its members; the cluster
file only seeds it on the first start.

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "project_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("account", sa.String(length=255), nullable=False),
        sa.Column("who", sa.String(length=255), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_project_events")),
    )
    op.create_index(op.f("ix_project_events_account"), "project_events", ["account"])
    op.create_index(op.f("ix_project_events_at"), "project_events", ["at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_project_events_at"), table_name="project_events")
    op.drop_index(op.f("ix_project_events_account"), table_name="project_events")
    op.drop_table("project_events")
