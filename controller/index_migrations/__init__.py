"""The controller's alembic revisions: the rollout index and the audit views over it.

Part of rollouts' one revision chain with the log's revisions in ``migrations/versions``
(see ``migrations/__init__.py``).
"""
