"""Alembic environment and revisions for rolloutlog's log schema (SQLite and PostgreSQL)."""
