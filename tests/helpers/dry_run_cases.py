"""The dry run against real tensors: every rank of a real gloo world measures its training step with
the same tracker, recording its routing; the dry run then replays that routing on fake tensors."""
from __future__ import annotations

from moe_dist.moe.routing.stand_in import RecordedRouting

CONFIG = "configs/tiny.yaml"
SMALL = ["model.n_layers=2", "train.global_batch=8", "train.seq_len=128", "model.vocab_size=4096",
         "train.dtype=fp32", "parallel.backend=gloo"]


def real_rank(rank: int, world: int, overrides: list) -> dict:
    """One rank's measurement on real tensors (``dry_run(..., fake=False)`` in the harness's group)."""
    from moe_dist.plan.dry_run import dry_run

    return dry_run(CONFIG, overrides, nodes=1, gpus_per_node=world, fake=False)


def replay(results: list) -> RecordedRouting:
    """Every layer forward's ``[rank][expert]`` routed pairs, from the ranks' ``routed_calls``."""
    calls = len(results[0]["routed_calls"])
    return RecordedRouting([[r["routed_calls"][i] for r in results] for i in range(calls)])
