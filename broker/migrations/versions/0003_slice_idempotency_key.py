"""Idempotency keys of submissions: slices.idempotency_key and slices.request_digest.

A client that retries ``POST /slices`` with the same ``Idempotency-Key`` gets
the slice its first attempt made. Slices submitted before have no key.

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("slices") as batch_op:
        batch_op.add_column(sa.Column("idempotency_key", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("request_digest", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(
            op.f("uq_slices_user_idempotency_key"), ["user", "idempotency_key"]
        )


def downgrade() -> None:
    with op.batch_alter_table("slices") as batch_op:
        batch_op.drop_constraint(op.f("uq_slices_user_idempotency_key"), type_="unique")
        batch_op.drop_column("request_digest")
        batch_op.drop_column("idempotency_key")
