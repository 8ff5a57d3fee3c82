"""Prompts from a local dataset file: fields and templates, chat templates, the max prompt
length policy (counted), formats, the fingerprint, and the reward failure policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutlog.controller.backends.model_loader import load_causal_lm, tokenizer_fingerprint
from rolloutlog.controller.workloads.arith import generate_arith
from rolloutlog.controller.workloads.dataset import DatasetConfig, DatasetError, PromptDataset
from rolloutlog.controller.workloads.rewards import (
    RewardConfig,
    RewardFailedError,
    RewardFailureLimitError,
)

from .conftest import write_jsonl

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "question: {question}\nanswer:"


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: Path):  # type: ignore[no-untyped-def]
    return load_causal_lm(tiny_dir)[1]


def _ds(path: Path, tok, **over) -> PromptDataset:  # type: ignore[no-untyped-def]
    reward = over.pop("reward", RewardConfig(name="numeric"))
    return PromptDataset(DatasetConfig(path=str(path), **over), reward, tok)


def test_template_fills_row_fields_and_rewards_score_completions(qa_jsonl: Path, tiny_tok) -> None:  # type: ignore[no-untyped-def]
    ds = _ds(qa_jsonl, tiny_tok, template=TEMPLATE)
    assert ds.num_prompts == 12 and ds.stats.rows == 12
    ids = ds.prompt_token_ids(3)
    assert ids[0] == tiny_tok.bos_token_id
    assert tiny_tok.decode(ids, skip_special_tokens=True) == "question: what is 3 + 1?\nanswer:"
    good = [*tiny_tok.encode(" 4", add_special_tokens=False), tiny_tok.eos_token_id, 7]
    assert ds.reward(3, good) == 1.0
    assert ds.reward(3, tiny_tok.encode("5", add_special_tokens=False)) == 0.0
    assert ds.answer(3) == "4" and ds.example(3)["question"] == "what is 3 + 1?"


def test_prompt_field_and_missing_fields_are_named(tmp_path: Path, tiny_tok) -> None:  # type: ignore[no-untyped-def]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "answer": "1"}, {"answer": "2"}])
    with pytest.raises(DatasetError, match=r"line 2: prompt field 'prompt' is missing"):
        _ds(path, tiny_tok)
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": "hi", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"line 1: template field 'question' missing"):
        _ds(path, tiny_tok, template=TEMPLATE)
    with pytest.raises(DatasetError, match="answer field 'solution' missing"):
        _ds(path, tiny_tok, prompt_field="q", answer_field="solution")
    with pytest.raises(DatasetError, match="does not exist"):
        _ds(tmp_path / "nope.jsonl", tiny_tok)


def test_a_row_without_a_template_field_is_refused_naming_its_line(
    tmp_path: Path,
    tiny_tok,  # type: ignore[no-untyped-def]
) -> None:
    # datasets unifies the schema: the third row's missing "question" would be None and
    # the prompt the text "None".
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "what is 1 + 1?", "answer": "2"}\n\n{"answer": "3"}\n')
    with pytest.raises(
        DatasetError, match=r"q.jsonl line 3: template field 'question' missing \(fields: answer\)"
    ):
        _ds(path, tiny_tok, template=TEMPLATE)
    import pandas as pd

    frame = pd.DataFrame({"question": ["what is 1 + 1?", None], "answer": ["2", "3"]})
    frame.to_parquet(tmp_path / "q.parquet")
    with pytest.raises(DatasetError, match=r"q.parquet row index 1: template field 'question'"):
        _ds(tmp_path / "q.parquet", tiny_tok, template=TEMPLATE)
    (tmp_path / "q.csv").write_text('question,answer\n"what is\n1 + 1?",2\n,3\n')
    with pytest.raises(DatasetError, match=r"q.csv line 4: template field 'question'"):
        _ds(tmp_path / "q.csv", tiny_tok, template=TEMPLATE)


def test_malformed_and_empty_files_name_the_line_or_say_empty(
    tmp_path: Path,
    tiny_tok,  # type: ignore[no-untyped-def]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: not valid JSON: Expecting value"):
        _ds(bad, tiny_tok, template=TEMPLATE)
    bad.write_text('{"question": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: a JSON list, not an object"):
        _ds(bad, tiny_tok, template=TEMPLATE)
    for name, text in (("e.jsonl", "\n\n"), ("e.csv", ""), ("e.json", " "), ("e.parquet", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DatasetError, match=rf"dataset file .*{name} is empty"):
            _ds(tmp_path / name, tiny_tok, template=TEMPLATE)
    (tmp_path / "h.csv").write_text("question,answer\n")
    with pytest.raises(DatasetError, match=r"h.csv has a header line but no rows"):
        _ds(tmp_path / "h.csv", tiny_tok, template=TEMPLATE)


def test_max_prompt_length_policy_is_applied_and_counted(qa_jsonl: Path, tiny_tok) -> None:  # type: ignore[no-untyped-def]
    skip = _ds(qa_jsonl, tiny_tok, template=TEMPLATE, max_prompt_tokens=40)
    assert skip.num_prompts == 11 and skip.stats.too_long_skipped == 1
    assert skip.source_rows == list(range(11))
    trunc = _ds(qa_jsonl, tiny_tok, template=TEMPLATE, max_prompt_tokens=40, too_long="truncate")
    assert trunc.num_prompts == 12 and trunc.stats.too_long_truncated == 1
    cut = trunc.prompt_token_ids(11)
    assert len(cut) == 40 and cut[0] == tiny_tok.bos_token_id
    assert tiny_tok.decode(cut, skip_special_tokens=True).endswith("1?\nanswer:")
    with pytest.raises(DatasetError, match=r"line 12: prompt is .* over max_prompt_tokens 40"):
        _ds(qa_jsonl, tiny_tok, template=TEMPLATE, max_prompt_tokens=40, too_long="error")
    with pytest.raises(DatasetError, match="yields no prompts"):
        _ds(qa_jsonl, tiny_tok, template=TEMPLATE, max_prompt_tokens=3)


def test_max_prompts_keeps_the_first_prompts_and_changes_the_fingerprint(  # type: ignore[no-untyped-def]
    qa_jsonl: Path, tiny_tok
) -> None:
    full = _ds(qa_jsonl, tiny_tok, template=TEMPLATE)
    five = _ds(qa_jsonl, tiny_tok, template=TEMPLATE, max_prompts=5)
    assert five.num_prompts == 5 and five.source_rows == list(range(5))
    assert [five.prompt_token_ids(i) for i in range(5)] == [
        full.prompt_token_ids(i) for i in range(5)
    ]
    assert five.fingerprint != full.fingerprint


def test_chat_template_when_asked(qa_jsonl: Path, tiny_dir: Path) -> None:
    _, tok = load_causal_lm(tiny_dir)
    with pytest.raises(DatasetError, match="tokenizer has none"):
        _ds(qa_jsonl, tok, template=TEMPLATE, chat_template=True)
    tok.chat_template = (
        "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}bot:{% endif %}"
    )
    ds = _ds(qa_jsonl, tok, prompt_field="question", chat_template=True)
    assert tok.decode(ds.prompt_token_ids(0), skip_special_tokens=True) == (
        "user: what is 0 + 1?\nbot:"
    )


def test_csv_and_parquet_files(tmp_path: Path, tiny_tok) -> None:  # type: ignore[no-untyped-def]
    import pandas as pd

    frame = pd.DataFrame({"question": ["what is 1 + 1?", "what is 2 + 2?"], "answer": ["2", "4"]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        ds = _ds(tmp_path / name, tiny_tok, template=TEMPLATE)
        assert ds.num_prompts == 2 and ds.answer(1) == "4"
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        DatasetConfig(path=str(tmp_path / "d.txt"))


def test_fingerprint_covers_file_template_tokenizer_and_reward(
    qa_jsonl: Path, tiny_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    _, tiny = load_causal_lm(tiny_dir)
    _, gpt2 = load_causal_lm(gpt2_dir)

    def fp(path: Path, tok, tok_fp: str, **over) -> str:  # type: ignore[no-untyped-def]
        reward = over.pop("reward", RewardConfig(name="numeric"))
        cfg = DatasetConfig(path=str(path), template=over.pop("template", TEMPLATE), **over)
        return PromptDataset(cfg, reward, tok, tokenizer_fingerprint=tok_fp).fingerprint

    tiny_fp, gpt2_fp = tokenizer_fingerprint(tiny_dir), tokenizer_fingerprint(gpt2_dir)
    base = fp(qa_jsonl, tiny, tiny_fp)
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(qa_jsonl.read_bytes())
    assert fp(moved, tiny, tiny_fp) == base  # the contents count, not the path
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(qa_jsonl.read_bytes().replace(b'"answer": "4"', b'"answer": "5"'))
    assert fp(edited, tiny, tiny_fp) != base
    assert fp(qa_jsonl, tiny, tiny_fp, template="q: {question}\na:") != base
    assert fp(qa_jsonl, gpt2, gpt2_fp) != base
    assert fp(qa_jsonl, tiny, tiny_fp, reward=RewardConfig(name="exact_match")) != base
    assert fp(qa_jsonl, tiny, tiny_fp, max_prompt_tokens=60) != base
    # Without a files fingerprint the vocabulary is hashed instead.
    assert (
        PromptDataset(
            DatasetConfig(path=str(qa_jsonl), template=TEMPLATE), RewardConfig(name="numeric"), gpt2
        ).fingerprint
        != PromptDataset(
            DatasetConfig(path=str(qa_jsonl), template=TEMPLATE), RewardConfig(name="numeric"), tiny
        ).fingerprint
    )


def test_user_reward_and_failure_policy(
    qa_jsonl: Path,
    tiny_tok,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    (tmp_path / "qa_rewards.py").write_text(
        "def picky(completion, answer, example):\n"
        "    if example['question'].startswith('what is 0'):\n"
        "        raise ValueError('cannot judge zero')\n"
        "    return float(completion.strip() == answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    one = tiny_tok.encode("1", add_special_tokens=False)
    drop = _ds(qa_jsonl, tiny_tok, template=TEMPLATE, reward=RewardConfig(name="qa_rewards:picky"))
    assert drop.reward(1, tiny_tok.encode("2", add_special_tokens=False)) == 1.0
    with pytest.raises(RewardFailedError, match=r"prompt 0: .*ValueError: cannot judge zero"):
        drop.reward(0, one)
    assert drop.stats.reward_failures == 1
    assert drop.score(0, one).error is not None  # score never raises
    zero = _ds(
        qa_jsonl,
        tiny_tok,
        template=TEMPLATE,
        reward=RewardConfig(name="qa_rewards:picky", on_error="zero"),
    )
    assert zero.reward(0, one) == 0.0
    assert zero.stats.reward_failures == 1
    assert zero.stats.reward_errors[0][0] == 0


def test_reward_failures_past_the_limit_stop_naming_the_reward_and_its_first_error(
    qa_jsonl: Path,
    tiny_tok,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    (tmp_path / "qa_boom.py").write_text(
        "def boom(completion, answer, example):\n    raise KeyError(example['question'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    one = tiny_tok.encode("1", add_special_tokens=False)
    for policy in ("drop_group", "zero"):
        reward = RewardConfig(name="qa_boom:boom", on_error=policy)
        ds = PromptDataset(
            DatasetConfig(path=str(qa_jsonl), template=TEMPLATE), reward, tiny_tok, failure_window=4
        )
        for index in (2, 0, 1):  # below the window: the policy applies
            if policy == "zero":
                assert ds.reward(index, one) == 0.0
            else:
                with pytest.raises(RewardFailedError):
                    ds.reward(index, one)
        with pytest.raises(
            RewardFailureLimitError,
            match=r"the reward 'qa_boom:boom' failed on 4 of the 4 completions scored "
            r"\(reward.max_failure_fraction: 0.5\); its first error, on prompt 2 "
            r"\(.*qa.jsonl line 3\): reward qa_boom:boom raised KeyError: 'what is 2 \+ 1\?'",
        ):
            ds.reward(3, one)
        assert ds.stats.to_dict()["reward_failures"] == 4
        assert ds.stats.to_dict()["rewards_scored"] == 4
    # A run that ends before the window is judged on what it scored.
    short = PromptDataset(
        DatasetConfig(path=str(qa_jsonl), template=TEMPLATE),
        RewardConfig(name="qa_boom:boom"),
        tiny_tok,
        failure_window=100,
    )
    with pytest.raises(RewardFailedError):
        short.reward(0, one)
    assert short.failure_limit() is None
    assert "failed on 1 of the 1 completions" in str(short.failure_limit(final=True))
    # The limit is how the run reacts, not what it computes: not in the fingerprint.
    loose = RewardConfig(name="qa_boom:boom", max_failure_fraction=1.0)
    assert (
        PromptDataset(
            DatasetConfig(path=str(qa_jsonl), template=TEMPLATE), loose, tiny_tok
        ).fingerprint
        == PromptDataset(
            DatasetConfig(path=str(qa_jsonl), template=TEMPLATE),
            RewardConfig(name="qa_boom:boom"),
            tiny_tok,
        ).fingerprint
    )


def test_shipped_arith_dataset_is_the_generator_output() -> None:
    shipped = (REPO / "configs" / "data" / "arith.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in shipped] == generate_arith()
    assert len(shipped) <= 500
    assert all(len(r["answer"]) == 1 for r in generate_arith())


def test_missing_datasets_library_is_a_clear_error(
    qa_jsonl: Path,
    tiny_tok,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(DatasetError, match=r"pip install 'rolloutlog\[data\]'"):
        _ds(qa_jsonl, tiny_tok, template=TEMPLATE)
