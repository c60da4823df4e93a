"""Training, grouped by concept: the loop (``loop/``: trainer, step, optimizer, compile, preemption,
health), what a run observes and reports (``observe/``: the metrics row, metrics.jsonl, tracking,
plots, step time, MFU), setting a run up (``setup/``: runtime, model, data, preflight, run lock),
evaluation (``evaluation/``), the engines (``engines/``) and the checkpoints (``checkpoint/``).

``Trainer`` and ``train`` are imported on first use, so ``import moe_dist.train`` does not pull in
the whole training stack.
"""

__all__ = ["Trainer", "train"]


def __getattr__(name):
    if name in __all__:
        from .loop import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
