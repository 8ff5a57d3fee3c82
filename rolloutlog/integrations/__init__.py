"""Integrations of rolloutlog into the trainers people already use.

- :mod:`rolloutlog.integrations.trl`: a rollout worker for TRL's ``AsyncGRPOTrainer``
  (extra ``[trl]``), backed by the rollout log.
"""
