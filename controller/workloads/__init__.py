"""Real workloads: prompts from a local dataset file, rewards, passes over the data.

Light to import: ``datasets`` is imported only when a dataset file is read.
"""

from rolloutlog.controller.workloads.dataset import (
    DatasetConfig,
    DatasetError,
    DatasetStats,
    PromptDataset,
)
from rolloutlog.controller.workloads.passes import PromptKey, pass_permutation, pass_seed, prompt_at
from rolloutlog.controller.workloads.rewards import (
    BUILTIN_REWARDS,
    Reward,
    RewardConfig,
    RewardFailedError,
    RewardResult,
)

__all__ = [
    "BUILTIN_REWARDS",
    "DatasetConfig",
    "DatasetError",
    "DatasetStats",
    "PromptDataset",
    "PromptKey",
    "Reward",
    "RewardConfig",
    "RewardFailedError",
    "RewardResult",
    "pass_permutation",
    "pass_seed",
    "prompt_at",
]
