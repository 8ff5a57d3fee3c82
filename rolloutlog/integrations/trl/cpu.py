"""TRL's real ``AsyncGRPOTrainer`` on a CPU-only machine: a reference kernel for demos and tests.

TRL (1.16) loads the policy with ``attn_implementation="tree_fa3"``: a flash-attention-3
varlen kernel fetched from the kernels hub (``trl/experimental/async_grpo/packing.py``),
which neither runs on CPU nor can be downloaded offline. This module is **opt-in**:
importing it changes nothing; only :func:`apply_cpu_patches` (called by
``rolloutlog demo --trainer trl`` and the training children of :func:`kill_and_resume`)
or the ``trl_on_cpu`` test fixture (``tests/integrations/conftest.py``, undone after the
test) install it. It is a slow per-segment reference on torch SDPA, for a tiny model on
CPU, never for real training (use TRL's own kernel on a GPU). It provides:

- :func:`varlen_attention` / :func:`cpu_tree_attention`: a reference implementation of
  the same packed ("tree") attention on torch SDPA, registered under TRL's name with
  the other CPU fixes of :func:`cpu_patches`;
- :func:`cpu_config`: an ``AsyncGRPOConfig`` that trains on CPU (no bf16, explicit token
  budget so nothing asks a vLLM server, no reporting);
- :func:`build_trainer` / :func:`run_training`: the real trainer with a rollout worker
  built by a *worker factory* (the in-memory worker of :mod:`rolloutlog.bench.trl_bench`,
  or rolloutlog's :func:`~rolloutlog.integrations.trl.bench_worker_factory`);
- :func:`kill_and_resume`: the SIGKILL harness: train in a child process (own process
  group, deadline), SIGKILL it after a checkpoint, resume with
  ``resume_from_checkpoint`` and return what both runs reported.

What TRL passes to the attention (read from ``packing.py``/``compute_loss``): the packed
row is one sequence (batch 1) of ``N`` unique tokens; ``tree_kv_index`` (``K``) lists,
segment after segment, the packed positions of each segment's root-to-segment path;
``tree_cu_seqlens_q`` (``S + 1``) bounds the segments in the row and
``tree_cu_seqlens_k`` (``S + 1``) their paths in ``tree_kv_index``. A segment's queries
are the last tokens of its path, so the causal mask is aligned bottom-right (the
flash-attention convention when the query is shorter than the key).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .errors import TrlIntegrationError

#: TRL's name for its packed attention (``trl.experimental.async_grpo.packing.TREE_ATTENTION``).
TREE_ATTENTION = "tree_fa3"

#: Environment of every child process: no hub, no telemetry, no tokenizer threads.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: The training child: ``python -m rolloutlog.integrations.trl.cpu SPEC.json``.
CHILD_MODULE = "rolloutlog.integrations.trl.cpu"


# --------------------------------------------------------------------------- attention


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention, the semantics of ``flash_attn_varlen_func(causal=True)``.

    ``query`` is ``(Nq, H, D)``; ``key``/``value`` are ``(Nk, Hkv, D)`` with ``H`` a
    multiple of ``Hkv`` (grouped-query attention). Segment ``s`` attends its queries
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` to its keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``
    with the causal mask aligned bottom-right: query ``i`` of a segment of ``q`` queries
    and ``k`` keys sees keys ``j <= i + k - q``, and with ``sliding_window`` only the
    last ``sliding_window`` of those. Returns ``(Nq, H, D)`` in ``query``'s dtype.
    """
    if query.dim() != 3 or key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"expected (N, H, D) tensors, got {query.shape}, {key.shape}, {value.shape}"
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cu_q) != len(cu_k) or cu_q[0] != 0 or cu_k[0] != 0:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both start at 0 and have one length")
    if cu_q[-1] != query.shape[0] or cu_k[-1] != key.shape[0]:
        raise ValueError(
            f"segments cover {cu_q[-1]} queries and {cu_k[-1]} keys, "
            f"tensors hold {query.shape[0]} and {key.shape[0]}"
        )
    out = query.new_empty(query.shape)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        n_q, n_k = q1 - q0, k1 - k0
        if n_q == 0:
            continue
        if n_q > n_k:
            raise ValueError(f"segment {s}: {n_q} queries but only {n_k} keys")
        i = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
        j = torch.arange(n_k).unsqueeze(0)
        allowed = j <= i
        if sliding_window is not None:
            allowed &= j > i - sliding_window
        # (H, n, D) for SDPA; grouped-query heads are expanded to the query heads.
        q = query[q0:q1].transpose(0, 1)
        k = key[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        v = value[k0:k1].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def cpu_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """TRL's ``packing.tree_attention`` with the FA3 kernel replaced by :func:`varlen_attention`.

    Same signature and layout as TRL's: ``query`` is ``(1, H, N, D)`` and ``key``/``value``
    ``(1, Hkv, N, D)`` (transformers' attention interface); the keys and values of each
    segment's path are gathered with ``tree_kv_index``; returns ``((1, N, H, D), None)``.
    Runs in the inputs' dtype (no flash-attention downcast of float32).
    """
    del module, attention_mask, tree_max_seqlen_q, tree_max_seqlen_k, kwargs
    if softcap:
        raise NotImplementedError("the CPU tree attention of the tests does not implement softcap")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))
    out = varlen_attention(
        q,
        k.index_select(0, tree_kv_index),
        v.index_select(0, tree_kv_index),
        tree_cu_seqlens_q,
        tree_cu_seqlens_k,
        scale=scaling,
        sliding_window=sliding_window,
    )
    return out.unsqueeze(0), None


def _no_mask(**kwargs: Any) -> None:
    return None


def _interfaces() -> tuple[Any, Any]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionInterface, AttentionMaskInterface


def _no_peak_flops(accelerator: Any, dtype: str) -> None:
    """TRL's ``get_peak_flops_per_device`` asks CUDA for the device name even on CPU
    (``torch.cuda.get_device_name``: "Torch not compiled with CUDA enabled"); on CPU
    there is no peak to report, which TRL reads as "MFU metrics disabled"."""
    return None


def cpu_patches() -> list[tuple[Any, str, Any]]:
    """The ``(object, attribute, value)`` replacements that let TRL's trainer run on CPU.

    - the packed attention under TRL's name (``AttentionInterface`` and
      ``AttentionMaskInterface`` global mappings, key ``tree_fa3``);
    - ``register_tree_attention`` as the trainer module calls it from
      ``AsyncGRPOTrainer.__init__`` (it would put the FA3 kernel back);
    - ``get_peak_flops_per_device`` in the trainer module (CUDA-only in TRL 1.16).

    :func:`apply_cpu_patches` applies them for good (child processes); the
    ``trl_on_cpu`` fixture applies them with ``monkeypatch`` (undone after the test).
    """
    from trl.experimental.async_grpo import async_grpo_trainer

    attention, mask = _interfaces()
    return [
        (attention._global_mapping, TREE_ATTENTION, cpu_tree_attention),
        (mask._global_mapping, TREE_ATTENTION, _no_mask),
        (async_grpo_trainer, "register_tree_attention", _noop),
        (async_grpo_trainer, "get_peak_flops_per_device", _no_peak_flops),
    ]


def _noop() -> None:
    return None


def apply_cpu_patches() -> None:
    """Apply :func:`cpu_patches` process-wide (for child processes only)."""
    for target, name, value in cpu_patches():
        if isinstance(target, dict):
            target[name] = value
        else:
            setattr(target, name, value)


# --------------------------------------------------------------------------- trainer


@dataclass
class TrainRunSpec:
    """One training run (JSON-serialisable: it is what a child process receives).

    ``worker_factory`` is ``"module:attribute"``: a callable taking a
    :class:`~rolloutlog.bench.trl_bench.WorkerContext` and returning a rollout worker
    (``RolloutWorkerProtocol``) or a :class:`~rolloutlog.bench.trl_bench.WorkerParts`.
    """

    model_dir: str
    output_dir: str
    max_steps: int = 4
    save_steps: int = 2
    batch_size: int = 4
    num_generations: int = 2
    max_completion_length: int = 8
    num_prompts: int = 16
    seed: int = 0
    learning_rate: float = 1e-3
    worker_factory: str = "rolloutlog.bench.trl_bench:in_memory_worker"
    backend: str = "deterministic"
    resume_from_checkpoint: str | None = None
    #: Seconds each generation request takes (deterministic backend); slows the worker
    #: so that a kill finds groups in flight.
    generation_latency_s: float = 0.0
    #: Seconds the trainer sleeps after each optimizer step (a child to be killed
    #: mid-run uses it so the parent sees the checkpoint before the run ends).
    step_sleep_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def cpu_config(output_dir: str | Path, **overrides: Any) -> Any:
    """An ``AsyncGRPOConfig`` that trains on CPU.

    The fields that matter there: ``use_cpu``; ``bf16=False`` (TRL defaults it to True);
    ``token_budget`` set (``None`` makes ``get_train_dataloader`` ask the vLLM server for
    its ``max_model_len``; ``<= 0`` packs a fixed ``per_device_train_batch_size`` samples
    per micro-batch); ``max_steps`` (the rollout queue is endless, so it is the stop);
    ``gradient_checkpointing=False`` (TRL defaults it to True; pointless for a tiny
    model); ``report_to="none"`` and ``disable_tqdm``.
    """
    from trl.experimental.async_grpo import AsyncGRPOConfig

    kwargs: dict[str, Any] = {
        "output_dir": str(output_dir),
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "token_budget": 0,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "num_generations": 2,
        "max_completion_length": 8,
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "report_to": "none",
        "disable_tqdm": True,
        "heartbeat_stale_after_s": 120.0,
        "dataloader_pin_memory": False,
        "seed": 0,
    }
    kwargs.update(overrides)
    return AsyncGRPOConfig(**kwargs)


def import_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module:attribute"``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"worker factory {spec!r}: expected 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"worker factory {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


class _ProgressCallback:
    """Writes ``progress.json`` (the last optimizer step) atomically after every step
    (once its logs are printed), and sleeps ``step_sleep_s`` (so that a parent can act
    between steps)."""

    def __init__(self, path: Path, step_sleep_s: float) -> None:
        self.path = path
        self.step_sleep_s = step_sleep_s
        #: The first optimizer step this process finished (after a resume: the
        #: checkpoint's step + 1).
        self.first_step: int | None = None

    def write(self, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"global_step": step, "pid": os.getpid()}))
        os.replace(tmp, self.path)


def _trainer_callback(progress: _ProgressCallback) -> Any:
    from transformers import TrainerCallback

    class ProgressCallback(TrainerCallback):  # type: ignore[misc]
        # A step is reported at the next step's begin (or the train's end), after the
        # step's logs were printed (PrinterCallback runs after this callback), so that a
        # parent killing on it finds TRL's metrics of every finished step in the log.
        start = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = state.global_step

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step > self.start:
                progress.write(state.global_step)
                if progress.step_sleep_s:
                    time.sleep(progress.step_sleep_s)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step > self.start:
                progress.write(state.global_step)

    return ProgressCallback()


def prompt_dataset(num_prompts: int, seed: int = 0) -> Any:
    """A map-style dataset of ``num_prompts`` addition prompts (``prompt``, ``answer``)."""
    from datasets import Dataset

    pairs = [((i * 7 + seed) % 10, (i * 3 + 1) % 10) for i in range(num_prompts)]
    return Dataset.from_dict(
        {
            "prompt": [f"q: {a}+{b}=? a:" for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


def build_trainer(
    spec: TrainRunSpec,
    *,
    callbacks: list[Any] | None = None,
    factory: Callable[[Any], Any] | None = None,
) -> Any:
    """The real ``AsyncGRPOTrainer`` for ``spec`` (the CPU attention must be registered).

    The rollout worker comes from ``factory`` or else from ``spec.worker_factory``.
    """
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from rolloutlog.bench import trl_bench

    config = cpu_config(
        spec.output_dir,
        max_steps=spec.max_steps,
        save_steps=spec.save_steps,
        per_device_train_batch_size=spec.batch_size,
        num_generations=spec.num_generations,
        max_completion_length=spec.max_completion_length,
        learning_rate=spec.learning_rate,
        seed=spec.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
    dataset = prompt_dataset(spec.num_prompts, spec.seed)
    context = trl_bench.WorkerContext(
        model_dir=Path(spec.model_dir),
        output_dir=Path(spec.output_dir),
        dataset=dataset,
        tokenizer=tokenizer,
        reward_funcs=[trl_bench.answer_reward],
        num_generations=spec.num_generations,
        max_completion_length=spec.max_completion_length,
        backend=spec.backend,
        generation_latency_s=spec.generation_latency_s,
        seed=spec.seed,
        resume_from_checkpoint=(
            None if spec.resume_from_checkpoint is None else Path(spec.resume_from_checkpoint)
        ),
        config=config,
        extra=dict(spec.extra),
    )
    make = factory if factory is not None else import_factory(spec.worker_factory)
    parts = trl_bench.as_parts(make(context))
    return AsyncGRPOTrainer(
        model=spec.model_dir,
        reward_funcs=[trl_bench.answer_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[*parts.callbacks, *(callbacks or [])],
        rollout_worker=parts.rollout_worker,
        weight_transfer=parts.weight_transfer,
    )


def run_training(spec: TrainRunSpec) -> dict[str, Any]:
    """Train ``spec`` in this process; returns what the run reached.

    Writes ``progress.json`` in ``output_dir`` after every optimizer step.
    """
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    progress = _ProgressCallback(out / "progress.json", spec.step_sleep_s)
    trainer = build_trainer(spec, callbacks=[_trainer_callback(progress)])
    started = time.monotonic()
    result = trainer.train(resume_from_checkpoint=spec.resume_from_checkpoint)
    return {
        "global_step": int(trainer.state.global_step),
        "first_step": progress.first_step,
        "training_loss": float(result.training_loss),
        "model_version": int(trainer.model_version),
        "resumed_from": spec.resume_from_checkpoint,
        "train_s": time.monotonic() - started,
        "log_history": trainer.state.log_history,
    }


# --------------------------------------------------------------------------- SIGKILL harness


class HarnessError(TrlIntegrationError):
    """A child training run failed, timed out or never reached its checkpoint."""


def rolloutlog_checkpoint_complete(checkpoint: Path) -> bool:
    """:func:`checkpoint_complete` and the rolloutlog worker's ``rolloutlog_state.json``
    written (its callback's ``on_save`` runs after HF's ``_save_checkpoint``)."""
    from .checkpoint import CHECKPOINT_FILE

    return checkpoint_complete(checkpoint) and (checkpoint / CHECKPOINT_FILE).is_file()


def checkpoint_complete(checkpoint: Path) -> bool:
    """Whether HF's ``_save_checkpoint`` finished ``checkpoint`` (its ``trainer_state.json``
    is written last and names the checkpoint's step)."""
    state_file = checkpoint / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return False
    return bool(state.get("global_step") == int(checkpoint.name.rpartition("-")[2]))


@dataclass
class ChildRun:
    """One child training process: its exit, what it printed and what it reported."""

    pid: int
    returncode: int | None
    killed: bool
    result: dict[str, Any] | None
    log: str
    seconds: float


@dataclass
class KillResumeResult:
    """What :func:`kill_and_resume` observed."""

    checkpoint: Path
    killed_at_step: int
    #: The ``checkpoint-*`` folders there were when the first run was killed.
    checkpoints_at_kill: list[str]
    first: ChildRun
    resumed: ChildRun


@contextmanager
def _child(
    spec: TrainRunSpec, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``spec`` as a child (own process group); kill the group on the way out."""
    spec_path = log_path.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(asdict(spec)))
    # Unbuffered: what the child printed (TRL's per-step logs) survives its SIGKILL.
    child_env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1", **(env or {})}
    # The caller's folder on the path: a worker factory may live in its modules.
    cwd = os.getcwd()
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (cwd, child_env.get("PYTHONPATH", "")) if p
    )
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, str(spec_path)],
            cwd=cwd,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _read_result(output_dir: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads((output_dir / "result.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def _read_step(output_dir: Path) -> int:
    try:
        return int(json.loads((output_dir / "progress.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return 0


def kill_and_resume(
    spec: TrainRunSpec,
    *,
    kill_at_step: int | None = None,
    checkpoint_ready: Callable[[Path], bool] = checkpoint_complete,
    deadline_s: float = 240.0,
    env: dict[str, str] | None = None,
) -> KillResumeResult:
    """Train ``spec`` in a child, SIGKILL it after a checkpoint, resume it; return both runs.

    The first child runs ``spec`` (its ``resume_from_checkpoint`` ignored) in its own
    process group. Once ``checkpoint-{save_steps}`` is complete (``checkpoint_ready``:
    by default HF's ``trainer_state.json`` written; a worker that saves its own state in
    ``on_save`` passes a predicate that also waits for its file) and the child has
    finished optimizer step ``kill_at_step`` (default ``save_steps + 1``: past the
    checkpoint, with rollouts in flight and queued), the whole group is killed with
    SIGKILL. A second child then resumes from that checkpoint with
    ``resume_from_checkpoint`` and runs to ``spec.max_steps``. The worker is whatever
    ``spec.worker_factory`` builds, so the same harness runs the in-memory worker and
    rolloutlog's. Every wait has a deadline (``deadline_s`` in all); on failure the
    children's logs are in the :class:`HarnessError`.
    """
    if spec.save_steps >= spec.max_steps:
        raise ValueError(f"save_steps {spec.save_steps} must be below max_steps {spec.max_steps}")
    kill_at = spec.save_steps + 1 if kill_at_step is None else kill_at_step
    if not spec.save_steps <= kill_at < spec.max_steps:
        raise ValueError(f"kill_at_step {kill_at} must be in [{spec.save_steps}, {spec.max_steps})")
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("progress.json", "result.json"):  # of an earlier run in the same folder
        (out / stale).unlink(missing_ok=True)
    checkpoint = out / f"checkpoint-{spec.save_steps}"
    deadline = time.monotonic() + deadline_s
    first_spec = TrainRunSpec(**{**asdict(spec), "resume_from_checkpoint": None})

    started = time.monotonic()
    first_log = out / "first.log"
    killed = False
    with _child(first_spec, first_log, env) as proc:
        while True:
            if checkpoint_ready(checkpoint) and _read_step(out) >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            if proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"the first run did not reach checkpoint-{spec.save_steps} and step {kill_at} "
                    f"within {deadline_s:.0f} s; its log:\n{_tail(first_log)}"
                )
            time.sleep(0.05)
        returncode = proc.wait(timeout=30)
        first_pid = proc.pid
    killed_at = _read_step(out)
    checkpoints_at_kill = sorted(p.name for p in out.glob("checkpoint-*"))
    first = ChildRun(
        first_pid,
        returncode,
        killed,
        _read_result(out),
        _tail(first_log),
        time.monotonic() - started,
    )
    if not killed:
        raise HarnessError(
            f"the first run exited (code {returncode}) before it could be killed at step "
            f"{kill_at}; its log:\n{first.log}"
        )

    resume_spec = TrainRunSpec(**{**asdict(spec), "resume_from_checkpoint": str(checkpoint)})
    started = time.monotonic()
    resumed_log = out / "resumed.log"
    with _child(resume_spec, resumed_log, env) as proc:
        try:
            returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise HarnessError(
                f"the resumed run did not finish within the {deadline_s:.0f} s deadline; its log:\n"
                f"{_tail(resumed_log)}"
            ) from None
    resumed = ChildRun(
        proc.pid,
        returncode,
        False,
        _read_result(out),
        _tail(resumed_log),
        time.monotonic() - started,
    )
    if returncode != 0 or resumed.result is None:
        raise HarnessError(f"the resumed run failed (exit {returncode}); its log:\n{resumed.log}")
    return KillResumeResult(checkpoint, killed_at, checkpoints_at_kill, first, resumed)


def _tail(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _child_main(spec_path: str) -> int:
    """Entry point of a child: register the CPU attention, train, write ``result.json``."""
    spec = TrainRunSpec(**json.loads(Path(spec_path).read_text()))
    apply_cpu_patches()
    result = run_training(spec)
    out = Path(spec.output_dir)
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, out / "result.json")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("spec", help="a TrainRunSpec as a JSON file")
    sys.exit(_child_main(parser.parse_args().spec))
