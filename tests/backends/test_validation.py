"""The contract checks themselves, on hand-made results and weights (no backend)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rolloutlog.controller.backends import (
    BackendError,
    GroupRequest,
    MalformedResultError,
    SamplingConfig,
    SiblingResult,
    SiblingSpec,
    validate_results,
    validate_weight_update,
)

VOCAB = 10
REQUEST = GroupRequest(
    group_id=3,
    prompt_token_ids=(1, 2, 3),
    siblings=(SiblingSpec(0, 0), SiblingSpec(2, 1)),
    sampling=SamplingConfig(max_tokens=4),
)


def good() -> list[SiblingResult]:
    return [
        SiblingResult(3, 0, 0, 5, (4, 5, 6), (-0.1, -2.0, -0.0), "stop"),
        SiblingResult(3, 2, 1, 5, (9, 0, 1, 2), (-1.0, -1.0, -1.0, -1.0), "length"),
    ]


def test_good_results_pass() -> None:
    assert validate_results(REQUEST, good(), VOCAB) == good()


def _first(**changes: object) -> list[SiblingResult]:
    results = good()
    return [replace(results[0], **changes), results[1]]  # type: ignore[arg-type]


BAD_RESULTS = {
    "too_few": (good()[:1], "asked for 2 siblings, backend returned 1"),
    "too_many": ([*good(), good()[0]], "asked for 2 siblings, backend returned 3"),
    "swapped_order": (good()[::-1], "is labelled"),
    "wrong_group": (_first(group_id=4), "is labelled group 4"),
    "stale_attempt": ([good()[0], replace(good()[1], attempt=0)], "attempt 0"),
    "no_tokens": (_first(token_ids=(), logprobs=()), "no tokens generated"),
    "over_max_tokens": (_first(token_ids=(1,) * 5, logprobs=(-1.0,) * 5), "exceed max_tokens"),
    "id_at_vocab": (_first(token_ids=(4, 10, 6)), "token id 10 outside"),
    "negative_id": (_first(token_ids=(4, -1, 6)), "token id -1 outside"),
    "float_id": (_first(token_ids=(4, 5.0, 6)), "token id 5.0 outside"),
    "bool_id": (_first(token_ids=(4, True, 6)), "token id True outside"),
    "short_logprobs": (_first(logprobs=(-0.1, -2.0)), "2 logprobs for 3 tokens"),
    "long_logprobs": (_first(logprobs=(-0.1, -2.0, -1.0, -1.0)), "4 logprobs for 3 tokens"),
    "positive_logprob": (_first(logprobs=(-0.1, 0.5, -1.0)), "logprob 0.5"),
    "nan_logprob": (_first(logprobs=(-0.1, float("nan"), -1.0)), "logprob nan"),
    "minus_inf_logprob": (_first(logprobs=(-0.1, float("-inf"), -1.0)), "logprob -inf"),
    "int_logprob": (_first(logprobs=(-0.1, -2, -1.0)), "logprob -2"),
    "finish_abort": (_first(finish_reason="abort"), "unknown finish_reason 'abort'"),
    "negative_version": (_first(weight_version=-1), "negative weight version"),
}


@pytest.mark.parametrize("case", sorted(BAD_RESULTS))
def test_malformed_results_are_rejected(case: str) -> None:
    results, message = BAD_RESULTS[case]
    with pytest.raises(MalformedResultError, match=message.replace("(", r"\(")) as raised:
        validate_results(REQUEST, results, VOCAB)
    assert raised.value.retryable is False


SHAPES = {"a.weight": (2, 3), "b.weight": (3,), "tied.weight": (2, 3)}


def weights(**overrides: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    base = {"a.weight": torch.ones(2, 3), "b.weight": torch.zeros(3)}
    base.update(overrides)  # type: ignore[arg-type]
    return [(name, t) for name, t in base.items() if t is not None]


def test_good_weights_pass() -> None:
    out = validate_weight_update(weights(), 1, SHAPES, required={"a.weight", "b.weight"})
    assert sorted(out) == ["a.weight", "b.weight"]
    # Optional names (a tied alias) may be given too; without a shape table any name goes.
    validate_weight_update(weights(**{"tied.weight": torch.ones(2, 3)}), 1, SHAPES, SHAPES)
    validate_weight_update([("anything", torch.ones(1))], 0, None)


@pytest.mark.parametrize(
    ("named", "version", "message"),
    [
        (weights(), -1, "weight version -1"),
        (weights(), True, "weight version True"),
        (weights(), 1.0, "weight version 1.0"),
        ([], 1, "no tensors"),
        (weights(**{"c.weight": torch.ones(1)}), 1, "unknown weight names \\['c.weight'\\]"),
        (weights(**{"b.weight": None}), 1, "missing weight names \\['b.weight'\\]"),
        (weights(**{"b.weight": torch.zeros(4)}), 1, "has shape \\(4,\\), expected \\(3,\\)"),
        ([*weights(), ("a.weight", torch.ones(2, 3))], 1, "given twice"),
        (weights(**{"b.weight": torch.tensor([0.0, float("inf"), 0.0])}), 1, "finite"),
        (weights(**{"b.weight": torch.zeros(3, dtype=torch.long)}), 1, "floating-point"),
        ([("a.weight", [[1.0] * 3] * 2)], 1, "must be \\(str, torch.Tensor\\) pairs"),
    ],
)
def test_bad_weights_are_rejected(named: list, version: object, message: str) -> None:
    with pytest.raises(BackendError, match=message) as raised:
        validate_weight_update(named, version, SHAPES, required={"a.weight", "b.weight"})  # type: ignore[arg-type]
    assert raised.value.retryable is False
