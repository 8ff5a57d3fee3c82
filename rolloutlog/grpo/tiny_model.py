"""A tiny Llama policy and a character-level tokenizer, built locally (no hub access).

Everything here is deterministic: the tokenizer is trained with the ``tokenizers``
library on a generated corpus, the model is a :class:`transformers.LlamaConfig` with a
seeded initialisation, and both are written with ``save_pretrained`` into a local
directory that vLLM, the torch backend and the trainer all load from.

The shapes respect vLLM's CPU attention (head size >= 32): hidden 64, 2 heads of 32.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
#: Special tokens, in id order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
#: The characters of the vocabulary (input is lower-cased first; others map to ``<unk>``).
ALPHABET: str = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?+-*/=()\n"

#: Written next to the weights; a directory is reused only if its marker matches.
SPEC_MARKER = "rolloutlog_tiny_spec.json"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    SPEC_MARKER,
)


def _corpus() -> list[str]:
    """A generated training corpus that covers every character of :data:`ALPHABET`."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    lines = [ALPHABET, " ".join(words) + "."]
    for a in range(10):
        for b in range(10):
            lines.append(f"q: {a}+{b}=? a: {a + b}; ({a}*{b}) - {b} / 1, ok!\n")
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the character-level tokenizer (deterministic; no download).

    The vocabulary is the special tokens (ids 0-3, see :data:`SPECIAL_TOKENS`) followed by
    the characters of :data:`ALPHABET`. Text is lower-cased; unknown characters become
    ``<unk>``; encoding with special tokens prepends ``<bos>``; decoding concatenates.
    """
    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(
        # Room for the specials and the alphabet only: no merges, one token per character.
        vocab_size=len(SPECIAL_TOKENS) + len(ALPHABET),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(ALPHABET),
        limit_alphabet=len(ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.decoder = decoders.Fuse()
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    vocab = tok.get_vocab()
    missing = [c for c in ALPHABET if c not in vocab]
    if missing or len(vocab) != len(SPECIAL_TOKENS) + len(ALPHABET):
        raise RuntimeError(f"tokenizer training lost characters {missing!r}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=1 << 20,
    )


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape and seed of the tiny Llama policy (the vocabulary comes from the tokenizer)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    max_position_embeddings: int = 128
    seed: int = 0
    #: Std of the initial weights; larger than Llama's 0.02 so the untrained policy is
    #: visibly non-uniform (logprobs differ between tokens).
    initializer_range: float = 0.1

    def llama_config(self, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        """The :class:`LlamaConfig` of this spec for ``tokenizer``'s vocabulary."""
        return LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
            dtype="float32",
        )


def _is_complete(out_dir: Path, spec: TinyModelSpec) -> bool:
    if not all((out_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return bool(json.loads((out_dir / SPEC_MARKER).read_text()) == asdict(spec))
    except (OSError, ValueError):
        return False


def build_tiny_model(out_dir: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the tiny model (config, safetensors weights, tokenizer) into ``out_dir``.

    Idempotent: a complete directory built from the same ``spec`` is reused as it is.
    The initialisation is seeded by ``spec.seed`` (the global RNG state is left alone),
    so two builds produce identical weights. The directory is written under a temporary
    name and renamed into place, so a reader never sees a half-written model. A
    non-empty ``out_dir`` that was not built here is never overwritten (``ValueError``).
    Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir, spec):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / SPEC_MARKER).exists():
        raise ValueError(f"{out_dir} is not empty and was not built by build_tiny_model")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tokenizer = build_tokenizer()
        config = spec.llama_config(tokenizer)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            # transformers' stubs type `to` through a decorator that loses its arguments.
            model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SPEC_MARKER).write_text(json.dumps(asdict(spec), sort_keys=True))
        if out_dir.exists():
            if _is_complete(out_dir, spec):  # another process finished first
                return out_dir
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir, spec):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def load_policy(model_dir: Path | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy (float32, eval mode) and its tokenizer from a local directory.

    Kept for callers of the tiny model; it is the generic
    :func:`rolloutlog.controller.backends.model_loader.load_causal_lm`, so any causal LM
    directory works.
    """
    from rolloutlog.controller.backends.model_loader import load_causal_lm

    return load_causal_lm(model_dir, dtype=torch.float32)
