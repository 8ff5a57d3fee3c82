"""Rewards for real workloads: built-in verifiable rewards and user functions.

A reward function has the signature ``fn(completion, answer, example, **params) -> float``:
``completion`` is the decoded completion text (before the first eos, special tokens
dropped), ``answer`` the example's answer field (``None`` without one), ``example`` the
whole dataset row (a dict) and ``params`` the config's ``reward.params``.

Built-ins (``reward.name``):

- ``exact_match``: 1.0 when the completion's final answer equals the answer after
  normalisation (case, surrounding whitespace and punctuation, inner whitespace runs,
  thousands separators), else 0.0. Params: ``extract`` (``"auto"``: the text after the
  last ``####`` if there is one, else the whole text; ``"first_word"``; ``"full"``).
- ``numeric``: 1.0 when the completion's number is within ``tolerance`` (absolute,
  default 1e-6; ``relative: true`` makes it relative) of the answer's number. The
  answer's number is the text after its ``####`` (GSM8K) or its last number; the
  completion's is the number after its last ``####``, else its last number (``extract:
  "first"`` takes the first number instead). No number scores 0.0.
- ``gsm8k``: ``numeric`` with GSM8K's ``#### 42`` convention (the same defaults).

Anything else must be ``package.module:function`` naming an importable function.

A reward that raises (or returns something that is not a finite number) is a
:class:`RewardResult` with ``error`` set; :class:`RewardConfig.on_error` says what the
run does with it: ``drop_group`` fails the sibling without retry (a ``SiblingFailed``
event with ``cause="reward"`` carrying the message; the group is dropped and the drop
policy fills its slot) and ``zero`` scores the sample 0.0 and counts it. Either way the
run goes on, until failures pass ``max_failure_fraction``: then it stops.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rolloutlog.controller.rollout_runtime import RunStoppedError
from rolloutlog.eventstore.errors import RolloutlogError

RewardFn = Callable[..., float]
OnError = Literal["drop_group", "zero"]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_STRIP = " \t\n\r.,;:!?\"'`()[]{}"


class RewardConfig(BaseModel):
    """Which reward scores completions, its parameters and what a failing reward does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        "exact_match",
        min_length=1,
        description="A built-in reward (exact_match, numeric, gsm8k) or a user function "
        "as package.module:function.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the reward function."
    )
    on_error: OnError = Field(
        "drop_group",
        description="A reward that raises: drop_group fails the sibling without retry (its "
        "group is dropped, the message is in the SiblingFailed event); zero scores the "
        "sample 0.0 and counts it.",
    )
    max_failure_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Stop the run (non-zero exit, naming the reward and its first error) "
        "at a reward failure once a step's worth of completions has been scored and more "
        "than this fraction of them failed, or all of them did (1.0: only then). Not part "
        "of the dataset fingerprint.",
    )

    @field_validator("name")
    @classmethod
    def _known_or_importable_name(cls, value: str) -> str:
        if value in BUILTIN_REWARDS:
            return value
        module, sep, func = value.partition(":")
        if not sep or not module or not func or ":" in func:
            raise ValueError(
                f"reward {value!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
                "nor package.module:function"
            )
        return value


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The outcome of scoring one completion: a finite ``value`` or an ``error`` message."""

    value: float | None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the reward raised or returned something unusable."""
        return self.error is not None


class RewardFailedError(RolloutlogError):
    """Raised (under ``on_error: drop_group``) for a completion whose reward failed."""


class RewardFailureLimitError(RunStoppedError):
    """Raised for a completion whose reward failed when reward failures are past
    ``reward.max_failure_fraction``: the run stops (the message names the reward, the
    counts and the first error)."""


def final_answer(text: str) -> str:
    """The text after the last ``####`` (GSM8K convention), else the whole text."""
    return text.rsplit("####", 1)[1] if "####" in text else text


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, strip surrounding punctuation, drop thousands commas."""
    text = " ".join(text.lower().split()).strip(_STRIP)
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


def _to_number(token: str) -> float | None:
    try:
        return float(token.replace(",", ""))
    except ValueError:
        return None


def extract_number(text: str, *, which: Literal["auto", "first", "last"] = "auto") -> float | None:
    """A number from ``text``: after the last ``####`` if any (auto), else its last
    (``auto``/``last``) or first number; ``None`` when there is none."""
    if which == "auto" and "####" in text:
        found = _NUMBER.findall(final_answer(text))
        return _to_number(found[0]) if found else None
    found = _NUMBER.findall(text)
    if not found:
        return None
    return _to_number(found[0] if which == "first" else found[-1])


def exact_match(
    completion: str,
    answer: str | None,
    example: Mapping[str, Any] | None = None,
    *,
    extract: Literal["auto", "first_word", "full"] = "auto",
) -> float:
    """1.0 when the completion's final answer equals ``answer`` after normalisation."""
    if answer is None:
        raise ValueError("exact_match needs an answer (set dataset.answer_field)")
    if extract == "auto":
        got = final_answer(completion)
    elif extract == "first_word":
        words = completion.split()
        got = words[0] if words else ""
    else:
        got = completion
    return 1.0 if normalize_answer(got) == normalize_answer(final_answer(str(answer))) else 0.0


def numeric(
    completion: str,
    answer: str | None,
    example: Mapping[str, Any] | None = None,
    *,
    tolerance: float = 1e-6,
    relative: bool = False,
    extract: Literal["auto", "first", "last"] = "auto",
) -> float:
    """1.0 when the completion's number is within ``tolerance`` of the answer's number."""
    if answer is None:
        raise ValueError("numeric needs an answer (set dataset.answer_field)")
    want = extract_number(str(answer), which="auto")
    if want is None:
        raise ValueError(f"answer {answer!r} holds no number")
    got = extract_number(completion, which=extract)
    if got is None:
        return 0.0
    bound = tolerance * abs(want) if relative else tolerance
    return 1.0 if abs(got - want) <= bound else 0.0


#: The built-in rewards by config name.
BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "gsm8k": numeric,
}


def resolve_reward(name: str) -> RewardFn:
    """The function a config's ``reward.name`` designates (built-in or imported).

    Raises :class:`ValueError` with the reason when a ``module:function`` cannot be
    imported, has no such attribute, or is not callable.
    """
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {name!r}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {name!r}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {attr!r} is not callable")
    return fn  # type: ignore[no-any-return]


class Reward:
    """A configured reward: resolves the function once and scores completions safely."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.fn = resolve_reward(config.name)
        try:  # bad params are a config error, found before the run starts
            inspect.signature(self.fn).bind("", None, {}, **config.params)
        except TypeError as exc:
            raise ValueError(f"reward {config.name!r}: params {config.params}: {exc}") from exc
        except ValueError:  # no signature (a builtin): checked at the first call
            pass

    def score(
        self, completion: str, answer: str | None, example: Mapping[str, Any]
    ) -> RewardResult:
        """Score one completion; never raises (a failure is a result with ``error``)."""
        try:
            value = self.fn(completion, answer, dict(example), **self.config.params)
        except Exception as exc:  # any user error is this sample's failure, not the run's
            why = f"reward {self.config.name} raised {type(exc).__name__}: {exc}"
            return RewardResult(None, why)
        if not isinstance(value, int | float):  # bool is an int: True/False score 1/0
            return RewardResult(
                None, f"reward {self.config.name} returned {type(value).__name__}, not a number"
            )
        if not math.isfinite(float(value)):
            return RewardResult(None, f"reward {self.config.name} returned {value}")
        return RewardResult(float(value))


__all__ = [
    "BUILTIN_REWARDS",
    "OnError",
    "Reward",
    "RewardConfig",
    "RewardFailedError",
    "RewardFailureLimitError",
    "RewardFn",
    "RewardResult",
    "exact_match",
    "extract_number",
    "final_answer",
    "normalize_answer",
    "numeric",
    "resolve_reward",
]
