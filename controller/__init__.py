"""The rollout domain: events, the pure state machine, samplers, invariants, restore,
projections, the async runtime, generation backends, the training-loop API and the CLI."""
