"""Passes over the data in the audit views: ``group_lifecycle`` and ``prompt_outcomes``
get a ``data_pass`` column.

Revision ID: 0007_prompt_passes
Revises: 0006_rollout_views
Create Date: 2026-12-04

A prompt's identity is ``(data_pass, prompt_index)``: a run with ``passes: N`` pulls each
dataset index once per pass. The pass is read from each pulling event's payload (the
``data_pass`` field of ``GroupAdmitted`` / ``SparePulled``; absent in logs written before
passes existed, read as 0), so ``rollout_index`` needs no new column. Every other view
is 0006's, unchanged; the views are dropped and re-created (dependents first), as 0006's
docstring asks of a revision that changes one.
"""

from __future__ import annotations

from alembic import context, op

revision = "0007_prompt_passes"
down_revision = "0006_rollout_views"
branch_labels = None
depends_on = None


def _previous(dialect: str) -> dict[str, str]:
    prior = context.script.get_revision("0006_rollout_views")
    assert prior is not None and prior.module is not None
    return dict(prior.module.view_sql(dialect))


def _pass_expr(dialect: str) -> str:
    # The payload is JSON text (see 0002): the pass of a pulled prompt, 0 when absent.
    if dialect == "postgresql":
        raw = "CAST(payload::jsonb ->> 'data_pass' AS BIGINT)"
    else:
        raw = "CAST(json_extract(payload, '$.data_pass') AS INTEGER)"
    return f"COALESCE(MAX(CASE WHEN type IN ('GroupAdmitted', 'SparePulled') THEN {raw} END), 0)"


def _swap(sql: str, old: str, new: str) -> str:
    assert sql.count(old) == 1, f"frozen view SQL changed: {old!r}"
    return sql.replace(old, new)


def view_sql(dialect: str) -> dict[str, str]:
    """The ``SELECT`` of every view for ``dialect``, in creation order."""
    sql = _previous(dialect)
    anchor = "        MAX(prompt_index) AS prompt_index,\n"
    lifecycle = _swap(
        sql["group_lifecycle"], anchor, f"{anchor}        {_pass_expr(dialect)} AS data_pass,\n"
    )
    sql["group_lifecycle"] = _swap(
        lifecycle,
        "SELECT g.run_id, g.group_id, g.prompt_index,",
        "SELECT g.run_id, g.group_id, g.prompt_index, g.data_pass,",
    )
    sql["prompt_outcomes"] = _swap(
        sql["prompt_outcomes"],
        "SELECT run_id, prompt_index, group_id,",
        "SELECT run_id, prompt_index, data_pass, group_id,",
    )
    return sql


def upgrade() -> None:
    """Re-create the audit views with the pass columns."""
    dialect = op.get_bind().dialect.name
    for name in reversed(list(_previous(dialect))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for name, select in view_sql(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")


def downgrade() -> None:
    """Back to 0006's views."""
    dialect = op.get_bind().dialect.name
    for name in reversed(list(view_sql(dialect))):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for name, select in _previous(dialect).items():
        op.execute(f"CREATE VIEW {name} AS {select.strip()}")
