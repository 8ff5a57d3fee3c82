"""The multi-turn part of ``rolloutlog bench domain``: what turn events cost.

- :func:`bench_turn_overhead`: time per trajectory recorded turn by turn (every model
  call, tool request and result as an event with its token payload, then the
  trajectory's completion and the sibling's) against the same trajectory recorded as
  one completion (the sibling's completion and its payload), on the same controller and
  SQLite log, in interleaved blocks. Both are what the controller records; generation
  is not in either (a real engine's model calls would add the same time to both).
- :func:`bench_trajectory_restore`: the trajectory backend's :meth:`attach` (the fold of
  the open trajectories a restore reads) per trajectory, for two logs holding ``n`` and
  ``N`` open trajectories.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from rolloutlog.controller.multiturn import TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.eventstore import EventStore, PayloadPut, encode_arrays

from .domain_bench import BenchmarkError

_ProgressFn = Callable[[str], None]
DATASET_FINGERPRINT = "bench-domain-dataset"


class _Chars:
    """A tokenizer of one token per character (the backend only needs one to exist)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


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
        "ratios": {"turn_event_overhead": ratio},
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
    restore reads), for logs of ``sizes`` open trajectories of ``turns`` turns each."""
    say = progress or (lambda _m: None)
    out: dict[str, Any] = {}
    per: list[float] = []
    for n in sizes:
        built = time.perf_counter()
        ctl = _open_run(root / f"turn-restore-{n}.db", "bench-restore", n)
        rec = _Recorder(ctl, turns, 16, 4)
        for gid in sorted(ctl.state.groups):
            rec.start(gid, 64)
            rec.turns_of(gid, 64, turns)
        ctl.flush()
        build_s = time.perf_counter() - built
        backend = TrajectoryBackend(DeterministicBackend(), _Chars())
        times = []
        try:
            for _ in range(repeats):
                started = time.perf_counter()
                backend.attach(ctl)
                times.append(time.perf_counter() - started)
                if len(backend.book) != n or any(t.turns != turns for t in backend.book.values()):
                    raise BenchmarkError(f"attach folded {len(backend.book)} trajectories, not {n}")
        finally:
            ctl.close()
            ctl.store.close()
        times.sort()
        median = times[len(times) // 2]
        per.append(median / n)
        out[str(n)] = {
            "open_trajectories": n,
            "turns_each": turns,
            "log_events": ctl.state.last_seq,
            "build_s": build_s,
            "attach_median_s": median,
            "seconds_per_trajectory": median / n,
        }
        say(f"trajectory restore: {n} open trajectories, attach {median:.3f}s")
    out["ratios"] = {"restore_100k_vs_1k_trajectories": per[1] / per[0]}
    return out
