"""The locally built tiny policy and tokenizer (no hub access)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from rolloutlog.grpo.tiny_model import (
    ALPHABET,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    build_tokenizer,
    load_policy,
)


def test_tokenizer_is_character_level_and_deterministic() -> None:
    tok = build_tokenizer()
    assert tok.get_vocab() == build_tokenizer().get_vocab()
    assert len(tok) == len(SPECIAL_TOKENS) + len(ALPHABET) == 55
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    ids = tok("Hi, 2+3=5?")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len("hi, 2+3=5?")
    assert tok.decode(ids, skip_special_tokens=True) == "hi, 2+3=5?"
    assert tok("~", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_build_is_seeded_idempotent_and_loadable(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (a, b)]
    assert digest[0] == digest[1]
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(a) == a  # reused as it is
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    other = build_tiny_model(tmp_path / "c", TinyModelSpec(seed=1))
    assert hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest() != digest[0]
    # A different spec in an existing directory rebuilds it.
    build_tiny_model(a, TinyModelSpec(seed=1))
    assert (a / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()

    model, tok = load_policy(a)
    config = model.config
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (64, 2, 32)
    assert (config.num_hidden_layers, config.intermediate_size) == (2, 128)
    assert config.vocab_size == len(tok) and config.max_position_embeddings == 128
    assert config.architectures == ["LlamaForCausalLM"] and not config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temp dirs left


def test_build_never_overwrites_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not built by build_tiny_model"):
        build_tiny_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)
