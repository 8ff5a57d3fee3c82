"""A small GRPO trainer for a torch causal LM (the demo's policy; any HF-style causal LM works).

One :meth:`GRPOTrainer.train_step` is one optimizer step on one batch of samples:

- advantages are group-relative: ``A = (r - mean_g) / (std_g + eps)`` over the samples that
  share a ``group_id`` (population std; ``normalize_by_std=False`` keeps ``r - mean_g``), so a
  group whose siblings all scored the same contributes no gradient;
- a sample's ``loss_mask`` (multi-turn: tool and environment tokens 0) removes tokens
  from the loss and from the token count it is averaged over;
- the policy loss is the PPO clipped surrogate
  ``-mean_tokens(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A))`` with
  ``ratio = exp(new_logprob - old_logprob)``, ``old_logprob`` being what the generator
  reported (so a stale generator is corrected by the ratio and bounded by the clip), averaged
  over every completion token of the batch;
- optionally ``kl_coef * mean_tokens(k3)`` against a frozen copy of the initial policy;
- every sample is scored in one batched forward pass (right padding, an attention mask and
  explicit position ids), then AdamW with gradient-norm clipping.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from rolloutlog.controller.backends.base import SiblingResult

if TYPE_CHECKING:
    from rolloutlog.controller.rollout_runtime import RolloutSample


class GRPOConfig(BaseModel):
    """Hyper-parameters of :class:`GRPOTrainer` (defaults are tuned for the toy demo)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=5e-3, gt=0, description="AdamW learning rate.")
    betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    clip_eps: float = Field(default=0.2, gt=0, description="PPO ratio clip: [1-eps, 1+eps].")
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the k3 KL estimate against the initial policy (0 disables it "
        "and no reference copy is kept).",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient-norm clip.")
    normalize_by_std: bool = Field(
        default=True, description="Divide group-centred rewards by the group std (GRPO)."
    )
    adv_eps: float = Field(
        default=1e-6, gt=0, description="Added to the group std before dividing."
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="Sampling temperature of the generator; logits are divided by it so new "
        "logprobs are comparable with the generator's.",
    )
    seed: int = Field(default=0, ge=0, description="torch seed set when the trainer is built.")


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One completed sibling as the trainer sees it."""

    group_id: int
    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    old_logprobs: Sequence[float]
    reward: float
    #: Per completion token: 1 trained, 0 not (a multi-turn trajectory's tool and
    #: environment tokens: ``TrajectoryBackend.sample_masks``); None trains every token.
    loss_mask: Sequence[int] | None = None

    @classmethod
    def from_sibling(
        cls, result: SiblingResult, prompt_token_ids: Sequence[int], reward: float
    ) -> TrainSample:
        """The sample of one generated sibling (its tokens and the generator's logprobs)."""
        return cls(
            group_id=result.group_id,
            prompt_token_ids=tuple(prompt_token_ids),
            completion_token_ids=result.token_ids,
            old_logprobs=result.logprobs,
            reward=float(reward),
        )

    @classmethod
    def from_rollout(
        cls, sample: RolloutSample, loss_mask: Sequence[int] | None = None
    ) -> TrainSample:
        """The sample of one sibling of a durable batch (``RolloutRuntime.next_batch``),
        with its loss mask when it is a multi-turn trajectory."""
        return cls(
            sample.group_id,
            sample.prompt_token_ids,
            sample.completion_token_ids,
            sample.old_logprobs,
            sample.reward,
            None if loss_mask is None else tuple(int(m) for m in loss_mask),
        )


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one train step did (all floats are plain Python numbers)."""

    step: int
    loss: float
    mean_reward: float
    mean_advantage_abs: float
    tokens: int
    samples: int
    groups: int
    grad_norm: float
    clip_fraction: float
    kl: float


def group_advantages(
    group_ids: Sequence[int],
    rewards: Sequence[float],
    *,
    normalize_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages, one per sample (float64 for exactness in tests).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with the population std of the rewards sharing
    sample ``i``'s group id; a group with one sample or equal rewards gets ``A = 0``.
    """
    if len(group_ids) != len(rewards):
        raise ValueError(f"{len(group_ids)} group ids for {len(rewards)} rewards")
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError(f"non-finite reward in {list(rewards)}")
    adv = torch.zeros_like(r)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(i)
    for idx in members.values():
        sel = torch.tensor(idx)
        rg = r[sel]
        centred = rg - rg.mean()
        if normalize_by_std:
            centred = centred / (rg.std(unbiased=False) + eps)
        adv[sel] = centred
    return adv


def clipped_surrogate(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped policy loss averaged over masked tokens, and the clipped-token fraction.

    All tensors are ``[batch, tokens]`` (``advantages`` may be ``[batch, 1]``). A token
    counts as clipped when the clipped term is the active one (its gradient is zero).
    """
    mask = mask.to(new_logprobs.dtype)
    n = mask.sum().clamp_min(1.0)
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -(torch.minimum(unclipped, clipped) * mask).sum() / n
    with torch.no_grad():
        active = ((ratio > 1.0 + clip_eps) & (advantages > 0)) | (
            (ratio < 1.0 - clip_eps) & (advantages < 0)
        )
        clip_fraction = (active.to(mask.dtype) * mask).sum() / n
    return loss, clip_fraction


@dataclass(frozen=True, slots=True)
class _Batch:
    input_ids: torch.Tensor  # [B, L] right padded
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    target_ids: torch.Tensor  # [B, T] completion tokens, right padded
    gather_pos: torch.Tensor  # [B, T] position whose logits predict target t
    completion_mask: torch.Tensor  # [B, T]
    old_logprobs: torch.Tensor  # [B, T]


class GRPOTrainer:
    """GRPO on a causal LM whose ``forward(input_ids, attention_mask, position_ids)`` returns
    an object with ``.logits`` of shape ``[batch, seq, vocab]`` (e.g. ``LlamaForCausalLM``).

    The trainer owns the optimizer; :meth:`state_dict` / :meth:`load_state_dict` carry the
    weights, the optimizer state and the step count, so a restored trainer continues
    bit-for-bit like the original one.
    """

    def __init__(self, model: nn.Module, config: GRPOConfig, pad_token_id: int) -> None:
        self.config = config
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.step = 0
        torch.manual_seed(config.seed)
        self.device = next(model.parameters()).device
        self.ref_model: nn.Module | None = None
        if config.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval()
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )

    # ------------------------------------------------------------------ batching

    def _collate(self, samples: Sequence[TrainSample]) -> _Batch:
        rows: list[list[int]] = []
        prompt_lens: list[int] = []
        comp_lens: list[int] = []
        for i, s in enumerate(samples):
            p, c = list(s.prompt_token_ids), list(s.completion_token_ids)
            if not p:
                raise ValueError(f"sample {i} (group {s.group_id}) has an empty prompt")
            if not c:
                raise ValueError(f"sample {i} (group {s.group_id}) has an empty completion")
            if len(s.old_logprobs) != len(c):
                raise ValueError(
                    f"sample {i} (group {s.group_id}): {len(s.old_logprobs)} old logprobs for "
                    f"{len(c)} completion tokens"
                )
            if s.loss_mask is not None and len(s.loss_mask) != len(c):
                raise ValueError(
                    f"sample {i} (group {s.group_id}): a loss mask of {len(s.loss_mask)} for "
                    f"{len(c)} completion tokens"
                )
            rows.append(p + c)
            prompt_lens.append(len(p))
            comp_lens.append(len(c))
        bsz, seq, comp = len(rows), max(map(len, rows)), max(comp_lens)
        input_ids = torch.full((bsz, seq), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, seq), dtype=torch.long)
        target_ids = torch.full((bsz, comp), self.pad_token_id, dtype=torch.long)
        gather_pos = torch.zeros((bsz, comp), dtype=torch.long)
        completion_mask = torch.zeros((bsz, comp), dtype=torch.float32)
        old = torch.zeros((bsz, comp), dtype=torch.float32)
        for i, (row, pl, cl) in enumerate(zip(rows, prompt_lens, comp_lens, strict=True)):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
            target_ids[i, :cl] = torch.tensor(row[pl:], dtype=torch.long)
            gather_pos[i, :cl] = torch.arange(pl - 1, pl - 1 + cl)
            mask = samples[i].loss_mask
            if mask is None:
                completion_mask[i, :cl] = 1.0
            else:
                completion_mask[i, :cl] = torch.tensor([float(m) for m in mask])
            old[i, :cl] = torch.tensor([float(x) for x in samples[i].old_logprobs])
        # Right padding: real tokens sit at 0..len-1, so positions are a plain count of the
        # real tokens before each one (written out so left-padded callers would also be right).
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
        dev = self.device
        return _Batch(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask.to(dev),
            position_ids=position_ids.to(dev),
            target_ids=target_ids.to(dev),
            gather_pos=gather_pos.to(dev),
            completion_mask=completion_mask.to(dev),
            old_logprobs=old.to(dev),
        )

    def _token_logprobs(self, model: nn.Module, batch: _Batch) -> torch.Tensor:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
        logits = out.logits  # [B, L, V]
        idx = batch.gather_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        picked = torch.gather(logits, 1, idx).float() / self.config.temperature  # [B, T, V]
        logp = torch.log_softmax(picked, dim=-1)
        return torch.gather(logp, 2, batch.target_ids.unsqueeze(-1)).squeeze(-1)

    def completion_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Current-policy logprobs of each sample's completion tokens (one batched pass)."""
        if not samples:
            return []
        batch = self._collate(samples)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                lp = self._token_logprobs(self.model, batch)
        finally:
            self.model.train(was_training)
        return [lp[i, : len(s.completion_token_ids)].tolist() for i, s in enumerate(samples)]

    # ------------------------------------------------------------------ training

    def train_step(self, samples: Sequence[TrainSample]) -> StepStats:
        """One GRPO optimizer step on ``samples`` (typically whole groups)."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        cfg = self.config
        adv = group_advantages(
            [s.group_id for s in samples],
            [s.reward for s in samples],
            normalize_by_std=cfg.normalize_by_std,
            eps=cfg.adv_eps,
        )
        batch = self._collate(samples)
        adv_t = adv.to(torch.float32).to(self.device).unsqueeze(1)  # [B, 1]

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        new_lp = self._token_logprobs(self.model, batch)
        policy_loss, clip_fraction = clipped_surrogate(
            new_lp, batch.old_logprobs, adv_t, batch.completion_mask, cfg.clip_eps
        )
        loss = policy_loss
        kl_value = 0.0
        if self.ref_model is not None:
            with torch.no_grad():
                ref_lp = self._token_logprobs(self.ref_model, batch)
            diff = ref_lp - new_lp
            k3 = torch.exp(diff) - diff - 1.0
            n = batch.completion_mask.sum().clamp_min(1.0)
            kl = (k3 * batch.completion_mask).sum() / n
            loss = loss + cfg.kl_coef * kl
            kl_value = float(kl.detach())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], cfg.max_grad_norm
        )
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value) or not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"step {self.step + 1}: non-finite loss {loss_value} or grad norm "
                f"{float(grad_norm)}; the optimizer step was skipped"
            )
        self.optimizer.step()
        self.step += 1
        return StepStats(
            step=self.step,
            loss=loss_value,
            mean_reward=float(sum(s.reward for s in samples) / len(samples)),
            mean_advantage_abs=float(adv.abs().mean()),
            tokens=int(batch.completion_mask.sum()),
            samples=len(samples),
            groups=len({s.group_id for s in samples}),
            grad_norm=float(grad_norm),
            clip_fraction=float(clip_fraction),
            kl=kl_value,
        )

    # ------------------------------------------------------------------ weights and state

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Detached CPU copies of the model's parameters (to push to a backend).

        Each parameter appears once, under its first name: a tied weight (an output head
        sharing the input embedding, as in GPT-2) is not repeated under its second name,
        exactly like the safetensors checkpoint ``save_pretrained`` writes, so the names
        are the checkpoint's and a backend that checks names against it accepts them.
        """
        return [
            (name, p.detach().to("cpu", copy=True)) for name, p in self.model.named_parameters()
        ]

    def state_dict(self) -> dict[str, Any]:
        """Model weights, optimizer state, step count and config (live references, like
        ``torch``'s own ``state_dict``: serialise it, e.g. with ``torch.save``, to keep it)."""
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "config": self.config.model_dump(mode="json"),
        }
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], *, strict_config: bool = True) -> None:
        """Restore what :meth:`state_dict` produced.

        With ``strict_config`` (default) a checkpoint written under a different
        :class:`GRPOConfig` is refused, naming the fields that differ.
        """
        saved = state["config"]
        current = self.config.model_dump(mode="json")
        if strict_config and saved != current:
            diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
            raise ValueError(
                f"trainer checkpoint was written with a different GRPOConfig (fields {diff}); "
                "pass strict_config=False to load it anyway"
            )
        if ("ref_model" in state) != (self.ref_model is not None):
            raise ValueError("trainer checkpoint and trainer disagree on having a KL reference")
        self.model.load_state_dict(state["model"])
        if self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the current config's knobs win
            group["lr"] = self.config.lr
            group["betas"] = self.config.betas
            group["weight_decay"] = self.config.weight_decay
        self.step = int(state["step"])
