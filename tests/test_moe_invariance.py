"""Expert-parallel invariance: R gloo ranks on slices of a batch compute what one process
computes on the whole batch (outputs, losses, gradients, counts)."""
import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.moe_cases import check_against_reference, distributed_case, reference

CASES = {
    "topk-dropless": dict(router="topk"),
    "topk-top1-switch": dict(router="topk", top_k=1, capacity_factor=1.25),
    "xmoe-probs-cap": dict(router="xmoe", capacity_factor=1.0, drop_policy="probs"),
    "topk-position-cap": dict(router="topk", capacity_factor=0.75, drop_policy="position"),
    "noisy-gelu": dict(router="noisy_topk", activation="gelu", router_options={"init_std": 0.5}),
    # rows arrive from the peers per (source, expert) segment: the loop kernel (above) runs them in
    # place, the others group them first
    "topk-grouped-mm": dict(router="topk", expert_kernel="grouped_mm"),
}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_layer_invariance(world, ep):
    tokens = 96
    # one spawn per (world, ep) runs every case: process start-up dominates on 2 cores
    results = run_ranks(_all_cases, world, args=(CASES, tokens, ep))
    for name, cfg in CASES.items():
        ref = reference(cfg, tokens)
        for uneven in (False, True):
            check_against_reference(ref, [r[(name, uneven)] for r in results], tokens)


def _all_cases(rank, world, cases, tokens, ep):
    return {(name, uneven): distributed_case(rank, world, cfg, tokens, ep, uneven)
            for name, cfg in cases.items() for uneven in (False, True)}
