"""``run_training`` on a dataset file with a user reward (deterministic backend, CPU): a
reward that raises fails its sample under the configured policy and the run goes on;
run config validation of the workload fields."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rolloutlog.controller.config import ConfigError
from rolloutlog.controller.domain.errors import RestoreError
from rolloutlog.controller.domain.events import PromptDropped, SiblingFailed
from rolloutlog.controller.prompt_ledger import build_ledger
from rolloutlog.controller.rollout_controller import iter_history
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import latest_checkpoint, run_training
from rolloutlog.grpo.run_config import RunConfig

RUN = "workload"
PICKY = (
    "def picky(completion, answer, example):\n"
    "    if example['question'] == 'what is 0 + 1?':\n"
    "        raise ValueError('cannot judge zero')\n"
    "    return float(answer in completion)\n"
)


def _cfg(tmp_path: Path, tiny_dir: Path, data: Path, **over: Any) -> RunConfig:
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        shutil.copytree(tiny_dir, model_dir)
    raw: dict[str, Any] = {
        "steps": 3,
        "checkpoint_every": 3,
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "backend": "deterministic",
        "model": {"dir": str(model_dir), "build": "none"},
        "store": {"url": f"sqlite:///{tmp_path / 'log.db'}"},
        "rollout": {
            "group_size": 2,
            "groups_per_step": 2,
            "lookahead": 1,
            "staleness_bound": 1,
            "spare_pool_size": 1,
        },
        "dataset": {
            "path": str(data),
            "template": "question: {question}\nanswer:",
            "max_prompt_tokens": 40,
        },
        "reward": {"name": "qa_picky:picky"},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return RunConfig.model_validate(raw)


def _events(url: str) -> list[Any]:
    store = EventStore.open(url)
    try:
        return [event for _row, event in iter_history(store, RUN)]
    finally:
        store.close()


@pytest.fixture
def picky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "qa_picky.py").write_text(PICKY)
    monkeypatch.syspath_prepend(str(mods))


@pytest.mark.usefixtures("picky")
def test_reward_that_raises_drops_its_group_and_the_run_goes_on(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.steps_trained == 3
    events = _events(cfg.store.url)
    failed = [e for e in events if isinstance(e, SiblingFailed)]
    assert failed and not any(e.retryable for e in failed)
    assert all("ValueError: cannot judge zero" in e.reason for e in failed)
    dropped = [e for e in events if isinstance(e, PromptDropped)]
    assert [e.prompt_index for e in dropped] == [0]
    assert result.workload["reward_failures"] >= 1
    assert result.workload["reward_failures_dropped"] == len(failed)
    assert result.workload["prompts_too_long_skipped"] == 1
    store = EventStore.open(cfg.store.url)
    try:
        ledger = build_ledger(store, RUN)
    finally:
        store.close()
    assert 0 not in ledger.trained and not ledger.trained_twice


@pytest.mark.usefixtures("picky")
def test_reward_that_raises_scores_zero_under_the_zero_policy(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl, reward={"on_error": "zero"})
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.steps_trained == 3
    events = _events(cfg.store.url)
    assert not [e for e in events if isinstance(e, SiblingFailed | PromptDropped)]
    assert result.workload["reward_failures"] == cfg.rollout.group_size
    assert result.workload["reward_failures_dropped"] == 0


def test_workload_config_is_validated_up_front(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    with pytest.raises(ValidationError, match="passes"):
        _cfg(tmp_path, tiny_dir, qa_jsonl, passes=0)
    with pytest.raises(ValidationError, match="reward is set but dataset is not"):
        _cfg(tmp_path, tiny_dir, qa_jsonl, dataset=None)
    with pytest.raises(ValidationError, match="neither a built-in"):
        _cfg(tmp_path, tiny_dir, qa_jsonl, reward={"name": "nonsense"})
    too_many = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=9, reward={"name": "numeric"})
    with pytest.raises(ConfigError, match="has 11 prompts: 9 steps of 2 groups need 18"):
        asyncio.run(run_training(too_many, run_id=RUN, resume=False))
    too_long = _cfg(tmp_path, tiny_dir, qa_jsonl, model={"max_model_len": 200})
    with pytest.raises(ConfigError, match="max_model_len 200 exceeds the model's 128 positions"):
        asyncio.run(run_training(too_long, run_id=RUN, resume=False))
    unknown = _cfg(tmp_path, tiny_dir, qa_jsonl, reward={"name": "qa_nowhere:f"})
    with pytest.raises(ConfigError, match="cannot import 'qa_nowhere'"):
        asyncio.run(run_training(unknown, run_id=RUN, resume=False))


@pytest.mark.usefixtures("picky")
def test_dataset_run_resumes_and_other_data_is_refused(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    first = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=2, checkpoint_every=1)
    assert asyncio.run(run_training(first, run_id=RUN, resume=False)).steps_trained == 2
    more = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=3, checkpoint_every=1)
    resumed = asyncio.run(run_training(more, run_id=RUN, resume=True))
    assert (resumed.first_step, resumed.steps_trained) == (2, 1)
    # The same rows with one answer changed: another fingerprint, the restore is refused.
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(qa_jsonl.read_bytes().replace(b'"answer": "4"', b'"answer": "5"'))
    other = _cfg(tmp_path, tiny_dir, edited, steps=4, checkpoint_every=1)
    with pytest.raises(RestoreError, match="fingerprint"):
        asyncio.run(run_training(other, run_id=RUN, resume=True))


@pytest.mark.usefixtures("picky")
def test_running_out_of_data_ends_the_run_cleanly_with_a_message(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    # 11 prompts x 2 passes = 22 = 11 steps of 2 groups, but prompt 0 is dropped in each
    # pass (its reward raises) and its replacement uses up data: the last step can never
    # be formed. The run stops at the last step it could train, saying why.
    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=11, passes=2, checkpoint_every=20)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.stopped is not None
    # A checkpoint at the last trained step, though checkpoint_every did not call for one.
    done = latest_checkpoint(cfg, RUN)
    assert done is not None and done.train_step == result.steps_trained
    assert "the data ran out before step" in result.stopped
    assert "11 prompts of 2 pass(es)" in result.stopped
    assert 0 < result.steps_trained < 11
    from rolloutlog.grpo.workload import run_summary

    summary = run_summary(cfg, RUN, result.workload, stopped=result.stopped)
    assert summary["stopped"] == result.stopped
    assert summary["prompts_lost"] == 0 and summary["prompts_trained_twice"] == 0
    assert summary["prompts_dropped"] == 2  # (0, 0) and (1, 0)
    # A resume finds no data left either: the same clear stop, nothing trained.
    again = asyncio.run(run_training(cfg, run_id=RUN, resume=True))
    assert again.steps_trained == 0 and again.stopped is not None
    assert "the data ran out" in again.stopped


def test_a_reward_that_always_raises_stops_the_run_naming_it(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutlog.controller.metrics.projection import project_history
    from rolloutlog.controller.workloads.rewards import RewardFailureLimitError

    # Before: "stopped early: the data ran out", 0 prompts trained, exit 0; the
    # exception only inside SiblingFailed events.
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "qa_always_boom.py").write_text(
        "def boom(completion, answer, example):\n    raise ZeroDivisionError('no way')\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl, reward={"name": "qa_always_boom:boom"})
    with pytest.raises(
        RewardFailureLimitError,
        match=r"the reward 'qa_always_boom:boom' failed on 4 of the 4 completions scored "
        r"\(reward.max_failure_fraction: 0.5\); its first error, on prompt \d+ "
        r"\(.*qa.jsonl line \d+\): reward qa_always_boom:boom raised ZeroDivisionError: no way",
    ):
        asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    # Each failure is its own outcome in the log, and counted by the metrics.
    failed = [e for e in _events(cfg.store.url) if isinstance(e, SiblingFailed)]
    assert failed and {e.cause for e in failed} == {"reward"}
    store = EventStore.open(cfg.store.url)
    try:
        counters = project_history(store, RUN).values()["counters"]
    finally:
        store.close()
    assert counters["rollout_reward_failures_total"] == len(failed)


@pytest.mark.usefixtures("picky")
def test_running_out_of_data_names_the_reward_failures_that_used_it_up(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=11, passes=2, checkpoint_every=20)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.stopped is not None and "the data ran out" in result.stopped
    assert (
        "completions failed their reward, each dropping its group (first: reward "
        "qa_picky:picky raised ValueError: cannot judge zero)" in result.stopped
    )
    assert result.workload["reward_first_error"].endswith("cannot judge zero")
    assert 0 < result.workload["reward_failures"] < result.workload["rewards_scored"]


@pytest.mark.usefixtures("picky")
def test_the_trained_policy_is_exported_as_a_hugging_face_directory(
    tmp_path: Path, tiny_dir: Path, qa_jsonl: Path
) -> None:
    import torch

    from rolloutlog.controller.backends.model_loader import load_causal_lm

    cfg = _cfg(tmp_path, tiny_dir, qa_jsonl, steps=2, checkpoint_every=1)
    result = asyncio.run(run_training(cfg, run_id=RUN, resume=False))
    assert result.policy_dir is not None
    policy = Path(result.policy_dir)
    assert policy.name == "step-000002.hf"
    # Only the newest export is kept; every .pt checkpoint stays for resumes.
    folder = policy.parent
    assert sorted(p.name for p in folder.glob("*.hf")) == ["step-000002.hf"]
    assert sorted(p.name for p in folder.glob("*.pt")) == ["step-000001.pt", "step-000002.pt"]
    model, tokenizer = load_causal_lm(policy)  # an ordinary model directory
    assert tokenizer.decode(tokenizer.encode("what is 1 + 1?", add_special_tokens=False)) == (
        "what is 1 + 1?"
    )
    done = latest_checkpoint(cfg, RUN)
    assert done is not None
    trained = torch.load(done.path, map_location="cpu", weights_only=False)["trainer"]["model"]
    exported = model.state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    # Off: no export.
    off = _cfg(tmp_path / "off", tiny_dir, qa_jsonl, steps=1, export_hf=False)
    assert asyncio.run(run_training(off, run_id=RUN, resume=False)).policy_dir is None
    assert not list(Path(off.checkpoint_dir).rglob("*.hf"))
