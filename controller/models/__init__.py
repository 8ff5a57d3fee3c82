"""Policies built locally for demos and tests (no hub access)."""

from controller.models.tiny import (
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    load_policy,
)

__all__ = ["TinyModelSpec", "build_tiny_model", "build_tokenizer", "load_policy"]
