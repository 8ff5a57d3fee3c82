"""The GRPO demo: toy task, tiny model, trainer, training loop and the demo's worker
(needs the ``[torch]`` extra)."""
