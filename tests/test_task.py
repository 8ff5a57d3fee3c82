"""The toy task: deterministic prompts, a bounded reward, a fingerprint that names the config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rolloutlog.grpo.tiny_model import build_tokenizer
from rolloutlog.grpo.toy_task import ToyTask, ToyTaskConfig

TOKENIZER = build_tokenizer()
VOCAB = len(TOKENIZER)


def ids(text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return TOKENIZER.encode(text, add_special_tokens=False)


EOS = TOKENIZER.eos_token_id
PAD = TOKENIZER.pad_token_id
BOS = TOKENIZER.bos_token_id


def test_reward_counts_target_characters() -> None:
    task = ToyTask(ToyTaskConfig(num_prompts=4, target="a"))
    assert task.reward(0, ids("aab"), TOKENIZER) == pytest.approx(2 / 3)
    assert task.reward(0, ids("aaaa"), TOKENIZER) == 1.0
    assert task.reward(0, ids("bcd "), TOKENIZER) == 0.0
    # Only what comes before the first eos counts; special tokens are not characters.
    assert task.reward(0, [*ids("a"), EOS, *ids("bbb")], TOKENIZER) == 1.0
    assert task.reward(0, [PAD, *ids("ab"), BOS], TOKENIZER) == pytest.approx(0.5)
    assert task.reward(0, [EOS], TOKENIZER) == 0.0
    assert task.reward(0, [], TOKENIZER) == 0.0


def test_reward_follows_the_configured_target() -> None:
    completion = ids("zz7a")
    assert ToyTask(ToyTaskConfig(target="z")).reward(0, completion, TOKENIZER) == 0.5
    assert ToyTask(ToyTaskConfig(target="7")).reward(0, completion, TOKENIZER) == 0.25
    assert ToyTask(ToyTaskConfig(target="a")).reward(0, completion, TOKENIZER) == 0.25


@settings(max_examples=200, deadline=None)
@given(
    completion=st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=24),
    index=st.integers(min_value=0, max_value=9),
    target=st.sampled_from("abz09 "),
)
def test_reward_is_bounded_and_pure(completion: list[int], index: int, target: str) -> None:
    task = ToyTask(ToyTaskConfig(num_prompts=10, target=target))
    r = task.reward(index, completion, TOKENIZER)
    assert 0.0 <= r <= 1.0
    assert task.reward(index, list(completion), TOKENIZER) == r
    assert (
        ToyTask(ToyTaskConfig(num_prompts=10, target=target)).reward(
            index, tuple(completion), TOKENIZER
        )
        == r
    )


def test_prompts_are_deterministic_and_shaped_by_the_config() -> None:
    cfg = ToyTaskConfig(num_prompts=50, seed=3, min_prompt_chars=2, max_prompt_chars=6)
    a, b = ToyTask(cfg), ToyTask(cfg.model_copy())
    prompts = [a.prompt(i) for i in range(50)]
    assert prompts == [b.prompt(i) for i in range(50)]
    # Random access gives the same answer as sequential access (dataset order = index).
    assert [a.prompt(i) for i in reversed(range(50))] == prompts[::-1]
    assert all(2 <= len(p) <= 6 and set(p) <= set(cfg.alphabet) for p in prompts)
    assert len(set(prompts)) > 40  # distinguishable prompts
    other_seed = ToyTask(cfg.model_copy(update={"seed": 4}))
    assert [other_seed.prompt(i) for i in range(50)] != prompts
    assert len(a) == a.num_prompts == 50


def test_prompt_is_pinned() -> None:
    """A change of prompt generation must bump TASK_VERSION (this pin catches it)."""
    task = ToyTask(ToyTaskConfig(num_prompts=3, seed=0))
    assert [task.prompt(i) for i in range(3)] == ["bowjzfm", "jfjthztp", "emjfejw"]


def test_prompt_token_ids_round_trip() -> None:
    task = ToyTask(ToyTaskConfig(num_prompts=8))
    for i in range(8):
        tok = task.prompt_token_ids(i, TOKENIZER)
        assert tok[0] == BOS
        assert TOKENIZER.decode(tok[1:]) == task.prompt(i)
        assert all(0 <= t < VOCAB for t in tok)
    no_bos = ToyTask(ToyTaskConfig(num_prompts=8, add_bos=False))
    assert no_bos.prompt_token_ids(0, TOKENIZER) == task.prompt_token_ids(0, TOKENIZER)[1:]


def test_index_out_of_range_is_an_error() -> None:
    task = ToyTask(ToyTaskConfig(num_prompts=5))
    for bad in (-1, 5):
        with pytest.raises(IndexError, match="outside"):
            task.prompt(bad)
        with pytest.raises(IndexError):
            task.reward(bad, ids("a"), TOKENIZER)


def test_fingerprint_names_every_config_field() -> None:
    base = ToyTaskConfig()
    fp = ToyTask(base).fingerprint
    assert fp.startswith("toy-v")
    assert ToyTask(ToyTaskConfig()).fingerprint == fp
    changes = {
        "num_prompts": 255,
        "seed": 1,
        "target": "b",
        "alphabet": "abc",
        "min_prompt_chars": 3,
        "max_prompt_chars": 11,
        "add_bos": False,
    }
    assert set(changes) == set(ToyTaskConfig.model_fields)  # a new field needs a case here
    seen = {fp}
    for name, value in changes.items():
        other = ToyTask(base.model_copy(update={name: value})).fingerprint
        assert other not in seen, name
        seen.add(other)


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError):
        ToyTaskConfig(targets="a")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        ToyTaskConfig(target="ab")
    with pytest.raises(ValidationError):
        ToyTaskConfig(min_prompt_chars=5, max_prompt_chars=4)
    with pytest.raises(ValidationError):
        ToyTaskConfig(alphabet="aab")
    with pytest.raises(ValidationError):
        ToyTaskConfig(num_prompts=0)
