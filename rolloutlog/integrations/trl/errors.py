"""The errors of the TRL integration: each a RolloutlogError with one clear line."""

from __future__ import annotations

from rolloutlog.eventstore.errors import RolloutlogError


class TrlIntegrationError(RolloutlogError, RuntimeError):
    """Base of the TRL integration's errors."""


class UnsupportedTrlFeatureError(TrlIntegrationError, ValueError):
    """A TRL feature the rolloutlog worker does not support (yet)."""


class TrlConfigError(TrlIntegrationError, ValueError):
    """The trainer's arguments do not fit the rolloutlog worker (the message says how)."""


class CheckpointStateMissingError(TrlIntegrationError):
    """A TRL checkpoint to resume from has no rolloutlog state file."""


class LogMismatchError(TrlIntegrationError):
    """The rollout log named by a checkpoint does not belong to this dataset or run."""


class WorkerFailedError(TrlIntegrationError):
    """The rolloutlog worker stopped with an error (the message names it)."""
