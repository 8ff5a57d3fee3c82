"""Fixtures of the workload tests: the tiny model directory and a second, differently
shaped model (GPT-2 style, its own byte-level BPE tokenizer without a pad token), both
built locally; and a small JSONL dataset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from rolloutlog.grpo.tiny_model import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama demo model, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec())


def build_gpt2_dir(out: Path) -> Path:
    """A GPT-2 style model (tied embeddings, other weight names and shapes than the tiny
    Llama) with a byte-level BPE tokenizer trained here; no pad token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"q: {a} plus {b} is {a + b}. the answer is {a + b}." for a in range(10) for b in range(10)
    ]
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=48,
        n_layer=1,
        n_head=2,
        n_positions=96,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The second model directory (see :func:`build_gpt2_dir`), built once per session."""
    return build_gpt2_dir(tmp_path_factory.mktemp("models") / "gpt2")


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    """Write ``rows`` as JSONL."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def two_pass_raw_config(
    tmp_path: Path,
    tiny_dir: Path,
    rows: list[dict[str, object]],
    *,
    steps: int,
    checkpoint_every: int,
    spare_pool_size: int,
) -> dict[str, Any]:
    """A raw ``RunConfig`` shaped like ``configs/real-workload.yaml`` at a small scale: two
    passes over ``rows`` (sums, numeric reward), groups of 2, 4 groups a step, on the
    deterministic backend and a SQLite file in ``tmp_path``."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    data = write_jsonl(tmp_path / "sums.jsonl", rows)
    return {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "backend": "deterministic",
        "seed": 7,
        "passes": 2,
        "model": {"dir": str(model_dir), "build": "none"},
        "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
        "rollout": {
            "group_size": 2,
            "groups_per_step": 4,
            "lookahead": 1,
            "staleness_bound": 1,
            "spare_pool_size": spare_pool_size,
        },
        "dataset": {"path": str(data), "template": "q: {question}\na:", "max_prompt_tokens": 40},
        "reward": {"name": "numeric"},
    }


@pytest.fixture
def qa_jsonl(tmp_path: Path) -> Path:
    """Twelve question/answer rows (one longer than the others)."""
    rows: list[dict[str, object]] = [
        {"question": f"what is {a} + 1?", "answer": str(a + 1)} for a in range(11)
    ]
    rows.append({"question": "what is " + " + ".join(["1"] * 20) + "?", "answer": "20"})
    return write_jsonl(tmp_path / "qa.jsonl", rows)
