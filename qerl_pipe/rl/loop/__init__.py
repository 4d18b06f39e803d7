"""Running the RL method: the trainer, its config, data order, checkpoints, metrics, data-parallel ranks."""
