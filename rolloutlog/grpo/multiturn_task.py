"""The shipped multi-turn task: add two digits, with a calculator tool.

A prompt is ``A+B`` (two digits). The model may call the calculator, read its result,
and then answers; the trajectory ends at its first output that calls no tool. The
environment is written as a TRL ``environment_factory`` object: ``reset(**kwargs)``
(TRL passes the dataset row's columns: here ``a`` and ``b``), its public methods are
the tools (``calculate``), and ``step(text)`` scores the answer (its reward is recorded
in the log with the step, see below for why not ``get_reward``).

Tool-call protocol: the default ``<tool>calculate {}</tool>`` works, and so does ``=``
anywhere in the output (the tiny demo model's 55-character vocabulary has no ``<``,
``{`` or ``"``): see :func:`parse_calls`.

The calculator has a side effect outside the environment object: every run appends
``idempotency_key<TAB>result`` to a ledger file (:class:`CalculatorLedger`), the tool's
own record of what it executed. It is not idempotent; it provides a status check by
idempotency key (``tool_status``, read from the ledger), so after a crash between its
request and its result a restore asks the ledger instead of running it again. The demo
counts the ledger's lines per key: a key with two lines is a tool call executed twice.

Reward of the answer (the first output without a tool call): ``1.0`` if its leading
digits are ``A+B``; ``0.3`` if it starts with another number; ``0.0`` otherwise (a
trajectory that never answers within ``max_turns`` also scores 0). A random tiny
policy scores about 0.09; it first learns to answer with a number, and to get the last
0.7 it must copy the calculator's result.

Why ``step`` and not ``get_reward``: the reward of a step is recorded with the step
(``EnvironmentStepped``), so a restored trajectory whose answer was already scored
keeps its reward; ``get_reward`` reads the environment object's memory, which a
restore rebuilds only from idempotent tool calls.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from rolloutlog.controller.environments import ToolCall, parse_tool_calls

#: Bumped whenever prompts or the reward change meaning (part of the fingerprint).
TASK_VERSION = 1
#: The reward of an answer that is a number, but not the sum.
NUMBER_REWARD = 0.3
_LEADING_NUMBER = re.compile(r"\s*(\d+)")


def operands(index: int) -> tuple[int, int]:
    """The two digits of prompt ``index`` (a pure function of the index)."""
    return (7 * index + 3) % 10, (3 * index + 1) % 10


def parse_calls(text: str) -> list[ToolCall]:
    """Tool calls of a model output: the default ``<tool>NAME {json}</tool>`` protocol,
    else one ``calculate`` call when the output holds ``=``."""
    calls = parse_tool_calls(text)
    if calls:
        return calls
    return [ToolCall("calculate", {})] if "=" in text else []


def answer_reward(text: str, a: int, b: int) -> float:
    """Reward of an answer: 1 for the sum, NUMBER_REWARD for another number, else 0."""
    match = _LEADING_NUMBER.match(text)
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) == a + b else NUMBER_REWARD


class CalculatorLedger:
    """The calculator's side effects: one line per run, ``key<TAB>result``, in a file
    that outlives the process that ran the tool."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def record(self, idempotency_key: str, result: str) -> None:
        """Append one execution (flushed before the result is returned)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"{idempotency_key}\t{result}\n")
            f.flush()

    def entries(self) -> list[tuple[str, str]]:
        """Every execution, oldest first."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            key, sep, result = line.partition("\t")
            if sep:
                out.append((key, result))
        return out

    def status(self, idempotency_key: str) -> str | None:
        """The result of the call with this key if it ran, else None."""
        for key, result in self.entries():
            if key == idempotency_key:
                return result
        return None


class CalculatorEnv:
    """A TRL-shaped environment: ``reset(a, b)``, the ``calculate`` tool, ``step``.

    ``environment_factory`` is ``lambda: CalculatorEnv(ledger)`` (one object per
    trajectory); the same class runs unchanged under TRL's ``environment_factory``.
    """

    def __init__(
        self, ledger: CalculatorLedger, delay_s: float = 0.0, answer_delay_s: float = 0.0
    ) -> None:
        self.ledger = ledger
        #: Seconds each run takes after its side effect and before its result (a slow
        #: tool: the demo's crash lands between the two).
        self.delay_s = delay_s
        #: Seconds scoring an answer takes (a slow environment: the demo's crash lands
        #: after a durable model call and before the trajectory's end).
        self.answer_delay_s = answer_delay_s
        self.a = 0
        self.b = 0

    def reset(self, a: int, b: int) -> str | None:
        """Start a trajectory for the question ``a+b`` (no first observation)."""
        self.a, self.b = int(a), int(b)
        return None

    def calculate(self, idempotency_key: str) -> str:
        """Compute the question's sum; the result is fed back to the model as ``=N``."""
        result = str(self.a + self.b)
        self.ledger.record(idempotency_key, result)
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow tool (it blocks its caller, as TRL's would)
        return f"={result} "

    def tool_status(self, name: str, idempotency_key: str) -> str | None:
        """Status check of the method tools by idempotency key (from the ledger)."""
        result = self.ledger.status(idempotency_key)
        return None if result is None else f"={result} "

    def step(self, text: str) -> tuple[str | None, float | None, bool]:
        """Score an output that calls no tool: it is the answer; the trajectory ends."""
        if self.answer_delay_s:
            time.sleep(self.answer_delay_s)
        return None, answer_reward(text, self.a, self.b), True


class _Tokenizer(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class TextTokenizer:
    """A Hugging Face tokenizer as the trajectory backend's ``encode``/``decode`` (no
    special tokens added to tool or environment text; specials dropped when decoding)."""

    def __init__(self, tokenizer: _Tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens)."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens dropped)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


class CalculatorPrompts:
    """The task's prompts at token level (a ``PromptSource``): ``<bos>A+B`` for
    ``num_prompts`` prompts. Its own reward (used only for a trajectory without an
    environment reward: one that never answered) is 0."""

    def __init__(self, tokenizer: _Tokenizer, num_prompts: int) -> None:
        self.tokenizer = tokenizer
        self._num_prompts = num_prompts
        canonical = json.dumps(
            {"task": "calculator", "version": TASK_VERSION, "num_prompts": num_prompts},
            sort_keys=True,
        )
        digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
        self.fingerprint = f"calculator-v{TASK_VERSION}-{digest}"

    @property
    def num_prompts(self) -> int:
        """Prompts in the dataset."""
        return self._num_prompts

    def prompt_text(self, index: int) -> str:
        """The question of prompt ``index``."""
        a, b = operands(index)
        return f"{a}+{b}"

    def prompt_token_ids(self, index: int) -> list[int]:
        """``<bos>`` then the question's tokens."""
        ids = [
            int(t) for t in self.tokenizer.encode(self.prompt_text(index), add_special_tokens=False)
        ]
        bos = self.tokenizer.bos_token_id
        return ids if bos is None else [int(bos), *ids]

    def reward(self, index: int, completion_token_ids: Sequence[int]) -> float:
        """0: a trajectory without an answer (the environment scores the answers)."""
        return 0.0


def reset_kwargs(index: int) -> dict[str, Any]:
    """``reset``'s keyword arguments for prompt ``index`` (the dataset row, as TRL)."""
    a, b = operands(index)
    return {"a": a, "b": b}
