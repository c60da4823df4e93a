"""Training: the loop, parallelism applied to the model, optimizer, checkpoints, metrics, plots."""
from .trainer import Trainer, train

__all__ = ["Trainer", "train"]
