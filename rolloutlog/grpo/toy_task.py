"""A toy RL task that a tiny randomly initialised language model learns within minutes on CPU.

The dataset is ``num_prompts`` short random strings, fully determined by the config (the
prompt at index ``i`` depends only on ``seed``, ``i`` and the prompt shape knobs), in dataset
order = prompt index. The reward of a completion is the fraction of its characters equal to
the configured ``target`` character: a policy that learns to emit ``target`` reaches 1.0, a
random policy over a ~40-token vocabulary scores about 0.02.

Everything here is pure and deterministic: no clock, no global random state, no I/O, so the
rollout log can record rewards and a replay never needs to recompute them.
"""

from __future__ import annotations

import hashlib
import json
import random
import string
from collections.abc import Sequence
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Bumped whenever prompt generation or the reward changes meaning, so fingerprints differ.
TASK_VERSION = 1


class TokenizerLike(Protocol):
    """The part of a ``transformers`` tokenizer the task uses."""

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or ``None``."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, or ``None``."""
        ...

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (bos, eos, pad, ...)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings of ``ids``."""
        ...


class ToyTaskConfig(BaseModel):
    """Configuration of :class:`ToyTask`; every field is part of the dataset fingerprint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_prompts: int = Field(default=256, ge=1, description="Number of prompts in the dataset.")
    seed: int = Field(default=0, ge=0, description="Seed of the prompt strings.")
    target: str = Field(
        default="a",
        min_length=1,
        max_length=1,
        description="The character a completion is rewarded for emitting.",
    )
    alphabet: str = Field(
        default=string.ascii_lowercase,
        min_length=1,
        description="Characters prompts are drawn from (must be in the tokenizer's vocabulary).",
    )
    min_prompt_chars: int = Field(default=4, ge=1, description="Shortest prompt, in characters.")
    max_prompt_chars: int = Field(default=10, ge=1, description="Longest prompt, in characters.")
    add_bos: bool = Field(
        default=True, description="Prepend the tokenizer's bos token to every prompt."
    )

    @field_validator("alphabet")
    @classmethod
    def _alphabet_is_a_set(cls, value: str) -> str:
        if len(set(value)) != len(value):
            raise ValueError(f"alphabet {value!r} repeats characters")
        return value

    @model_validator(mode="after")
    def _prompt_lengths_ordered(self) -> ToyTaskConfig:
        if self.min_prompt_chars > self.max_prompt_chars:
            raise ValueError(
                f"min_prompt_chars {self.min_prompt_chars} > max_prompt_chars "
                f"{self.max_prompt_chars}"
            )
        return self


class ToyTask:
    """The toy dataset and its reward: "emit as many ``target`` characters as you can".

    ``prompt(i)`` is a random lowercase string (the content is irrelevant to the reward;
    it only makes prompts, and so groups, distinguishable in the log). ``reward`` is the
    fraction of completion characters (before the first eos, special tokens excluded)
    equal to ``config.target``; an empty completion scores 0.
    """

    def __init__(self, config: ToyTaskConfig | None = None) -> None:
        self.config = config if config is not None else ToyTaskConfig()
        canonical = json.dumps(
            {"task": "toy", "version": TASK_VERSION, **self.config.model_dump()},
            sort_keys=True,
            separators=(",", ":"),
        )
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        self._fingerprint = f"toy-v{TASK_VERSION}-{digest}"

    @property
    def fingerprint(self) -> str:
        """Identifies the dataset and reward (changes with any config field or task version)."""
        return self._fingerprint

    @property
    def num_prompts(self) -> int:
        """Number of prompts in the dataset."""
        return self.config.num_prompts

    def __len__(self) -> int:
        return self.config.num_prompts

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.config.num_prompts:
            raise IndexError(f"prompt index {index} outside [0, {self.config.num_prompts})")

    def prompt(self, index: int) -> str:
        """The prompt text at dataset position ``index`` (a pure function of config and index)."""
        self._check_index(index)
        cfg = self.config
        rng = random.Random(f"rolloutlog-toy:{cfg.seed}:{index}")
        length = rng.randint(cfg.min_prompt_chars, cfg.max_prompt_chars)
        return "".join(rng.choice(cfg.alphabet) for _ in range(length))

    def prompt_token_ids(self, index: int, tokenizer: TokenizerLike) -> list[int]:
        """Token ids of prompt ``index``: bos (when configured and defined) then the text."""
        text = self.prompt(index)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if self.config.add_bos and tokenizer.bos_token_id is not None:
            ids.insert(0, int(tokenizer.bos_token_id))
        if not ids:
            raise ValueError(f"prompt {index} ({text!r}) encodes to no tokens")
        return ids

    def completion_text(self, completion_token_ids: Sequence[int], tokenizer: TokenizerLike) -> str:
        """The characters the reward looks at: tokens before the first eos, specials dropped."""
        ids = [int(t) for t in completion_token_ids]
        eos = tokenizer.eos_token_id
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        special = set(tokenizer.all_special_ids)
        kept = [t for t in ids if t not in special]
        if not kept:
            return ""
        return "".join(tokenizer.convert_ids_to_tokens(kept))

    def reward(
        self, prompt_index: int, completion_token_ids: Sequence[int], tokenizer: TokenizerLike
    ) -> float:
        """Fraction of completion characters equal to ``config.target``, in ``[0, 1]``."""
        self._check_index(prompt_index)
        text = self.completion_text(completion_token_ids, tokenizer)
        if not text:
            return 0.0
        return text.count(self.config.target) / len(text)
