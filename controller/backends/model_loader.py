"""Load any local Hugging Face causal LM directory (safetensors weights + its tokenizer).

This is the one path the trainer, the torch backend and the run loop load a policy
through; the tiny demo model (:mod:`rolloutlog.grpo.tiny_model`) is an ordinary directory
for it. Nothing is fetched from a hub: loading is ``local_files_only``, and a directory
that lacks its config, weights or tokenizer is refused with the missing piece named.
Weight names and shapes come from the model itself (its ``state_dict``), never from a
builder's metadata.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rolloutlog.eventstore.errors import RolloutlogError

#: Files that make up a tokenizer, whichever of them a given tokenizer ships.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


class ModelDirError(RolloutlogError, ValueError):
    """A model directory that cannot be loaded (missing, incomplete, or not a causal LM)."""


def check_model_dir(model_dir: Path | str) -> Path:
    """Check that ``model_dir`` holds a config, safetensors weights and a tokenizer.

    Returns the directory as a :class:`Path`; raises :class:`ModelDirError` naming what
    is missing (before any heavy loading starts).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ModelDirError(
            f"{path} has no safetensors weights (*.safetensors); convert the checkpoint with "
            "save_pretrained(..., safe_serialization=True)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:3])}, ...); "
            "save the tokenizer next to the weights with tokenizer.save_pretrained(dir)"
        )
    return path


def load_causal_lm(
    model_dir: Path | str, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (eval mode) and its tokenizer from a local directory.

    The architecture is whatever ``config.json`` names (``AutoModelForCausalLM``).
    A tokenizer without a pad token gets its eos token as pad (in memory only), since
    the trainer right-pads batches; one with neither is refused.
    """
    path = check_model_dir(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelDirError(
            f"cannot load a causal LM from {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ModelDirError(f"the tokenizer in {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def tokenizer_fingerprint(model_dir: Path | str) -> str:
    """A hash of the tokenizer files in ``model_dir`` (name and bytes of each one present).

    Two directories with byte-identical tokenizer files share a fingerprint; any change
    to the vocabulary, merges, special tokens or chat template changes it.
    """
    path = Path(model_dir)
    digest = hashlib.sha256(b"rolloutlog-tokenizer-v1")
    found = False
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            found = True
            digest.update(json.dumps(name).encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    if not found:
        raise ModelDirError(f"{path} has no tokenizer files to fingerprint")
    return digest.hexdigest()[:16]


__all__ = [
    "TOKENIZER_FILES",
    "ModelDirError",
    "check_model_dir",
    "load_causal_lm",
    "tokenizer_fingerprint",
]
