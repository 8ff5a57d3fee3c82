"""GRPO on the toy task through rolloutlog's library API, with a resumable checkpoint.

The loop, spelled out (``rolloutlog.grpo.loop.run_training`` is the same loop with
more options; ``rolloutlog run`` and ``rolloutlog demo`` use it):

1. Build the tiny torch policy locally (no hub access) and wrap it in a
   :class:`~rolloutlog.grpo.trainer.GRPOTrainer`.
2. Open the log (:class:`rolloutlog.eventstore.EventStore`, SQLite or PostgreSQL URL) and either
   start a run (:meth:`RolloutController.start`) or restore it
   (:meth:`RolloutController.restore`) from the rollout offset stored in the newest
   model checkpoint.
3. Run the rollout pump (:class:`~rolloutlog.controller.rollout_runtime.RolloutRuntime`) against a
   generation backend (the in-process torch backend here).
4. Per step: ``next_batch(step)`` (durable before it returns), ``trainer.train_step``,
   ``report_trained``, ``publish_weights``; every ``--checkpoint-every`` steps
   ``checkpoint()`` returns the log offset, saved *inside* the model checkpoint, so model
   and rollout state are restored together.

Usage::

    python examples/grpo_toy.py --db sqlite:///runs/example.db --steps 12
    python examples/grpo_toy.py --db sqlite:///runs/example.db --steps 20 --resume

Each step prints one JSON line (``{"event": "step", "step": ..., "reward": ...}``);
the mean reward (the fraction of ``a`` characters in the completion) rises within a
dozen steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends.torch_backend import TorchBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore
from rolloutlog.grpo.loop import TokenizedPrompts
from rolloutlog.grpo.tiny_model import build_tiny_model, load_policy
from rolloutlog.grpo.toy_task import ToyTask, ToyTaskConfig
from rolloutlog.grpo.trainer import GRPOConfig, GRPOTrainer, TrainSample

MAX_MODEL_LEN = 64


def emit(msg: dict[str, Any]) -> None:
    """Print one progress message as a JSON line."""
    print(json.dumps(msg), flush=True)


def save_checkpoint(folder: Path, trainer: GRPOTrainer, step: int, offset: int) -> Path:
    """Write the trainer state and the rollout offset atomically as ``step-NNNNNN.pt``."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:06d}.pt"
    tmp = folder / f".{final.name}.tmp"
    torch.save({"train_step": step, "offset": offset, "trainer": trainer.state_dict()}, tmp)
    os.replace(tmp, final)  # never half a checkpoint
    return final


def newest_checkpoint(folder: Path) -> dict[str, Any] | None:
    """The newest checkpoint in ``folder`` (``None`` if there is none)."""
    files = sorted(folder.glob("step-*.pt"))
    if not files:
        return None
    return torch.load(files[-1], map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


async def train(args: argparse.Namespace) -> int:
    """Run (or resume) the GRPO loop; returns the process exit code."""
    work = Path(args.workdir)
    ckpt_dir = work / "checkpoints" / args.run_id
    ckpt = newest_checkpoint(ckpt_dir) if args.resume else None
    if args.resume and ckpt is None:
        print(f"no checkpoint in {ckpt_dir} to resume from", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model_dir = build_tiny_model(work / "tiny-model")
    model, tokenizer = load_policy(model_dir)
    trainer = GRPOTrainer(model, GRPOConfig(lr=args.lr), pad_token_id=int(tokenizer.pad_token_id))
    task = ToyTask(ToyTaskConfig(num_prompts=256, target="a"))
    prompts = TokenizedPrompts(task, tokenizer)
    rollout = RolloutConfig(
        group_size=4, groups_per_step=8, lookahead=1, staleness_bound=1, spare_pool_size=2
    )
    store_cfg = StoreConfig(url=args.db)

    store = EventStore.open(args.db)
    try:
        if ckpt is not None:
            trainer.load_state_dict(ckpt["trainer"])  # the model ...
            controller, report = RolloutController.restore(  # ... and the rollout state
                store,
                args.run_id,
                ckpt["offset"],
                rollout=rollout,
                dataset_fingerprint=task.fingerprint,
                store_config=store_cfg,
            )
            emit({"event": "restored", **report.to_dict()})
        else:
            controller = RolloutController.start(
                store,
                args.run_id,
                rollout,
                dataset_fingerprint=task.fingerprint,
                dataset_size=task.num_prompts,
                store_config=store_cfg,
            )
        version = controller.state.weight_version
        try:
            backend = TorchBackend(
                (trainer.model, tokenizer),  # type: ignore[arg-type]
                max_model_len=MAX_MODEL_LEN,
                seed=args.seed,
                weight_version=version,
            )
            runtime = RolloutRuntime(
                controller,
                backend,
                prompts,
                GenerationConfig(max_in_flight_siblings=64, max_tokens=8),
            )
        except BaseException:
            controller.close()  # nothing else owns it yet
            raise
        try:
            await runtime.start()
            if ckpt is not None:  # the backend serves the restored trainer's weights
                await runtime.sync_weights(trainer.named_weights(), version)
            for step in range(controller.state.train_step, args.steps):
                batch = await runtime.next_batch(step)
                samples = [TrainSample.from_rollout(s) for s in batch.samples]
                stats = await asyncio.to_thread(trainer.train_step, samples)
                version = step + 1
                await runtime.report_trained(step, version)
                await runtime.publish_weights(trainer.named_weights(), version)
                msg: dict[str, Any] = {
                    "event": "step",
                    "step": step,
                    "reward": batch.mean_reward,
                    "loss": stats.loss,
                }
                if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
                    offset = await runtime.checkpoint(step + 1)
                    save_checkpoint(ckpt_dir, trainer, step + 1, offset)
                    msg["checkpoint_offset"] = offset
                emit(msg)
        finally:
            # Each closes even if the one before it raised.
            try:
                await runtime.close()
            finally:
                try:
                    await backend.close()
                finally:
                    controller.close()
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite:///runs/example.db", help="log database URL")
    parser.add_argument("--steps", type=int, default=12, help="train steps in total")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--run-id", default="grpo-toy", help="run id in the log")
    parser.add_argument("--workdir", default="runs/example", help="model and checkpoints")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.db.startswith("sqlite:///"):
        Path(args.db.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return asyncio.run(train(args))


if __name__ == "__main__":
    sys.exit(main())
