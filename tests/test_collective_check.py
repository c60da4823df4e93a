"""Ranks of a dry-run world agree on every collective (moe_dist/plan/collective_check.py), and a plan
in which they do not is caught."""
from __future__ import annotations

from moe_dist.moe.routing.stand_in import Skewed
from moe_dist.plan.collective_check import check, check_world, sample_ranks

SMALL = ["model.n_layers=2", "train.seq_len=64", "eval.batch=16", "train.global_batch=32"]


def _a2a(group, out_splits, in_splits):
    return {"op": "alltoall_base_", "group": group, "numel": [sum(out_splits) * 4, sum(in_splits) * 4], "row": [4, 4],
            "out_splits": out_splits, "in_splits": in_splits}


def test_the_checker_reads_splits_sizes_and_order():
    g = (0, 1)
    agree = {0: [_a2a(g, [3, 5], [3, 2])], 1: [_a2a(g, [2, 4], [5, 4])]}
    assert check(agree) == []
    wrong = {0: [_a2a(g, [3, 5], [3, 2])], 1: [_a2a(g, [2, 4], [6, 4])]}
    assert any("rank 0 expects 5 rows from rank 1, which sends 6" in p for p in check(wrong))
    sizes = {0: [{"op": "allreduce_", "group": g, "numel": [8], "row": [1]}],
             1: [{"op": "allreduce_", "group": g, "numel": [9], "row": [1]}]}
    assert "sizes differ" in check(sizes)[0]
    fewer = {0: [{"op": "allreduce_", "group": g, "numel": [8], "row": [1]}], 1: []}
    assert "different numbers of collectives" in check(fewer)[0]
    assert sample_ranks(16, 4) == [0, 1, 2, 3, 4, 8, 12]


def test_every_rank_of_16_agrees_with_capacity_and_skew():
    """16 ranks (2 nodes x 8, ep=4, experts sharded over 4 replicas), a global capacity that keeps
    each rank's pairs by its position in the batch (so ranks send different row counts), skewed
    routing: every group's members agree."""
    result = check_world("configs/tiny.yaml", SMALL + ["parallel.ep=4", "model.moe.capacity_factor=1.0"], nodes=2,
                         gpus_per_node=8, ranks=list(range(16)), routing="skew:2", steps=1, log=lambda _: None)
    assert result["problems"] == [] and len(result["collectives_per_rank"]) == 16
    assert len(set(result["collectives_per_rank"].values())) == 1


class _SeenFromRankZero(Skewed):
    """A faulty plan: each rank believes every peer routes as it does itself, but the ranks route
    differently (rank 0 skewed, the others balanced)."""

    def shares(self, layer_idx, num_experts):
        return super().shares(layer_idx, num_experts) if self.rank == 0 else [1.0] * num_experts

    def routed(self, call):
        self.rank = call.rank
        return super().routed(call)


def test_a_plan_that_only_rank_zero_sees_is_caught():
    result = check_world("configs/tiny.yaml", SMALL + ["parallel.ep=4"], nodes=1, gpus_per_node=8, ranks=list(range(4)),
                         routing=_SeenFromRankZero(4.0), steps=1, log=lambda _: None)
    assert result["problems"] and any("expects" in p for p in result["problems"])
