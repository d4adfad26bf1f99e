"""Initial schema: accounts, members, GPU types, nodes, slices, events, ledger, API tokens.

Revision ID: 0001
Revises:
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("parent", sa.String(length=255), nullable=True),
        sa.Column("share", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_accounts")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("hashed", sa.String(length=255), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("hashed", name=op.f("uq_api_tokens_hashed")),
    )
    op.create_table(
        "gpu_types",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_gpu_types")),
    )
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("gpu_type", sa.String(length=255), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("state_changed_at", sa.Float(), nullable=True),
        sa.Column("state_reason", sa.String(length=1024), nullable=False),
        sa.Column("in_config", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_nodes")),
    )
    op.create_table(
        "slices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=255), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(length=255), nullable=True),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("min_runtime", sa.Float(), nullable=False),
        sa.Column("resumable", sa.Boolean(), nullable=False),
        sa.Column("max_runtime", sa.Float(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("submitted_at", sa.Float(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("placements", sa.JSON(), nullable=False),
        sa.Column("granted_at", sa.Float(), nullable=True),
        sa.Column("preempt_deadline", sa.Float(), nullable=True),
        sa.Column("preempt_reason", sa.String(length=32), nullable=True),
        sa.Column("promised", sa.JSON(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.Column("charged_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("queue_position", sa.Integer(), nullable=True),
        sa.Column("fairshare_value", sa.Float(), nullable=True),
        sa.Column("estimated_start", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_slices")),
    )
    op.create_index(op.f("ix_slices_project"), "slices", ["project"])
    op.create_index(op.f("ix_slices_state"), "slices", ["state"])
    op.create_index(op.f("ix_slices_user"), "slices", ["user"])
    op.create_table(
        "ledger",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("slice_id", sa.Integer(), nullable=False),
        sa.Column("project", sa.String(length=255), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=False),
        sa.Column("start", sa.Float(), nullable=False),
        sa.Column("end", sa.Float(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["slice_id"], ["slices.id"], name=op.f("fk_ledger_slice_id_slices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger")),
    )
    op.create_index(op.f("ix_ledger_end"), "ledger", ["end"])
    op.create_index(op.f("ix_ledger_project_end"), "ledger", ["project", "end"])
    op.create_table(
        "members",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.CheckConstraint("kind IN ('user', 'group')", name=op.f("ck_members_kind")),
        sa.ForeignKeyConstraint(
            ["project"],
            ["accounts.name"],
            name=op.f("fk_members_project_accounts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_members")),
        sa.UniqueConstraint("project", "kind", "name", name=op.f("uq_members_project_kind_name")),
    )
    op.create_table(
        "slice_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("slice_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=1024), nullable=False),
        sa.ForeignKeyConstraint(
            ["slice_id"], ["slices.id"], name=op.f("fk_slice_events_slice_id_slices")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_slice_events")),
    )
    op.create_index(op.f("ix_slice_events_slice_id"), "slice_events", ["slice_id"])


def downgrade() -> None:
    op.drop_table("slice_events")
    op.drop_table("members")
    op.drop_table("ledger")
    op.drop_table("slices")
    op.drop_table("nodes")
    op.drop_table("gpu_types")
    op.drop_table("api_tokens")
    op.drop_table("accounts")
