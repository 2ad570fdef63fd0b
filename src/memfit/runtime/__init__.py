"""Running training: the trainer, OOM recovery, checkpoints."""
