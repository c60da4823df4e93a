"""Training: the loop, parallelism applied to the model, optimizer, checkpoints, metrics, plots.

``Trainer`` and ``train`` are imported on first use, so command-line modules in this package
load without pulling in the whole training stack.
"""

__all__ = ["Trainer", "train"]


def __getattr__(name):
    if name in __all__:
        from .loop import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
