"""The CPU tree attention of the tests against plain SDPA (and against TRL's own wrapper).

The reference implementation (``tests/integrations/trl_cpu.py``) stands in for TRL's
FA3 varlen kernel on CPU, so it must compute exactly what plain causal attention
computes over each sample: on packed chains (no sharing), on TRL's own trie layouts
(``packing.TreeRow.pack`` of samples sharing prompts), inside the tiny Llama, and through
TRL's ``tree_attention`` wrapper with the kernel swapped for it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rolloutlog.integrations.trl import cpu as trl_cpu

pytestmark = pytest.mark.usefixtures("trl_on_cpu")


def _qkv(n: int, heads: int, kv_heads: int, dim: int = 8, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(n, kv_heads, dim, generator=g)
    v = torch.randn(n, kv_heads, dim, generator=g)
    return q, k, v


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal SDPA of one sequence, ``(n, H, D)`` in and out (GQA expanded)."""
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(rep, dim=0),
        v.transpose(0, 1).repeat_interleave(rep, dim=0),
        is_causal=True,
    )
    return out.transpose(0, 1)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[1], [9], [3, 1, 5], [1, 1, 1, 1], [16, 2, 7]])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_packed_chains_match_causal_sdpa_per_sample(
    lengths: list[int], heads: int, kv_heads: int
) -> None:
    n = sum(lengths)
    q, k, v = _qkv(n, heads, kv_heads, seed=n * 31 + heads)
    cu = _cu(lengths)
    out = trl_cpu.varlen_attention(q, k, v, cu, cu)
    assert out.shape == q.shape
    for s in range(len(lengths)):
        a, b = int(cu[s]), int(cu[s + 1])
        torch.testing.assert_close(out[a:b], _causal_sdpa(q[a:b], k[a:b], v[a:b]))
    # A wrong segmentation gives a different answer (the check can fail).
    if len(lengths) > 1:
        whole = trl_cpu.varlen_attention(q, k, v, _cu([n]), _cu([n]))
        assert not torch.allclose(whole, out)


def _random_samples(rng: random.Random, groups: int, per_group: int) -> list[dict[str, Any]]:
    """Samples the way TRL packs them: groups share a prompt (and all a system prefix)."""
    system = [rng.randrange(4, 50) for _ in range(rng.randint(0, 3))]
    samples = []
    for g in range(groups):
        prompt = system + [rng.randrange(4, 50) for _ in range(rng.randint(1, 6))]
        for _ in range(per_group):
            completion = [rng.randrange(4, 50) for _ in range(rng.randint(1, 6))]
            # Sometimes a completion repeats a sibling's start, so the trie forks later.
            if samples and samples[-1]["group_id"] == g and rng.random() < 0.5:
                prev = samples[-1]["input_ids"].tolist()[len(prompt) :]
                completion = prev[: rng.randint(1, len(prev))] + completion
            ids = prompt + completion
            samples.append(
                {
                    "input_ids": torch.tensor(ids),
                    "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion)),
                    "old_log_probs": torch.zeros(len(ids)),
                    "advantage": 0.0,
                    "group_id": g,
                }
            )
    return samples


def _pack(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row.pack()


def _segments(packed: dict[str, torch.Tensor]) -> list[tuple[int, int, list[int]]]:
    """``(first query, end query, kv path)`` of every segment of a packed row."""
    cu_q, cu_k = packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist()
    kv = packed["tree_kv_index"].tolist()
    return [(cu_q[s], cu_q[s + 1], kv[cu_k[s] : cu_k[s + 1]]) for s in range(len(cu_q) - 1)]


@pytest.mark.parametrize("seed", range(6))
def test_trie_layouts_match_causal_sdpa_over_each_path(seed: int) -> None:
    rng = random.Random(seed)
    packed = _pack(_random_samples(rng, groups=rng.randint(1, 3), per_group=rng.randint(1, 4)))
    n = len(packed["input_ids"])
    q, k, v = _qkv(n, 4, 2, seed=seed)
    idx = packed["tree_kv_index"]
    out = trl_cpu.varlen_attention(
        q,
        k.index_select(0, idx),
        v.index_select(0, idx),
        packed["tree_cu_seqlens_q"],
        packed["tree_cu_seqlens_k"],
    )
    segments = _segments(packed)
    assert len(segments) >= 1
    for a, b, path in segments:
        # The segment is the tail of its root-to-segment path.
        assert path[-(b - a) :] == list(range(a, b))
        p = torch.tensor(path)
        ref = _causal_sdpa(q[p], k[p], v[p])[-(b - a) :]
        torch.testing.assert_close(out[a:b], ref)


def _explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Softmax attention written out, bottom-right causal, optional sliding window."""
    n_q, n_k = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    i = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
    j = torch.arange(n_k).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 1, 3])
def test_short_queries_align_bottom_right_with_sliding_window(window: int | None) -> None:
    # Two segments whose queries are the last 2 and 3 of 6 and 4 keys.
    q, _, _ = _qkv(5, 2, 1, seed=7)
    _, k, v = _qkv(10, 2, 1, seed=8)
    cu_q, cu_k = _cu([2, 3]), _cu([6, 4])
    out = trl_cpu.varlen_attention(q, k, v, cu_q, cu_k, sliding_window=window)
    torch.testing.assert_close(out[:2], _explicit_attention(q[:2], k[:6], v[:6], window))
    torch.testing.assert_close(out[2:], _explicit_attention(q[2:], k[6:], v[6:], window))


def test_bad_segments_are_refused() -> None:
    q, k, v = _qkv(4, 2, 2)
    with pytest.raises(ValueError, match="segments cover"):
        trl_cpu.varlen_attention(q, k, v, _cu([3]), _cu([3]))
    with pytest.raises(ValueError, match="queries but only"):
        trl_cpu.varlen_attention(q, k[:2], v[:2], _cu([4]), _cu([2]))
    with pytest.raises(ValueError, match="not a multiple"):
        trl_cpu.varlen_attention(torch.randn(4, 3, 8), k, v, _cu([4]), _cu([4]))


def test_same_output_as_trl_tree_attention_given_a_reference_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TRL's ``tree_attention`` (its layout handling) with its kernel call answered by
    :func:`trl_cpu.varlen_attention` gives what the registered CPU function gives."""
    from trl.experimental.async_grpo import packing

    calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
        cu_k: torch.Tensor, max_q: int, max_k: int, *, softmax_scale: float | None,
        causal: bool, window_size: tuple[int, int], **kwargs: Any,
    ) -> torch.Tensor:  # fmt: skip
        calls.append({"causal": causal, "window_size": window_size, "max": (max_q, max_k)})
        window = None if window_size == (-1, -1) else window_size[0] + 1
        return trl_cpu.varlen_attention(
            q, k, v, cu_q, cu_k, scale=softmax_scale, sliding_window=window
        )

    kernel = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    monkeypatch.setattr(packing, "_flash_attn", lambda: kernel)
    packed = _pack(_random_samples(random.Random(3), groups=2, per_group=3))
    n = len(packed["input_ids"])
    q, k, v = _qkv(n, 4, 2, seed=3)
    # transformers' layout: (batch 1, heads, tokens, dim).
    query, key, value = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    # TRL reads the target dtype off the module's config and its first Linear.
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    module.config = SimpleNamespace()  # type: ignore[assignment]
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    kwargs = {
        "tree_kv_index": packed["tree_kv_index"],
        "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
        "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"],
        "tree_max_seqlen_q": max_q,
        "tree_max_seqlen_k": max_k,
        "scaling": 0.3,
    }
    theirs, _ = packing.tree_attention(module, query, key, value, None, **kwargs)
    ours, none = trl_cpu.cpu_tree_attention(module, query, key, value, None, **kwargs)
    assert none is None
    assert calls == [{"causal": True, "window_size": (-1, -1), "max": (max_q, max_k)}]
    assert ours.shape == (1, n, 4, 8)
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(NotImplementedError, match="softcap"):
        trl_cpu.cpu_tree_attention(module, query, key, value, None, softcap=30.0, **kwargs)


def test_tiny_llama_packed_rows_equal_per_sample_sdpa(trl_tiny_model: Path) -> None:
    """The whole tiny Llama on a packed trie row (TRL's inputs: ``position_ids`` and the
    ``tree_*`` kwargs) gives each sample the logits plain SDPA gives it alone."""
    from transformers import AutoModelForCausalLM

    packed_model = AutoModelForCausalLM.from_pretrained(
        trl_tiny_model, attn_implementation=trl_cpu.TREE_ATTENTION
    ).eval()
    plain_model = AutoModelForCausalLM.from_pretrained(
        trl_tiny_model, attn_implementation="sdpa"
    ).eval()
    assert packed_model.config._attn_implementation == trl_cpu.TREE_ATTENTION
    samples = _random_samples(random.Random(11), groups=2, per_group=3)
    packed = _pack(samples)
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    with torch.no_grad():
        logits = packed_model(
            input_ids=packed["input_ids"].unsqueeze(0),
            position_ids=packed["position_ids"].unsqueeze(0),
            tree_kv_index=packed["tree_kv_index"],
            tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=max_q,
            tree_max_seqlen_k=max_k,
        ).logits[0]
        paths = {
            tuple(packed["input_ids"][path].tolist()): path for _, _, path in _segments(packed)
        }
        for sample in samples:
            ids = sample["input_ids"]
            path = paths[tuple(ids.tolist())]
            alone = plain_model(input_ids=ids.unsqueeze(0)).logits[0]
            torch.testing.assert_close(logits[path], alone, rtol=1e-4, atol=1e-4)
    # The packed row is shorter than the samples laid end to end: prefixes were shared.
    assert len(packed["input_ids"]) < sum(len(s["input_ids"]) for s in samples)
