"""A scripted multi-turn task for the tests: add two digits with a calculator tool.

The model (the deterministic backend's ``script``) answers a prompt ``A+B=`` in three
turns: it calls ``add`` (a plain tool with side effects: each run appends its
idempotency key to a ledger file, and its status check reads that ledger), then
``submit`` (an environment method marked idempotent: it only sets the environment's
answer), then says ``ok.`` (no tool call: the trajectory ends). The environment is
TRL-shaped: ``reset(**kwargs)``, public methods as tools, ``get_reward``.

Text is ASCII, one token per character (vocabulary 128).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rolloutlog.controller.backends.base import GroupRequest, SiblingSpec
from rolloutlog.controller.backends.deterministic_backend import DeterministicBackend
from rolloutlog.controller.config import RolloutConfig, StoreConfig
from rolloutlog.controller.environments import Tool, idempotent
from rolloutlog.controller.multiturn import MultiTurnConfig, MultiTurnPrompts, TrajectoryBackend
from rolloutlog.controller.rollout_controller import RolloutController
from rolloutlog.controller.rollout_runtime import GenerationConfig, RolloutRuntime

VOCAB = 128
RUN = "mt"


class CharTokenizer:
    """One token per ASCII character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(int(t)) for t in token_ids)


TOKENIZER = CharTokenizer()


def operands(index: int) -> tuple[int, int]:
    return index % 7, (3 * index + 1) % 5


class Prompts:
    fingerprint = "multi-turn-add"
    num_prompts = 10_000

    def prompt_token_ids(self, index: int) -> list[int]:
        a, b = operands(index)
        return TOKENIZER.encode(f"{a}+{b}=")

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        return 0.0


def script(request: GroupRequest, spec: SiblingSpec) -> list[int]:
    """What the scripted model says to a context."""
    ctx = TOKENIZER.decode(request.prompt_token_ids)
    if "<tool>submit" in ctx:
        return TOKENIZER.encode("ok.")
    if "<tool>add" in ctx:
        found = re.findall(r"</tool>(-?\d+)", ctx)
        value = found[-1] if found else "0"
        return TOKENIZER.encode(f'<tool>submit {{"answer":{value}}}</tool>')
    a, b = (int(x) for x in re.match(r"(\d)\+(\d)=", ctx).groups())  # type: ignore[union-attr]
    return TOKENIZER.encode(f'<tool>add {{"a":{a},"b":{b}}}</tool>')


class Ledger:
    """The calculator's side effects: one line per run, ``key<TAB>result``, in a file
    (it survives the process that ran the tool)."""

    def __init__(self, path: Path, delay_s: float = 0.0) -> None:
        self.path = path
        self.delay_s = delay_s

    def add(self, a: int, b: int, idempotency_key: str) -> str:
        result = str(int(a) + int(b))
        with self.path.open("a") as f:
            f.write(f"{idempotency_key}\t{result}\n")
            f.flush()
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow tool: a kill can land between run and result
        return result

    def status(self, idempotency_key: str) -> str | None:
        for key, result in self.entries():
            if key == idempotency_key:
                return result
        return None

    def entries(self) -> list[tuple[str, str]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [tuple(line.split("\t", 1)) for line in lines if "\t" in line]  # type: ignore[misc]

    def tool(self) -> Tool:
        return Tool("add", self.add, status=self.status)


class AddEnv:
    """A TRL-shaped environment: ``reset``, tools as public methods, ``get_reward``."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.answer: int | None = None

    def reset(self, a: int, b: int) -> str:
        self.target, self.answer = a + b, None
        return "calc:"

    @idempotent
    def submit(self, answer: int) -> str:
        """Submit the final answer."""
        self.answer = int(answer)
        return "received"

    def get_reward(self) -> float:
        return 1.0 if self.answer is not None and self.answer == self.target else 0.0


def reset_kwargs(index: int) -> dict[str, Any]:
    a, b = operands(index)
    return {"a": a, "b": b}


ROLLOUT = RolloutConfig(group_size=2, groups_per_step=2, lookahead=1, staleness_bound=2)
STORE = StoreConfig(group_commit_window_ms=2, snapshot_interval=0)
GENERATION = GenerationConfig(max_tokens=120, max_in_flight_siblings=8)


def start(store: Any) -> RolloutController:
    return RolloutController.start(
        store,
        RUN,
        ROLLOUT,
        dataset_fingerprint=Prompts.fingerprint,
        dataset_size=Prompts.num_prompts,
        store_config=STORE,
    )


def runtime(
    ctl: RolloutController, ledger: Ledger, multi_turn: dict[str, Any] | None = None, **backend: Any
) -> tuple[RolloutRuntime, TrajectoryBackend, DeterministicBackend]:
    """The scripted task's runtime; ``multi_turn``: MultiTurnConfig fields to change."""
    inner = DeterministicBackend(vocab_size=VOCAB, max_model_len=512, script=script, **backend)
    multi = TrajectoryBackend(
        inner,
        TOKENIZER,
        environment_factory=AddEnv,
        tools=[ledger.tool()],
        reset_kwargs=reset_kwargs,
        config=MultiTurnConfig(max_turns=6, max_tokens_per_turn=40, **(multi_turn or {})),
    )
    multi.attach(ctl)
    rt = RolloutRuntime(ctl, multi, MultiTurnPrompts(Prompts(), multi), GENERATION)
    return rt, multi, inner


def json_dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True)
