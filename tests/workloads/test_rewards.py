"""Built-in verifiable rewards, user reward functions named ``module:function``, and the
failure result of a reward that raises."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from rolloutlog.controller.workloads.rewards import (
    Reward,
    RewardConfig,
    exact_match,
    extract_number,
    normalize_answer,
    numeric,
)


def test_exact_match_normalises_case_space_and_punctuation() -> None:
    assert exact_match("  The Answer  is 42. ", "the answer is 42") == 1.0
    assert exact_match("Paris!", "paris") == 1.0
    assert exact_match("1,234", "1234") == 1.0
    assert exact_match("paris london", "paris") == 0.0
    assert exact_match("paris london", "paris", extract="first_word") == 1.0
    assert normalize_answer(" A  b\n") == "a b"


def test_gsm8k_final_answer_is_taken_after_the_marker() -> None:
    solution = "she has 3 + 4 = 7 apples\n#### 7"
    assert exact_match("reasoning... #### 7", solution) == 1.0
    assert numeric("so 3 + 4 = 7.\n#### 7", solution) == 1.0
    assert numeric("3 + 4 makes 8\n#### 8", solution) == 0.0
    assert extract_number("a 1 b 2 #### -3.5 c") == -3.5
    assert extract_number("no number here") is None


def test_numeric_tolerance_absolute_and_relative() -> None:
    assert numeric("the result is 3.14159", "3.1416", tolerance=1e-3) == 1.0
    assert numeric("the result is 3.2", "3.1416", tolerance=1e-3) == 0.0
    assert numeric("1010", "1000", tolerance=0.02, relative=True) == 1.0
    assert numeric("7 then 9", "7", extract="first") == 1.0
    assert numeric("7 then 9", "7") == 0.0  # auto: the last number
    assert numeric("no digits", "7") == 0.0


def test_user_function_by_module_path(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "my_rewards_mod.py").write_text(
        "def contains(completion, answer, example, *, bonus=0.0):\n"
        "    return float(answer in completion) + bonus\n"
        "def boom(completion, answer, example):\n"
        "    raise RuntimeError('judge offline')\n"
        "def text(completion, answer, example):\n"
        "    return 'yes'\n"
        "def nan(completion, answer, example):\n"
        "    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = Reward(RewardConfig(name="my_rewards_mod:contains", params={"bonus": 0.5}))
    assert reward.score("it is 42", "42", {}).value == 1.5
    failed = Reward(RewardConfig(name="my_rewards_mod:boom")).score("x", "1", {})
    assert failed.failed and failed.value is None
    assert "RuntimeError: judge offline" in (failed.error or "")
    assert Reward(RewardConfig(name="my_rewards_mod:text")).score("x", "1", {}).failed
    assert Reward(RewardConfig(name="my_rewards_mod:nan")).score("x", "1", {}).failed
    with pytest.raises(ValueError, match="params"):
        Reward(RewardConfig(name="my_rewards_mod:contains", params={"nope": 1}))
    with pytest.raises(ValueError, match="has no 'missing'"):
        Reward(RewardConfig(name="my_rewards_mod:missing"))
    with pytest.raises(ValueError, match="cannot import"):
        Reward(RewardConfig(name="no_such_module_xyz:f"))


def test_reward_name_must_be_builtin_or_module_function() -> None:
    with pytest.raises(ValidationError, match="neither a built-in"):
        RewardConfig(name="exactmatch")
    with pytest.raises(ValidationError):
        RewardConfig(on_error="ignore")  # type: ignore[arg-type]
    assert RewardConfig(name="gsm8k").on_error == "drop_group"


def test_builtin_without_answer_is_a_failure_not_a_crash() -> None:
    result = Reward(RewardConfig(name="numeric")).score("7", None, {})
    assert result.failed and "needs an answer" in (result.error or "")
    assert math.isfinite(Reward(RewardConfig(name="numeric")).score("7", "7", {}).value or 0)
