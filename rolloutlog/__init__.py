"""rolloutlog: an event-sourced rollout log for asynchronous RL post-training."""
