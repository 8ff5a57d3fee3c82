"""The multi-turn part of ``rolloutlog bench domain``: what turn events cost.

- :func:`bench_turn_run` (``turn_event_overhead``): time per trajectory in a run (the
  runtime over the deterministic backend, a stated latency per model call, many
  trajectories at once), turn events (:class:`TrajectoryBackend`) against the same
  trajectory run by a loop that records no turn and recorded as one completion; and
  against one model call of the whole response (``turn_run_vs_single_call``).
- :func:`bench_turn_overhead` (``turn_record_overhead_no_engine``): only the recording,
  no engine and no runtime: a trajectory recorded turn by turn (every model call, tool
  request and result as an event with its token payload, then the trajectory's
  completion and the sibling's) against the sibling's completion alone, on the same
  controller and SQLite log, in interleaved blocks.
- :func:`bench_trajectory_restore`: the trajectory backend's :meth:`attach` (the fold of
  the open trajectories a restore reads) per trajectory, for two logs holding ``n`` and
  ``N`` open trajectories.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rolloutlog.controller.backends.base import GroupRequest, SiblingResult, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.domain import AdmitStep, CompleteSibling, DispatchSiblings
from rolloutlog.controller.domain.admission import admission_blocker
from rolloutlog.controller.domain.completion import Completion
from rolloutlog.controller.domain.trajectory import (
    ModelCallCompleted,
    RecordTurn,
    ToolCallCompleted,
    ToolCallRequested,
    TrajectoryBook,
    TrajectoryCompleted,
    TrajectoryStarted,
    TurnEvent,
    evolve_trajectory,
)
from rolloutlog.controller.environments import Tool, parse_tool_calls
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime
from rolloutlog.eventstore import EventStore, PayloadPut, encode_arrays

from .domain_bench import BenchmarkError

_ProgressFn = Callable[[str], None]
DATASET_FINGERPRINT = "bench-domain-dataset"


class _Chars:
    """A tokenizer of one token per character (the backend only needs one to exist)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("latin-1")


def _open_run(path: Path, run_id: str, groups: int) -> RolloutController:
    """A controller on a fresh SQLite log with ``groups`` groups of one sibling, each
    dispatched (open), none completed."""
    url = f"sqlite:///{path}"
    per_step = min(groups, 1_000)
    rollout = RolloutConfig(
        group_size=1,
        groups_per_step=per_step,
        sampler="ready_first",
        lookahead=-(-groups // per_step),
        spare_pool_size=0,
    )
    ctl = RolloutController.start(
        EventStore.open(url),
        run_id,
        rollout,
        dataset_fingerprint=DATASET_FINGERPRINT,
        dataset_size=groups,
        store_config=StoreConfig(url=url, snapshot_interval=0),
    )
    while admission_blocker(ctl.state) is None and len(ctl.state.groups) < groups:
        ctl.execute(AdmitStep())
    for g in list(ctl.state.groups.values()):
        ctl.execute(DispatchSiblings(g.group_id, (0,), ctl.state.published_version))
    ctl.flush()
    if len(ctl.state.groups) != groups:
        raise BenchmarkError(f"built {len(ctl.state.groups)} open groups, wanted {groups}")
    return ctl


def _ids(n: int, k: int) -> list[int]:
    return [(k * 31 + i * 7) % 1000 for i in range(n)]


class _Recorder:
    """Records trajectories on ``ctl`` as the trajectory backend does (events, payloads)."""

    def __init__(self, ctl: RolloutController, turns: int, model_tokens: int, tool_tokens: int):
        self.ctl = ctl
        self.turns = turns
        self.model_tokens = model_tokens
        self.tool_tokens = tool_tokens
        self.book: TrajectoryBook = {}

    def _rec(self, event: TurnEvent, *puts: PayloadPut) -> None:
        key = (event.group_id, event.sibling)
        self.ctl.execute(RecordTurn(event, self.book.get(key)), payload_puts=puts)
        evolve_trajectory(self.book, event, self.ctl.epoch)

    def _response(self, gid: int) -> dict[str, list[Any]]:
        ids: list[int] = []
        mask: list[int] = []
        for t in range(self.turns):
            ids += _ids(self.model_tokens, gid + t)
            mask += [1] * self.model_tokens
            ids += _ids(self.tool_tokens, gid - t)
            mask += [0] * self.tool_tokens
        return {"token_ids": ids, "logprobs": [-0.5] * len(ids), "loss_mask": mask}

    def start(self, gid: int, prompt_tokens: int) -> None:
        """Only the trajectory's start (an open trajectory for the restore benchmark)."""
        g = self.ctl.state.groups[gid]
        self._rec(
            TrajectoryStarted(
                group_id=gid,
                sibling=0,
                attempt=g.siblings[0].attempt,
                prompt_index=g.prompt_index,
                data_pass=g.data_pass,
                prompt_tokens=prompt_tokens,
            )
        )

    def turns_of(self, gid: int, prompt_tokens: int, turns: int) -> None:
        """``turns`` turns, each a model call and one tool call (request, result)."""
        attempt = self.ctl.state.groups[gid].siblings[0].attempt
        version = self.ctl.state.weight_version
        for t in range(turns):
            traj = self.book[(gid, 0)]
            out = _ids(self.model_tokens, gid + t)
            pid = f"g{gid}-t{t}"
            self._rec(
                ModelCallCompleted(
                    group_id=gid,
                    sibling=0,
                    attempt=attempt,
                    turn=t,
                    context_tokens=traj.context_tokens,
                    output_tokens=len(out),
                    weight_version=version,
                    payload_id=pid,
                    finish_reason="stop",
                ),
                PayloadPut(
                    pid,
                    "model_call",
                    encode_arrays({"token_ids": out, "logprobs": [-0.5] * len(out)}),
                ),
            )
            key = f"bench/g{gid}/s0/t{t}/c0"
            self._rec(
                ToolCallRequested(
                    group_id=gid,
                    sibling=0,
                    attempt=attempt,
                    turn=t,
                    call=0,
                    tool="calc",
                    arguments={"a": gid, "b": t},
                    idempotency_key=key,
                    idempotent=True,
                    status_check=False,
                )
            )
            obs = _ids(self.tool_tokens, gid - t)
            self._rec(
                ToolCallCompleted(
                    group_id=gid,
                    sibling=0,
                    attempt=attempt,
                    turn=t,
                    idempotency_key=key,
                    result=str(gid + t),
                    seconds=0.0,
                    observation_tokens=len(obs),
                    payload_id=f"{pid}-c0",
                ),
                PayloadPut(f"{pid}-c0", "observation", encode_arrays({"token_ids": obs})),
            )

    def trajectory(self, gid: int, prompt_tokens: int) -> None:
        """A whole trajectory turn by turn, then its completion and the sibling's."""
        self.start(gid, prompt_tokens)
        self.turns_of(gid, prompt_tokens, self.turns)
        arrays = self._response(gid)
        attempt = self.ctl.state.groups[gid].siblings[0].attempt
        version = self.ctl.state.weight_version
        model = sum(arrays["loss_mask"])
        self._rec(
            TrajectoryCompleted(
                group_id=gid,
                sibling=0,
                attempt=attempt,
                turns=self.turns,
                final_reward=1.0,
                model_tokens=model,
                observation_tokens=len(arrays["loss_mask"]) - model,
                payload_id=f"g{gid}-trajectory",
                oldest_weight_version=version,
                newest_weight_version=version,
                finish="max_turns",
            ),
            PayloadPut(
                f"g{gid}-trajectory",
                "trajectory",
                encode_arrays({**arrays, "weight_versions": [version] * len(arrays["loss_mask"])}),
            ),
        )
        self.completion(gid, prompt_tokens, arrays)

    def completion(
        self, gid: int, prompt_tokens: int, arrays: dict[str, list[Any]] | None = None
    ) -> None:
        """The sibling's completion of the whole response (what a single-turn run records)."""
        arrays = arrays or self._response(gid)
        sib = self.ctl.state.groups[gid].siblings[0]
        pid = f"tok-{gid:08d}-00-{sib.attempt}"
        data = {"token_ids": arrays["token_ids"], "logprobs": arrays["logprobs"]}
        self.ctl.execute(
            CompleteSibling(
                Completion(
                    group_id=gid,
                    sibling=0,
                    attempt=sib.attempt,
                    weight_version=sib.weight_version or 0,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=len(arrays["token_ids"]),
                    reward=1.0,
                    payload_id=pid,
                    finish_reason="stop",
                )
            ),
            payload_puts=(PayloadPut(pid, "completion", encode_arrays(data)),),
        )


def bench_turn_overhead(
    root: Path,
    trajectories: int,
    *,
    turns: int = 10,
    model_tokens: int = 64,
    tool_tokens: int = 16,
    block: int = 50,
    progress: _ProgressFn | None = None,
) -> dict[str, Any]:
    """Seconds per trajectory recorded turn by turn vs as one completion (interleaved
    blocks of ``block`` trajectories on one controller, each block flushed)."""
    say = progress or (lambda _m: None)
    ctl = _open_run(root / "turn-overhead.db", "bench-turns", 2 * trajectories)
    rec = _Recorder(ctl, turns, model_tokens, tool_tokens)
    gids = sorted(ctl.state.groups)
    timed: dict[str, list[float]] = {"turns": [], "one_completion": []}
    counts = {"turns": 0, "one_completion": 0}
    block = max(1, min(block, trajectories // 4))
    each = {"turns": gids[0::2], "one_completion": gids[1::2]}
    try:
        for b, lo in enumerate(range(0, trajectories, block)):
            order = ("turns", "one_completion") if b % 2 == 0 else ("one_completion", "turns")
            for mode in order:
                chunk = each[mode][lo : lo + block]
                started = time.perf_counter()
                for gid in chunk:
                    if mode == "turns":
                        rec.trajectory(gid, 64)
                    else:
                        rec.completion(gid, 64)
                ctl.flush()
                timed[mode].append(time.perf_counter() - started)
                counts[mode] += len(chunk)
        say(f"turn overhead: {trajectories} trajectories of {turns} turns each way")
    finally:
        ctl.close()
        ctl.store.close()
    per = {m: sum(timed[m]) / counts[m] for m in timed if counts[m]}
    ratio = per["turns"] / per["one_completion"]
    return {
        "turns": turns,
        "model_tokens_per_turn": model_tokens,
        "tool_tokens_per_turn": tool_tokens,
        "trajectories_each": counts,
        "seconds_per_trajectory_turn_events": per["turns"],
        "seconds_per_trajectory_one_completion": per["one_completion"],
        "extra_ms_per_turn": (per["turns"] - per["one_completion"]) * 1000 / turns,
        # Computed, not measured: the model-call time above which a real run's ratio
        # (generation in both) would be within the target, (T - 1.05 O) / 0.05 / turns.
        "model_call_ms_for_1_05": max(0.0, per["turns"] - 1.05 * per["one_completion"])
        / 0.05
        / turns
        * 1000,
        "ratios": {"turn_record_overhead_no_engine": ratio},
    }


def bench_trajectory_restore(
    root: Path,
    sizes: tuple[int, int],
    *,
    turns: int = 2,
    repeats: int = 3,
    progress: _ProgressFn | None = None,
) -> dict[str, Any]:
    """Seconds per open trajectory of :meth:`TrajectoryBackend.attach` (the fold a
    restore reads), for logs of ``sizes`` open trajectories of ``turns`` turns each:
    both logs built first, then their attaches alternated ``repeats`` times (a load that
    changes meanwhile falls on both), the median of each."""
    say = progress or (lambda _m: None)
    out: dict[str, Any] = {}
    ctls: list[RolloutController] = []
    times: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for n in sizes:
            built = time.perf_counter()
            ctl = _open_run(root / f"turn-restore-{n}.db", "bench-restore", n)
            ctls.append(ctl)
            rec = _Recorder(ctl, turns, 16, 4)
            for gid in sorted(ctl.state.groups):
                rec.start(gid, 64)
                rec.turns_of(gid, 64, turns)
            ctl.flush()
            out[str(n)] = {
                "open_trajectories": n,
                "turns_each": turns,
                "log_events": ctl.state.last_seq,
                "build_s": time.perf_counter() - built,
            }
        for _ in range(repeats):
            for n, ctl in zip(sizes, ctls, strict=True):
                backend = TrajectoryBackend(DeterministicBackend(), _Chars())
                started = time.perf_counter()
                backend.attach(ctl)
                times[n].append(time.perf_counter() - started)
                if len(backend.book) != n or any(t.turns != turns for t in backend.book.values()):
                    raise BenchmarkError(f"attach folded {len(backend.book)} trajectories, not {n}")
    finally:
        for ctl in ctls:
            ctl.close()
            ctl.store.close()
    per = []
    for n in sizes:
        median = sorted(times[n])[len(times[n]) // 2]
        per.append(median / n)
        out[str(n)].update(
            attach_s=times[n], attach_median_s=median, seconds_per_trajectory=median / n
        )
        say(f"trajectory restore: {n} open trajectories, attach {median:.3f}s")
    out["ratios"] = {"restore_100k_vs_1k_trajectories": per[1] / per[0]}
    return out


# ---------------------------------------------------------------------------- in a run

#: The ways one trajectory is run in :func:`bench_turn_run`.
RUN_MODES = ("turns", "one_completion", "single_call")


class _RunPrompts:
    """``prompt_tokens`` token ids per prompt; every reward 1.0."""

    fingerprint = DATASET_FINGERPRINT

    def __init__(self, prompt_tokens: int, num_prompts: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.num_prompts = num_prompts

    def prompt_token_ids(self, index: int) -> list[int]:
        return [t % 256 for t in _ids(self.prompt_tokens, index)]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return 1.0


@dataclass(frozen=True)
class TurnRunShape:
    """The run every way shares: its rollout shape and the model calls' latency."""

    turns: int = 10
    model_tokens: int = 64
    tool_tokens: int = 16
    prompt_tokens: int = 64
    #: Seconds one model call takes (the deterministic backend sleeps it; a single call
    #: of the whole response takes ``turns`` times it).
    model_call_s: float = 0.02
    group_size: int = 4
    groups_per_step: int = 8
    lookahead: int = 1
    max_in_flight_siblings: int = 64

    @property
    def response_tokens(self) -> int:
        return self.turns * (self.model_tokens + self.tool_tokens)


def _model_output(tokens: int) -> tuple[int, ...]:
    """A model call's ``tokens`` token ids: one tool call, padded with spaces."""
    text = '<tool>calc {"a": 1, "b": 2}</tool>'
    return tuple(ord(c) for c in text.ljust(tokens)[:tokens])


def _calc_tool(shape: TurnRunShape) -> Tool:
    result = "3".ljust(shape.tool_tokens)

    def calc(a: int, b: int) -> str:
        return result

    return Tool("calc", calc, idempotent=True)


class _UnrecordedTurns:
    """The same trajectory run by a plain multi-turn loop that records no turn: the
    same model calls on ``inner``, tool calls parsed and run, results tokenised into the
    context; the runtime records the whole response as one completion."""

    name = "unrecorded-multi-turn"

    def __init__(self, inner: DeterministicBackend, tool: Tool, turns: int, per_call: int):
        self.inner = inner
        self.tool = tool
        self.turns = turns
        self.per_call = per_call
        self.tokenizer = _Chars()

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def abort(self, group_id: int) -> None:
        await self.inner.abort(group_id)

    async def update_weights(self, named_tensors: Any, version: int) -> None:
        await self.inner.update_weights(named_tensors, version)

    async def generate(self, request: GroupRequest) -> list[SiblingResult]:
        return list(await asyncio.gather(*(self._one(request, s) for s in request.siblings)))

    async def _one(self, request: GroupRequest, spec: SiblingSpec) -> SiblingResult:
        context = list(request.prompt_token_ids)
        ids: list[int] = []
        logprobs: list[float] = []
        version = self.inner.weight_version
        for _turn in range(self.turns):
            left = request.sampling.max_tokens - len(ids)
            sampling = replace(request.sampling, max_tokens=min(self.per_call, left))
            turn = GroupRequest(request.group_id, tuple(context), (spec,), sampling)
            (res,) = await self.inner.generate(turn)
            version = res.weight_version
            context += res.token_ids
            ids += res.token_ids
            logprobs += res.logprobs
            for call in parse_tool_calls(self.tokenizer.decode(res.token_ids)):
                out = self.tokenizer.encode(str(self.tool(call.arguments, "")))
                out = out[: request.sampling.max_tokens - len(ids)]
                context += out
                ids += out
                logprobs += [0.0] * len(out)
        finish = "length" if len(ids) >= request.sampling.max_tokens else "stop"
        return SiblingResult.generated(request, spec, version, tuple(ids), tuple(logprobs), finish)


def _run_controller(path: Path, shape: TurnRunShape, run_id: str, steps: int) -> RolloutController:
    url = f"sqlite:///{path}"
    rollout = RolloutConfig(
        group_size=shape.group_size,
        groups_per_step=shape.groups_per_step,
        lookahead=shape.lookahead,
        # ready_first never evicts: the run trains without publishing weights (a publish
        # waits for in-flight model calls, a tenth as long for turns as for a single
        # call), and the backend's version stays 0.
        sampler="ready_first",
    )
    return RolloutController.start(
        EventStore.open(url),
        run_id,
        rollout,
        dataset_fingerprint=DATASET_FINGERPRINT,
        # Twice what the steps and the lookahead take: a run that drops prompts (a bug
        # here) runs out of data and stops instead of spinning.
        dataset_size=2 * (steps + shape.lookahead + 1) * shape.groups_per_step,
        store_config=StoreConfig(url=url, snapshot_interval=0),
    )


def _runtime(mode: str, ctl: RolloutController, shape: TurnRunShape) -> RolloutRuntime:
    prompts = _RunPrompts(shape.prompt_tokens, ctl.state.dataset_size)
    response = shape.response_tokens
    generation = GenerationConfig(
        max_in_flight_siblings=shape.max_in_flight_siblings, max_tokens=response
    )
    max_len = shape.prompt_tokens + response
    if mode == "single_call":
        whole = tuple(t % 256 for t in _ids(response, 7))
        single = DeterministicBackend(
            vocab_size=256,
            max_model_len=max_len,
            latency=shape.turns * shape.model_call_s,
            script=lambda _r, _s: whole,
        )
        return RolloutRuntime(ctl, single, prompts, generation)
    output = _model_output(shape.model_tokens)
    inner = DeterministicBackend(
        vocab_size=256,
        max_model_len=max_len,
        latency=shape.model_call_s,
        script=lambda _r, _s: output,
    )
    if mode == "one_completion":
        plain = _UnrecordedTurns(inner, _calc_tool(shape), shape.turns, shape.model_tokens)
        return RolloutRuntime(ctl, plain, prompts, generation)
    multi = TrajectoryBackend(
        inner,
        _Chars(),
        tools=[_calc_tool(shape)],
        config=MultiTurnConfig(max_turns=shape.turns, max_tokens_per_turn=shape.model_tokens),
    )
    multi.attach(ctl)
    return RolloutRuntime(ctl, multi, MultiTurnPrompts(prompts, multi), generation)


async def _timed_block(
    mode: str, ctl: RolloutController, shape: TurnRunShape, steps: int
) -> tuple[float, int]:
    """Seconds from the runtime's start to its ``steps``-th batch trained, and the
    trajectories trained (each checked to hold the whole response)."""
    rt = _runtime(mode, ctl, shape)
    want = shape.response_tokens
    trained = 0
    started = time.perf_counter()
    await rt.start()
    try:
        for step in range(steps):
            batch = await rt.next_batch(step, timeout=120)
            for sample in batch.samples:
                if len(sample.completion_token_ids) != want:
                    raise BenchmarkError(
                        f"{mode}: a sample of {len(sample.completion_token_ids)} tokens, not {want}"
                    )
            trained += len(batch.samples)
            await rt.report_trained(step, step + 1)
        seconds = time.perf_counter() - started
    finally:
        await rt.close()
    return seconds, trained


def bench_turn_run(
    root: Path,
    *,
    blocks: int,
    steps_per_block: int,
    shape: TurnRunShape | None = None,
    progress: _ProgressFn | None = None,
) -> dict[str, Any]:
    """Seconds per trajectory in a run: :class:`RolloutRuntime` over the deterministic
    backend (``shape.model_call_s`` per model call), each sibling a trajectory of
    ``turns`` turns (a model call, one tool call), three ways:

    - ``turns``: through :class:`TrajectoryBackend` (every turn event and payload);
    - ``one_completion``: the same trajectory (same model calls, same tool) run by a
      plain loop that records no turn, the runtime recording it as one completion;
    - ``single_call``: the same response as one model call of ``turns`` calls' latency.

    Interleaved blocks (the order rotates), each a short run of ``steps_per_block``
    steps on a fresh SQLite log, timed from the runtime's start to its last batch."""
    say = progress or (lambda _m: None)
    shape = shape or TurnRunShape()
    timed: dict[str, list[float]] = {m: [] for m in RUN_MODES}
    counts = dict.fromkeys(RUN_MODES, 0)
    events = dict.fromkeys(RUN_MODES, 0)
    for b in range(blocks):
        order = RUN_MODES[b % 3 :] + RUN_MODES[: b % 3]
        for mode in order:
            path = root / f"turn-run-{mode}-{b}.db"
            ctl = _run_controller(path, shape, f"bench-{mode}", steps_per_block)
            try:
                seconds, trained = asyncio.run(_timed_block(mode, ctl, shape, steps_per_block))
                events[mode] += ctl.state.last_seq
            finally:
                ctl.close()
                ctl.store.close()
            timed[mode].append(seconds)
            counts[mode] += trained
    say(f"turn run: {blocks} blocks of {steps_per_block} steps each way")
    per = {m: sum(timed[m]) / counts[m] for m in RUN_MODES}
    return {
        "shape": asdict(shape),
        "blocks": blocks,
        "steps_per_block": steps_per_block,
        "trajectories_each": counts,
        "log_events": events,
        "block_seconds": timed,
        "seconds_per_trajectory": per,
        "ratios": {
            "turn_event_overhead": per["turns"] / per["one_completion"],
            "turn_run_vs_single_call": per["turns"] / per["single_call"],
        },
    }
