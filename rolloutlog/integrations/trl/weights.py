"""TRL's WeightTransferProtocol for the rolloutlog worker."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .errors import TrlConfigError

if TYPE_CHECKING:
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

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


class NcclWeightTransfer:
    """TRL's NCCL weight transfer to the vLLM server the worker generates on.

    ``client`` is TRL's ``WeightTransferClient`` (``trl.experimental.async_grpo.
    weight_transfer``) for the server the worker's backend (a ``VLLMServerBackend``)
    talks to: the weights travel trainer GPU -> engine GPU over NCCL, nothing goes
    through the worker. The worker keeps its version accounting exact around it:

    - ``pause``: the worker stops dispatching and waits for its in-flight generation to
      finish (a completion must come from one weight version), then the server pauses;
    - ``send_weights``: TRL's NCCL broadcast; the engine now serves the new weights;
    - ``resume``: the server resumes; the worker still dispatches nothing;
    - ``update_model_version`` (TRL's next call): the worker records the publish, takes
      the version as loaded (the backend is told, loads nothing) and dispatches again.

    Needs a CUDA GPU for the trainer and another for the engine (NCCL refuses two ranks
    on one device); ``scripts/gpu/trl_nccl_check.py`` checks the whole path.
    """

    def __init__(self, worker: RolloutlogWorker, client: Any) -> None:
        if not getattr(worker.backend, "loads_weights_elsewhere", False):
            raise TrlConfigError(
                "NcclWeightTransfer needs the worker's backend from nccl_vllm_backend() "
                f"(a vLLM server told the version, not sent the weights), not "
                f"{type(worker.backend).__name__}"
            )
        self.worker = worker
        self.client = client
        worker.weights_sent_elsewhere = True

    def init_weight_transfer(self) -> None:
        """Open the NCCL group with the server (TRL's client)."""
        self.client.init_weight_transfer()

    def pause(self) -> None:
        """Drain the worker's generation, then pause the server."""
        self.worker.hold_generation()
        self.client.pause()

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """Broadcast the trainer's weights to the engine over NCCL."""
        self.client.send_weights(iterator)

    def resume(self) -> None:
        """Resume the server (the worker dispatches again once the publish is recorded)."""
        self.client.resume()

    def destroy(self) -> None:
        """Close the NCCL group."""
        self.client.destroy()


def nccl_vllm_backend(base_url: str, **kwargs: Any) -> VLLMServerBackend:
    """A ``VLLMServerBackend`` (same arguments) for :class:`NcclWeightTransfer`: its
    ``update_weights`` loads nothing (the weights came over NCCL before the publish) and
    takes the version as the one the engine serves."""
    from rolloutlog.controller.backends.vllm_server import VLLMServerBackend

    class NcclServedBackend(VLLMServerBackend):
        loads_weights_elsewhere = True

        async def update_weights(
            self, named_tensors: Iterable[tuple[str, Any]], version: int
        ) -> None:
            for _ in named_tensors:  # the worker's version marker
                pass
            self.assume_weights(version, None)

    return NcclServedBackend(base_url, **kwargs)
