"""The trainer's dataset and TRL reward functions as rolloutlog's PromptSource.

A row's identity is rolloutlog's: its index in the dataset (and the pass over the data,
kept by the log). Map-style datasets are read by index; streaming (iterable) datasets are
read in order through a small window of rows, re-opened with ``skip(index)`` when a resume
asks for a row before the window.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import TrlConfigError

#: Dataset columns that are not passed to reward functions as keyword arguments (TRL's rule).
_NOT_REWARD_KWARGS = frozenset({"prompt", "completion", "completion_ids"})
RewardFunc = Callable[..., Any]


def reward_func_name(func: RewardFunc) -> str:
    """The name TRL logs a reward function under (``rewards/<name>``)."""
    name = getattr(func, "__name__", None) or type(func).__name__
    return str(name)


def _is_async(func: RewardFunc) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)  # noqa: B004 - a callable instance's async __call__
    )


class _Rows:
    """Random access to a map-style dataset, or a window over a streaming one."""

    def __init__(self, dataset: Any, size: int | None, window: int = 4096) -> None:
        self.dataset = dataset
        self.streaming = not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
        if self.streaming:
            if size is None:
                raise TrlConfigError(
                    "a streaming (iterable) train_dataset has no length: pass "
                    "dataset_size= (the number of prompts in one pass) to RolloutlogWorker"
                )
            self.size = int(size)
        else:
            self.size = len(dataset) if size is None else min(int(size), len(dataset))
        if self.size < 1:
            raise TrlConfigError("the train_dataset has no rows")
        self._window: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._window_size = window
        self._iter: Iterator[dict[str, Any]] | None = None
        self._next = 0
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row ``index`` (shared with other callers: read it, do not change it)."""
        if not self.streaming:
            # An Arrow row read costs far more than the reward that needs it, and a
            # group's rows are read once per sibling: recent rows are kept.
            with self._lock:
                row = self._window.get(index)
                if row is not None:
                    return row
            row = dict(self.dataset[int(index)])
            with self._lock:
                self._window[index] = row
                while len(self._window) > self._window_size:
                    self._window.popitem(last=False)
            return row
        with self._lock:
            row = self._window.get(index)
            if row is not None:
                return row
            if self._iter is None or index < self._next:
                self._open_at(index)
            assert self._iter is not None
            while self._next <= index:
                try:
                    row = dict(next(self._iter))
                except StopIteration as exc:
                    raise TrlConfigError(
                        f"the streaming train_dataset ended at row {self._next}, but "
                        f"dataset_size={self.size}: pass the number of rows it has"
                    ) from exc
                self._window[self._next] = row
                self._next += 1
                while len(self._window) > self._window_size:
                    self._window.popitem(last=False)
            return self._window[index]

    def _open_at(self, index: int) -> None:
        skip = getattr(self.dataset, "skip", None)
        if index and callable(skip):
            self._iter = iter(skip(index))
        else:
            self._iter = itertools.islice(iter(self.dataset), index, None)
        self._next = index
        self._window.clear()


class TrlPrompts:
    """A rolloutlog PromptSource over a TRL train dataset with TRL reward functions.

    ``reward(index, completion_ids)`` calls every function of ``reward_funcs`` with TRL's
    signature (``prompts=, completions=, completion_ids=, **dataset columns``, lists of one
    element here), sync or async, plus ``extra_reward(index, completion_ids)`` (rolloutlog's
    own reward, e.g. a ``PromptDataset``'s) and ``env_reward`` (a multi-turn trajectory's
    environment ``get_reward``, TRL's column named after the environment class), and sums
    them. A function may return ``None``
    for a completion it cannot score; one for which every function returned ``None`` fails
    (rolloutlog records it and its drop policy fills the slot). The sum is what the log keeps.
    """

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        reward_funcs: Sequence[RewardFunc] | RewardFunc | None = None,
        *,
        extra_reward: Callable[[int, Sequence[int]], float] | None = None,
        dataset_size: int | None = None,
        fingerprint: str | None = None,
        reward_timeout_s: float = 300.0,
        env_reward: Callable[[int, Sequence[int]], float | None] | None = None,
        env_reward_name: str = "environment",
    ) -> None:
        if reward_funcs is None:
            funcs: list[RewardFunc] = []
        elif callable(reward_funcs) and not isinstance(reward_funcs, list | tuple):
            funcs = [reward_funcs]
        else:
            funcs = list(reward_funcs)
        for func in funcs:
            if isinstance(func, str):
                raise TrlConfigError(
                    f"reward function {func!r} is a model name: the rolloutlog worker takes "
                    "callables (wrap a reward model in a function)"
                )
        if not funcs and extra_reward is None and env_reward is None:
            raise TrlConfigError(
                "no reward: pass reward_funcs (TRL's), extra_reward, or an environment_factory "
                "whose environment defines get_reward"
            )
        self.rows = _Rows(dataset, dataset_size)
        self.tokenizer = tokenizer
        self.reward_funcs = funcs
        self.extra_reward = extra_reward
        self.reward_names = [reward_func_name(f) for f in funcs]
        if extra_reward is not None:
            self.reward_names.append("rolloutlog")
        self.env_reward = env_reward
        if env_reward is not None:  # TRL's column for an environment's get_reward
            self.reward_names.append(env_reward_name)
        self.reward_timeout_s = reward_timeout_s
        self._fingerprint = fingerprint or self._compute_fingerprint()
        self._prompt_ids: dict[int, list[int]] = {}
        #: Per-function rewards of recent completions, for TRL's ``rewards/<name>`` metrics
        #: (the log keeps the sum); keyed by (prompt index, completion ids).
        self.per_func: OrderedDict[tuple[int, tuple[int, ...]], list[float]] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ PromptSource
    @property
    def fingerprint(self) -> str:
        """Identifies the dataset and the rewards (a resume on another one is refused)."""
        return self._fingerprint

    @property
    def num_prompts(self) -> int:
        """Prompts in one pass."""
        return self.rows.size

    def prompt_token_ids(self, index: int) -> list[int]:
        """Token ids of prompt ``index`` (the chat template for conversational prompts)."""
        ids = self._prompt_ids.get(index)
        if ids is None:
            prompt = self.rows[index]["prompt"]
            if isinstance(prompt, str):
                ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            else:
                ids = list(
                    self.tokenizer.apply_chat_template(
                        prompt, add_generation_prompt=True, tokenize=True
                    )
                )
            if len(self._prompt_ids) > 65536:
                self._prompt_ids.clear()
            self._prompt_ids[index] = ids
        return ids

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        """The summed reward of one completion (TRL's functions + rolloutlog's own)."""
        row = self.rows[index]
        ids = [int(t) for t in completion_token_ids]
        values: list[float] = []
        if self.reward_funcs:
            prompt = row["prompt"]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            completion: Any = (
                text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            )
            kwargs = {k: [v] for k, v in row.items() if k not in _NOT_REWARD_KWARGS}
            for func in self.reward_funcs:
                values.append(self._call(func, prompt, completion, ids, kwargs))
        if self.extra_reward is not None:
            values.append(float(self.extra_reward(index, ids)))
        if self.env_reward is not None:
            env = self.env_reward(index, ids)
            values.append(math.nan if env is None else float(env))
        scored = [v for v in values if not math.isnan(v)]
        if not scored:
            raise ValueError("every reward function returned None for this completion")
        key = (index, tuple(ids))
        self.per_func[key] = values
        while len(self.per_func) > 65536:
            self.per_func.popitem(last=False)
        return float(sum(scored))

    # ------------------------------------------------------------ helpers
    def messages(self, index: int) -> list[dict[str, Any]]:
        """The prompt as TRL's ``RolloutSample.prompt`` (messages)."""
        prompt = self.rows[index]["prompt"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]  # the row is shared: TRL gets its own messages

    def completion_messages(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        """A completion as TRL's ``RolloutSample.completion`` (messages)."""
        text = self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)
        return [{"role": "assistant", "content": text}]

    def close(self) -> None:
        """Stop the thread that runs async reward functions (if one was started)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _call(
        self,
        func: RewardFunc,
        prompt: Any,
        completion: Any,
        ids: list[int],
        kwargs: dict[str, list[Any]],
    ) -> float:
        args = {"prompts": [prompt], "completions": [completion], "completion_ids": [ids]}
        if _is_async(func):
            # The pump calls reward() inside its event loop: the coroutine runs on a
            # thread of its own loop, with a deadline.
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="rolloutlog-reward")
            future = self._executor.submit(asyncio.run, func(**args, **kwargs))
            out = future.result(timeout=self.reward_timeout_s)
        else:
            out = func(**args, **kwargs)
        value = next(iter(out))
        return float("nan") if value is None else float(value)

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(str(self.rows.size).encode())
        # Rows spread over the dataset (the first ones of a streaming dataset) identify
        # it: a dataset's own fingerprint may be random for in-memory data.
        n = self.rows.size
        picks = range(min(8, n)) if self.rows.streaming else sorted({i * n // 8 for i in range(8)})
        for i in picks:
            h.update(json.dumps(self.rows[i], sort_keys=True, default=str).encode())
        h.update(json.dumps(self.reward_names).encode())
        return "trl-" + h.hexdigest()[:16]
