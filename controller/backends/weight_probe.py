"""The weight probe: does an engine serve the weights it claims? Ask its logprobs.

An engine's weight tag (``/weight_info``) is a claim written by the client after a
load. The probe checks the claim against the weights themselves: a fixed prompt is sent
with ``prompt_logprobs`` (teacher forcing, no sampling), and the logprob of each prompt
token is compared with what the reference model computes with the weights of the
version the engine should hold (the trainer's tensors as published, or the model
directory's for the start-up version).

Tolerance: :attr:`WeightProbe.tolerance` nats, the largest absolute difference allowed
at any position. vLLM on the CPU in float32 and the reference (transformers, float32)
agree to ~1e-5 nats on the tiny model; two different weight versions differ by far more
than 1e-3 (see docs/engines.md). The reference model is one extra copy of the model on
the trainer's CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


class ReferenceModel:
    """The model of ``model_dir``'s architecture with whatever weights were loaded into it
    last, scoring prompts on the CPU. Thread-safe (one load or score at a time)."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self._model: Any = None
        self._lock = threading.Lock()

    def _ensure(self) -> Any:
        if self._model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                str(self.model_dir), dtype=self.dtype, local_files_only=True
            )
            model.eval()
            self._model = model
        return self._model

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load named tensors (checkpoint names) into the model."""
        with self._lock:
            model = self._ensure()
            state = {k: v.detach().to(device="cpu", dtype=self.dtype) for k, v in tensors.items()}
            unexpected = model.load_state_dict(state, strict=False).unexpected_keys
            if unexpected:
                raise ValueError(f"weights the model does not have: {sorted(unexpected)[:5]}")

    def load_dir(self, weights_dir: str | Path) -> None:
        """Load every ``*.safetensors`` of a directory (a weights version or a model)."""
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(weights_dir).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        self.load(tensors)

    def prompt_logprobs(self, prompt: tuple[int, ...]) -> list[float]:
        """Logprob of each prompt token after the first, under the loaded weights."""
        with self._lock, torch.no_grad():
            model = self._ensure()
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            logits = model(input_ids=ids).logits[0, :-1].to(torch.float64)
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = logprobs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            return [float(x) for x in picked]


@dataclass
class WeightProbe:
    """A fixed prompt whose logprobs identify the weights an engine serves.

    Args:
        model_dir: the served model (architecture and start-up weights).
        tolerance: largest absolute logprob difference (nats) at any prompt position for
            the engine to count as serving the expected weights.
        length: prompt tokens (capped by the engines' context length).
    """

    model_dir: Path
    tolerance: float = 1e-3
    length: int = 16
    dtype: torch.dtype = torch.float32
    _reference: ReferenceModel | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tolerance > 0:
            raise ValueError(f"probe tolerance {self.tolerance} must be > 0 nats")
        if self.length < 2:
            raise ValueError(f"probe length {self.length} must be >= 2 tokens")

    @property
    def reference(self) -> ReferenceModel:
        """The reference model (built on first use)."""
        if self._reference is None:
            self._reference = ReferenceModel(self.model_dir, self.dtype)
        return self._reference

    def prompt(self, vocab_size: int, max_model_len: int) -> tuple[int, ...]:
        """The probe's token ids: fixed, spread over the vocabulary."""
        n = max(2, min(self.length, max_model_len - 1))
        return tuple((7 * i + 5) % vocab_size for i in range(n))

    def expected_for_tensors(
        self, tensors: Mapping[str, torch.Tensor], prompt: tuple[int, ...]
    ) -> list[float]:
        """The logprobs an engine holding ``tensors`` must answer (blocking: use a thread)."""
        self.reference.load(tensors)
        return self.reference.prompt_logprobs(prompt)

    def expected_for_dir(self, weights_dir: Path, prompt: tuple[int, ...]) -> list[float]:
        """The logprobs an engine holding a directory's weights must answer (blocking)."""
        self.reference.load_dir(weights_dir)
        return self.reference.prompt_logprobs(prompt)

    @staticmethod
    def distance(got: list[float], want: list[float]) -> float:
        """Largest absolute difference (nats); ``inf`` when the lengths differ."""
        if len(got) != len(want):
            return float("inf")
        return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
