"""TRL's WeightTransferProtocol for the rolloutlog worker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .worker import RolloutlogWorker


class NoOpWeightTransfer:
    """Sends nothing: for a backend that needs no weights (the deterministic one) or
    engines refit another way. The worker still records every publish (the version)."""

    def init_weight_transfer(self) -> None:
        """Nothing to set up."""

    def pause(self) -> None:
        """Nothing to pause: the runtime drains generation when it publishes."""

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Drop the weights (consumed, so TRL's gather of each parameter still runs)."""
        for _ in iterator:
            pass

    def resume(self) -> None:
        """Nothing to resume."""

    def destroy(self) -> None:
        """Nothing to release."""


class RolloutlogWeightTransfer(NoOpWeightTransfer):
    """Publishes the trainer's weights to the worker's backend (for example a
    ``FleetBackend`` of vLLM servers, through the update path the fleet already uses):
    ``send_weights`` keeps a CPU copy, and the ``update_model_version`` TRL calls next
    loads it into the backend and records the version in the log."""

    def __init__(self, worker: RolloutlogWorker) -> None:
        self.worker = worker

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Hand the weights to the worker for the next publish."""
        self.worker.receive_weights(iterator)
