"""Who drained a node: nodes.drained_by ('admin', 'inventory' or NULL).

A node that is draining or drained when this runs was drained by an admin as
far as anyone can tell (before, only an admin or a cordon could drain, and
nothing recorded which): it stays out of service until an admin undrains it.

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch_op:
        batch_op.add_column(sa.Column("drained_by", sa.String(length=16), nullable=True))
        batch_op.create_check_constraint(
            op.f("ck_nodes_drained_by"), "drained_by IN ('admin', 'inventory')"
        )
    op.execute("UPDATE nodes SET drained_by = 'admin' WHERE state IN ('draining', 'drained')")


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch_op:
        batch_op.drop_constraint(op.f("ck_nodes_drained_by"), type_="check")
        batch_op.drop_column("drained_by")
