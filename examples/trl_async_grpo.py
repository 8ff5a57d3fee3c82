"""TRL's AsyncGRPOTrainer with rolloutlog's rollout worker: train, checkpoint, resume.

    python examples/trl_async_grpo.py --model-dir MODEL --output-dir out --max-steps 20
    python examples/trl_async_grpo.py --model-dir MODEL --output-dir out --max-steps 40 --resume

What changes against a plain TRL script: the worker (``rollout_worker=``), its weight
transfer and its callback; ``--resume`` is TRL's own ``resume_from_checkpoint``, and the
worker continues from the rollout log (nothing lost, nothing trained twice, completions
made after the checkpoint reused). ``--cpu`` runs on a machine without a GPU (tiny models
only: it installs rolloutlog's CPU reference attention under TRL's ``tree_fa3`` name).
``--backend deterministic`` needs no inference engine (a smoke test); ``torch`` samples
from the model in-process; for real runs use rolloutlog's vLLM fleet backend.
See docs/integrations/trl.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def answer_reward(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """A TRL reward function: 1 when the completion contains the answer."""
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model-dir", required=True, help="a local model folder")
    parser.add_argument("--output-dir", default="out/trl-rolloutlog")
    parser.add_argument("--db", help="the rollout log URL (default: OUTPUT_DIR/rolloutlog.db)")
    parser.add_argument("--backend", default="deterministic", choices=["deterministic", "torch"])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    parser.add_argument("--cpu", action="store_true", help="train on CPU (tiny models)")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_utils import get_last_checkpoint
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from rolloutlog.controller.backends import make_backend
    from rolloutlog.integrations.trl import (
        NoOpWeightTransfer,
        RolloutlogWeightTransfer,
        RolloutlogWorker,
        store_url,
    )

    if args.cpu:
        from rolloutlog.integrations.trl.cpu import apply_cpu_patches

        apply_cpu_patches()
    out = Path(args.output_dir)
    pairs = [(i % 10, (i * 3 + 1) % 10) for i in range(256)]
    dataset = Dataset.from_dict(
        {"prompt": [f"q: {a}+{b}=? a:" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    on_cpu: dict[str, Any] = (
        {"use_cpu": True, "bf16": False, "gradient_checkpointing": False} if args.cpu else {}
    )
    config = AsyncGRPOConfig(
        output_dir=str(out),
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=8,  # a multiple of num_generations: whole groups
        num_generations=4,
        max_completion_length=16,
        token_budget=0,  # fixed-count micro-batches (the worker needs them)
        weight_sync_steps=1,
        report_to="none",
        **on_cpu,
    )
    options: dict[str, Any] = {"weight_shapes": None} if args.backend == "deterministic" else {}
    worker = RolloutlogWorker(
        store=args.db or store_url(out),
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_funcs=[answer_reward],
        backend=make_backend(args.backend, model_dir=args.model_dir, **options),
        args=config,
    )
    # The deterministic backend ignores weights; any other gets the trainer's each sync.
    deterministic = args.backend == "deterministic"
    transfer = NoOpWeightTransfer() if deterministic else RolloutlogWeightTransfer(worker)
    trainer = AsyncGRPOTrainer(
        model=args.model_dir,
        reward_funcs=[answer_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_worker=worker,
        weight_transfer=transfer,
        callbacks=[worker.callback],
    )
    resume = get_last_checkpoint(str(out)) if args.resume and out.is_dir() else None
    trainer.train(resume_from_checkpoint=resume)
    print(f"trained to step {trainer.state.global_step}; rollout log run {worker.run_id}")


if __name__ == "__main__":
    main()
