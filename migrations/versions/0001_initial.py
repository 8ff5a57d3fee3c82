"""The log: runs, events, epochs, payloads, snapshots.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = ("eventstore",)
depends_on = None


def upgrade() -> None:
    """Create the four tables and the audit indexes."""
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("config_fingerprint", sa.String(128), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("current_epoch", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name="pk_runs"),
    )
    op.create_table(
        "events",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("train_step", sa.BigInteger(), nullable=True),
        sa.Column("weight_version", sa.BigInteger(), nullable=True),
        sa.Column("group_id", sa.BigInteger(), nullable=True),
        sa.Column("prompt_index", sa.BigInteger(), nullable=True),
        sa.Column("target_step", sa.BigInteger(), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_events"),
    )
    op.create_index("ix_events_run_group", "events", ["run_id", "group_id"])
    op.create_index("ix_events_run_prompt", "events", ["run_id", "prompt_index"])
    op.create_index("ix_events_run_train_step", "events", ["run_id", "train_step"])
    op.create_index("ix_events_run_target_step", "events", ["run_id", "target_step"])
    op.create_table(
        "epochs",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resume_seq", sa.BigInteger(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "epoch", name="pk_epochs"),
    )
    op.create_table(
        "payloads",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("payload_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "payload_id", name="pk_payloads"),
    )
    op.create_table(
        "snapshots",
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "seq", name="pk_snapshots"),
    )


def downgrade() -> None:
    """Drop everything the upgrade created."""
    op.drop_table("snapshots")
    op.drop_table("payloads")
    op.drop_table("epochs")
    op.drop_index("ix_events_run_target_step", table_name="events")
    op.drop_index("ix_events_run_train_step", table_name="events")
    op.drop_index("ix_events_run_prompt", table_name="events")
    op.drop_index("ix_events_run_group", table_name="events")
    op.drop_table("events")
    op.drop_table("runs")
