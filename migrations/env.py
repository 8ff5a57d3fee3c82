"""Alembic environment: runs on a connection handed in by rolloutlog, or on a URL."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from rolloutlog.eventstore.schema import metadata

config = context.config
# The log's tables and those of the branches registered in this process
# (eventstore/migrate.py passes them; rolloutlog.eventstore.schema_branches).
target_metadata = config.attributes.get("target_metadata", [metadata])


def run_migrations_offline() -> None:
    """Emit SQL for the configured URL without connecting."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run on the connection in ``config.attributes`` or on a fresh engine from the URL."""
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
