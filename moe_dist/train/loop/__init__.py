"""The training loop: the trainer, one optimizer step, the optimizer and its schedule, compilation,
preemption and the run's health (bad steps, divergence, rollback)."""
