"""Wiring a run config's model and workload: the model directory and the prompt source.

Used by :func:`rolloutlog.grpo.loop.run_training`; kept apart so the loop only asks for
"the model directory" and "the prompts".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolloutlog.controller.backends.model_loader import (
    ModelDirError,
    check_model_dir,
    tokenizer_fingerprint,
)
from rolloutlog.controller.config import ConfigError
from rolloutlog.controller.workloads.dataset import DatasetError, PromptDataset
from rolloutlog.controller.workloads.rewards import RewardConfig

from .run_config import ModelConfig, RunConfig
from .tiny_model import SPEC_MARKER, TinyModelSpec, build_tiny_model


def prepare_model_dir(model: ModelConfig) -> Path:
    """The policy's directory, checked; under ``build: tiny`` the tiny model is built there
    first unless the directory already holds another model (which is then used as is).

    ``build: tiny`` is the default, but it builds into a ``dir`` the config names only
    when it is written out (or ``dir`` already holds the tiny model): a mistyped ``dir``
    is refused instead of silently training the demo's tiny model."""
    path = Path(model.dir)
    if model.build == "tiny":
        foreign = (path / "config.json").is_file() and not (path / SPEC_MARKER).is_file()
        asked = "build" in model.model_fields_set or "dir" not in model.model_fields_set
        if not foreign and not asked and not (path / SPEC_MARKER).is_file():
            what = "does not exist" if not path.exists() else "holds no model (no config.json)"
            raise ModelDirError(
                f"model directory {path} {what}; write model.build: tiny to build the tiny "
                "demo model there"
            )
        if not foreign:
            build_tiny_model(
                path,
                TinyModelSpec(
                    seed=model.seed, max_position_embeddings=max(128, model.max_model_len)
                ),
            )
    return check_model_dir(path)


def check_model_fits(cfg: RunConfig, model: Any) -> None:
    """Refuse (``ConfigError``) a ``model.max_model_len`` beyond the model's positions,
    before anything is written to the log."""
    # HF configs name it differently per architecture; the attribute map resolves it.
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.model.max_model_len > limit:
        raise ConfigError(
            f"model.max_model_len {cfg.model.max_model_len} exceeds the model's "
            f"{limit} positions ({cfg.model.dir}); set it to at most {limit}"
        )


def dataset_prompts(cfg: RunConfig, tokenizer: Any, model_dir: Path) -> PromptDataset:
    """The run's dataset as a ``PromptSource``; refuses (``ConfigError``) a dataset that
    cannot be read or has too few prompts for ``steps`` in one pass."""
    assert cfg.dataset is not None
    try:
        prompts = PromptDataset(
            cfg.dataset,
            cfg.reward if cfg.reward is not None else RewardConfig(),
            tokenizer,
            tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
            failure_window=cfg.rollout.groups_per_step * cfg.rollout.group_size,
        )
    except (DatasetError, ValueError) as exc:
        raise ConfigError(f"dataset: {exc}") from exc
    check_round_trip(prompts, tokenizer, model_dir)
    longest = max(len(prompts.prompt_token_ids(i)) for i in range(prompts.num_prompts))
    room = cfg.model.max_model_len - cfg.generation.max_tokens
    if longest > room:
        raise ConfigError(
            f"dataset: the longest prompt is {longest} tokens but model.max_model_len "
            f"{cfg.model.max_model_len} - generation.max_tokens {cfg.generation.max_tokens} "
            f"leaves {room}; set dataset.max_prompt_tokens (with too_long: skip or truncate)"
        )
    gps = cfg.rollout.groups_per_step
    if cfg.steps * gps > prompts.num_prompts * cfg.passes:
        raise ConfigError(
            f"dataset {cfg.dataset.path} has {prompts.num_prompts} prompts: {cfg.steps} steps "
            f"of {gps} groups need {cfg.steps * gps} prompts; set steps to at most "
            f"{prompts.num_prompts * cfg.passes // gps}"
        )
    return prompts


#: Prompts whose text is checked to survive ``decode(encode(text))``.
ROUND_TRIP_SAMPLE = 8


def _comparable(text: str) -> str:
    # Tokenizers may lower-case and normalise whitespace; they must not lose characters.
    return " ".join(text.casefold().split())


def check_round_trip(prompts: PromptDataset, tokenizer: Any, model_dir: Path) -> None:
    """Refuse (``ConfigError``) a tokenizer that does not give back the text of the first
    prompts (case and whitespace runs aside): e.g. one loaded as another class than its
    files were written for, which drops the spaces of a character-level vocabulary."""
    for index in range(min(ROUND_TRIP_SAMPLE, prompts.num_prompts)):
        number = prompts.source_rows[index]
        text = prompts.prompt_text(number, prompts.example(index))
        ids = tokenizer.encode(text, add_special_tokens=False)
        back = str(tokenizer.decode(ids, skip_special_tokens=True))
        if _comparable(back) != _comparable(text):
            raise ConfigError(
                f"model: the tokenizer of {model_dir} ({type(tokenizer).__name__}) does not "
                f"round-trip the prompts: {text!r} ({prompts.where(number)}) decodes back as "
                f"{back!r}; check the tokenizer files (tokenizer_config.json's "
                "tokenizer_class) and that the tokenizer covers the data's characters"
            )


def run_summary(
    cfg: RunConfig, run_id: str, workload: dict[str, Any], *, stopped: str | None = None
) -> dict[str, Any]:
    """The final summary of a run, counted from its log (all processes of the run):
    mean reward of the first and last three trained steps; prompts trained, trained twice,
    lost and dropped, each counted per (pass, index); passes completed; why the run
    stopped early (``stopped``: the data ran out), plus this process's dataset and reward
    counts."""
    from rolloutlog.controller.prompt_ledger import build_ledger, cross_check
    from rolloutlog.controller.rollout_controller import replay
    from rolloutlog.eventstore import EventStore

    store = EventStore.open(cfg.store.url)
    try:
        ledger = build_ledger(store, run_id)
        state = replay(store, run_id).state
        check = cross_check(ledger, state)
    finally:
        store.close()
    rewards = [ledger.step_rewards[s] for s in sorted(ledger.step_rewards)]
    k = min(3, len(rewards))
    return {
        "event": "summary",
        "run_id": run_id,
        "steps_trained": len(rewards),
        "reward_first": sum(rewards[:k]) / k if k else 0.0,
        "reward_last": sum(rewards[-k:]) / k if k else 0.0,
        "rewards": rewards,
        # A prompt's identity is (pass, index): once per pass is not "trained twice".
        "prompts_trained": check.prompts_trained,
        "prompts_trained_twice": check.prompts_trained_twice,
        "prompts_lost": check.prompts_lost,
        "prompts_dropped": check.prompts_dropped,
        "passes": ledger.passes,
        # Only passes whose every prompt has an outcome (trained, dropped, evicted): a
        # spare pulled and never trained holds its pass open (issue 31).
        "passes_completed": ledger.passes_completed(),
        "stopped": stopped,
        **workload,
    }


__all__ = [
    "ROUND_TRIP_SAMPLE",
    "check_model_fits",
    "check_round_trip",
    "dataset_prompts",
    "prepare_model_dir",
    "run_summary",
]
