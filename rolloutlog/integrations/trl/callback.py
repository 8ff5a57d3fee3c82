"""The TrainerCallback of the rolloutlog worker: trained steps, checkpoints, resume."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from .errors import TrlConfigError

if TYPE_CHECKING:
    from .worker import RolloutlogWorker


class RolloutlogCallback(TrainerCallback):  # type: ignore[misc]
    """Records a group as trained at the optimizer step that consumed it, writes the log's
    offset into each TRL checkpoint, and restores the worker on a resume.

    The trainer's collator is wrapped (``on_train_begin``) to see which groups each
    micro-batch holds, in order; ``on_step_end`` counts the step's
    ``gradient_accumulation_steps`` micro-batches as trained. Micro-batches the dataloader
    has fetched ahead (prefetch, accumulation in progress) are not, so at a save their
    groups are still untrained in the log and come back after the resume.
    """

    def __init__(self, worker: RolloutlogWorker) -> None:
        self.worker = worker
        self._microbatches: deque[list[int]] = deque()
        self._lock = threading.Lock()
        #: Milliseconds each on_step_end took (the bench reads them).
        self.step_ms: list[float] = []

    # ------------------------------------------------------------ the collator
    def wrap_collator(self, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``collate`` noting each micro-batch's group ids (one per sample), in order."""
        if getattr(collate, "_rolloutlog_wrapped", False):
            return collate

        def collate_and_note(examples: Any) -> Any:
            out = collate(examples)
            (rows,) = examples  # TRL: one micro-batch of per-rank rows
            gids = [int(ex["group_id"]) for row in rows for ex in row.samples]
            with self._lock:
                self._microbatches.append(gids)
            return out

        collate_and_note._rolloutlog_wrapped = True  # type: ignore[attr-defined]
        return collate_and_note

    def _wrap_dataloader(self, dataloader: Any) -> None:
        base = getattr(dataloader, "base_dataloader", dataloader)
        collate = getattr(base, "collate_fn", None)
        if collate is None:
            raise TrlConfigError("the trainer's dataloader has no collate_fn to observe")
        base.collate_fn = self.wrap_collator(collate)

    # ------------------------------------------------------------ hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "weight_sync_steps", 1) != 1:
            raise TrlConfigError(
                f"weight_sync_steps={args.weight_sync_steps}: the rolloutlog worker needs a "
                "weight sync after every optimizer step (weight_sync_steps=1)"
            )
        budget = getattr(args, "token_budget", 0)
        if budget is not None and budget > 0:
            raise TrlConfigError(
                f"token_budget={budget}: the rolloutlog worker needs fixed-count micro-batches "
                "(token_budget=0) so an optimizer step trains whole groups"
            )
        worker = self.worker
        if state.global_step > 0 and worker.resumed_from is None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            worker.resume_from(folder)
        dataloader = kwargs.get("train_dataloader")
        if dataloader is not None:
            self._wrap_dataloader(dataloader)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import time

        started = time.perf_counter()
        steps = max(1, int(getattr(args, "gradient_accumulation_steps", 1)))
        gids: list[int] = []
        with self._lock:
            for _ in range(min(steps, len(self._microbatches))):
                gids.extend(self._microbatches.popleft())
        if gids:
            self.worker.record_trained(gids)
        epochs = self.worker.epochs
        if epochs is not None:
            target = epochs * self.worker.prompts.num_prompts
            if self.worker.trained_groups() >= target:
                control.should_training_stop = True
                control.should_save = True
        self.step_ms.append((time.perf_counter() - started) * 1e3)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Returns at once: the worker writes rolloutlog_state.json into the folder once
        # the log's checkpoint is durable (RolloutlogWorker.save_checkpoint); its stop(),
        # which TRL calls when training ends, waits for that.
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.worker.save_checkpoint(folder, int(state.global_step))
