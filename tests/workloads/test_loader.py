"""The generic model loader: the tiny model directory and a differently shaped GPT-2 style
model load through the same path into the torch backend and the trainer, with weight names
and shapes taken from the model itself."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from rolloutlog.controller.backends.base import GroupRequest, SamplingConfig, SiblingSpec
from rolloutlog.controller.backends.model_loader import (
    ModelDirError,
    check_model_dir,
    load_causal_lm,
    tokenizer_fingerprint,
)
from rolloutlog.controller.backends.torch_backend import TorchBackend
from rolloutlog.grpo.run_config import ModelConfig
from rolloutlog.grpo.trainer import GRPOConfig, GRPOTrainer, TrainSample
from rolloutlog.grpo.workload import prepare_model_dir


def _request(prompt: list[int]) -> GroupRequest:
    return GroupRequest(
        group_id=1,
        prompt_token_ids=tuple(prompt),
        siblings=(SiblingSpec(0, 0), SiblingSpec(1, 0)),
        sampling=SamplingConfig(max_tokens=4, temperature=1.0),
    )


def _sample_train_and_push(model_dir: Path) -> tuple[list[str], int]:
    """Load ``model_dir`` into the backend and the trainer, sample, train one step, push
    the trained weights to the backend; returns the weight names and the new version."""
    model, tokenizer = load_causal_lm(model_dir)
    prompt = tokenizer.encode("what is 2 + 3?", add_special_tokens=True)

    async def go() -> tuple[list[str], int]:
        backend = TorchBackend(model_dir, seed=3)
        await backend.start()
        try:
            results = await backend.generate(_request(prompt))
            assert len(results) == 2 and all(r.token_ids for r in results)
            trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), pad_token_id=tokenizer.pad_token_id)
            samples = [
                TrainSample.from_sibling(r, prompt, reward=float(i)) for i, r in enumerate(results)
            ]
            stats = trainer.train_step(samples)
            assert stats.samples == 2
            await backend.update_weights(trainer.named_weights(), 1)
            return [n for n, _ in trainer.named_weights()], backend.weight_version
        finally:
            await backend.close()

    return asyncio.run(go())


def test_tiny_model_dir_loads_through_the_generic_path(tiny_dir: Path) -> None:
    names, version = _sample_train_and_push(tiny_dir)
    assert version == 1
    assert any(n.startswith("model.layers.") for n in names)


def test_a_second_differently_shaped_model_loads_and_trains(gpt2_dir: Path) -> None:
    model, tokenizer = load_causal_lm(gpt2_dir)
    assert type(model).__name__ == "GPT2LMHeadModel"
    # No pad token in its files: the eos token pads (in memory only).
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    names, version = _sample_train_and_push(gpt2_dir)
    assert version == 1
    assert any(n.startswith("transformer.h.0.") for n in names)


def test_prepare_model_dir_uses_a_foreign_model_as_it_is(gpt2_dir: Path, tmp_path: Path) -> None:
    # Before: "was not built by build_tiny_model". Now a model already there is loaded.
    target = tmp_path / "mine"
    shutil.copytree(gpt2_dir, target)
    before = sorted(p.name for p in target.iterdir())
    assert prepare_model_dir(ModelConfig(dir=str(target), build="tiny")) == target
    assert sorted(p.name for p in target.iterdir()) == before


def test_prepare_model_dir_builds_the_tiny_model_only_when_asked(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        prepare_model_dir(ModelConfig(dir=str(tmp_path / "none"), build="none"))
    built = prepare_model_dir(ModelConfig(dir=str(tmp_path / "tiny"), build="tiny"))
    assert (built / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "no config.json"),
        ("model.safetensors", "no safetensors weights"),
        ("tokenizer*", "no tokenizer files"),
    ],
)
def test_incomplete_model_dir_is_refused_naming_the_gap(
    tiny_dir: Path, tmp_path: Path, remove: str, message: str
) -> None:
    target = tmp_path / "m"
    shutil.copytree(tiny_dir, target)
    for p in target.glob(remove):
        p.unlink()
    (target / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(ModelDirError, match=message):
        check_model_dir(target)


def test_tokenizer_fingerprint_follows_the_tokenizer_files(
    tiny_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert tokenizer_fingerprint(copy) == tokenizer_fingerprint(tiny_dir)
    assert tokenizer_fingerprint(gpt2_dir) != tokenizer_fingerprint(tiny_dir)
    cfg = copy / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("}", ', "chat_template": "{{ messages }}"}', 1))
    assert tokenizer_fingerprint(copy) != tokenizer_fingerprint(tiny_dir)


@pytest.mark.parametrize("which", ["tiny", "gpt2"])
def test_trainer_weight_names_are_the_checkpoint_names(
    which: str, tiny_dir: Path, gpt2_dir: Path
) -> None:
    # The names a vLLM engine checks pushed weights against: the safetensors checkpoint's.
    # GPT-2 ties lm_head to the embedding; the checkpoint (and the push) holds it once.
    from rolloutlog.controller.backends.vllm_backend import checkpoint_shapes

    model_dir = tiny_dir if which == "tiny" else gpt2_dir
    model, tokenizer = load_causal_lm(model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(), pad_token_id=tokenizer.pad_token_id)
    pushed = {name: tuple(t.shape) for name, t in trainer.named_weights()}
    assert pushed == checkpoint_shapes(model_dir)


def test_a_mistyped_model_dir_is_refused_unless_build_tiny_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rolloutlog.grpo.run_config import RunConfig

    # build: tiny is the default, but it no longer builds into a dir the config names
    # unless it is written out: a typo must not train the demo's tiny model.
    typo = RunConfig.model_validate({"model": {"dir": str(tmp_path / "my-modle")}})
    with pytest.raises(ModelDirError, match=r"my-modle does not exist; write model.build: tiny"):
        prepare_model_dir(typo.model)
    assert not (tmp_path / "my-modle").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirError, match=r"empty holds no model \(no config.json\)"):
        prepare_model_dir(ModelConfig.model_validate({"dir": str(tmp_path / "empty")}))
    asked = RunConfig.model_validate({"model": {"dir": str(tmp_path / "t"), "build": "tiny"}})
    assert (prepare_model_dir(asked.model) / "model.safetensors").is_file()
    # Once built there, the default reuses it; with no dir written, the default location
    # is the demo model's and is built.
    assert prepare_model_dir(ModelConfig.model_validate({"dir": str(tmp_path / "t")}))
    monkeypatch.chdir(tmp_path)
    assert (prepare_model_dir(ModelConfig()) / "model.safetensors").is_file()


def test_a_tokenizer_that_does_not_round_trip_the_prompts_is_refused(
    tiny_dir: Path, tmp_path: Path
) -> None:
    import json

    from rolloutlog.controller.config import ConfigError
    from rolloutlog.grpo.run_config import RunConfig
    from rolloutlog.grpo.workload import dataset_prompts

    # transformers 5 loads these files as Qwen2Tokenizer when told so, which drops every
    # space of the character-level vocabulary: "what is 2 + 3?" -> "whatis2+3?".
    model_dir = tmp_path / "qwen-ish"
    shutil.copytree(tiny_dir, model_dir)
    conf = json.loads((model_dir / "tokenizer_config.json").read_text())
    conf["tokenizer_class"] = "Qwen2Tokenizer"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(conf))
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "what is 2 + 3?", "answer": "5"}\n')
    cfg = RunConfig.model_validate(
        {
            "steps": 1,
            "model": {"dir": str(model_dir), "build": "none"},
            "rollout": {"group_size": 2, "groups_per_step": 1, "spare_pool_size": 0},
            "dataset": {"path": str(data), "template": "q: {question}"},
        }
    )
    _model, tokenizer = load_causal_lm(model_dir)
    with pytest.raises(
        ConfigError,
        match=r"tokenizer of .*qwen-ish \(Qwen2Tokenizer\) does not round-trip the prompts: "
        r"'q: what is 2 \+ 3\?' \(line 1\) decodes back as 'q:whatis2\+3\?'",
    ):
        dataset_prompts(cfg, tokenizer, model_dir)
    _model, tokenizer = load_causal_lm(tiny_dir)  # the files as written: accepted
    assert dataset_prompts(cfg, tokenizer, tiny_dir).num_prompts == 1
