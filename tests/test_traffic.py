"""The bytes an MoE layer's exchanges send, intra-node and inter-node (moe_dist.moe.dispatch.traffic): on 4 gloo
ranks declared as 2 nodes of 2, the layer's count equals a hand count from every rank's routing (each
kept pair's destination rank and node, a row of d_model values each way, forward and backward), for
capacity and dropless, the pipelined loop kernel and the exchange-then-compute kernels, bf16 rows,
a forward-only call and a call recomputed by activation checkpointing; and the trainer writes the
step's sums to metrics.jsonl and their per-step means to summary.json."""
import json
import math
import os

import pytest
import torch
import torch.utils.checkpoint

from helpers.dist_harness import run_ranks
from moe_dist.config import load_config
from moe_dist.distributed.topology import NodeLayout
from moe_dist.moe.dispatch.traffic import COMBINE, COMBINE_GRAD, COUNTS, DISPATCH, DISPATCH_GRAD, KINDS, split_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, E, K, T = 16, 8, 2, 24  # d_model, experts, top-k, tokens per rank
NODE_OF = (0, 0, 1, 1)
CASES = {  # name: (capacity factor, expert kernel, dtype, mode)
    "dropless-loop": (None, "loop", torch.float32, "train"),
    "dropless-bmm": (None, "bmm", torch.float32, "train"),
    "capacity-loop": (1.0, "loop", torch.float32, "train"),
    "capacity-bmm": (1.0, "bmm", torch.float32, "train"),
    "dropless-loop-bf16": (None, "loop", torch.bfloat16, "train"),
    "capacity-loop-eval": (1.0, "loop", torch.float32, "eval"),
    "dropless-bmm-recompute": (None, "bmm", torch.float32, "recompute"),
    "capacity-loop-recompute": (1.0, "loop", torch.float32, "recompute"),
}


def test_split_bytes_by_node():
    nodes = NodeLayout((0, 0, 1, 1))
    assert split_bytes(nodes, 1, [3, 5, 7, 11], 10) == (30, 180)  # its own 5 rows stay; 3 to its node, 18 across
    assert split_bytes(nodes, 2, [1, 0, 4, 2], 8) == (16, 8)
    assert split_bytes(NodeLayout(), 0, [9], 4) == (0, 0)


def _layer_calls(rank, world):
    from moe_dist.distributed import build_parallel_groups
    from moe_dist.distributed.collectives import all_gather_tensor
    from moe_dist.moe import MoEArgs, MoELayer
    from moe_dist.parallel import apply_expert_parallel

    groups = build_parallel_groups(world, E, node_of=NODE_OF)
    out = {}
    for name, (cf, kernel, dtype, mode) in CASES.items():
        torch.manual_seed(0)
        layer = apply_expert_parallel(MoELayer(D, MoEArgs(num_experts=E, top_k=K, d_ff=24, capacity_factor=cf,
                                                          expert_kernel=kernel)), groups).to(dtype)
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(10 + rank)).to(dtype).requires_grad_(mode != "eval")
        if mode == "eval":
            layer.eval()
            with torch.no_grad():
                layer(x)
        else:
            y = (torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if mode == "recompute" else layer(x))
            (y.float() ** 2).sum().backward()
        traffic = layer.traffic.take()
        out[name] = {"by_kind": traffic.by_kind, "intra": traffic.intra, "inter": traffic.inter,
                     "expert_ids": all_gather_tensor(layer.last_routing.expert_ids, groups.dp),  # [ranks, T, k]
                     "after_take": layer.traffic.take().by_kind}
    return out


def _kept(expert_ids: torch.Tensor, cf) -> torch.Tensor:
    """Which pairs ``[ranks, T, k]`` the experts keep: all (dropless), or per expert the first
    ``ceil(cf * tokens * k / E)`` in rank-major token order (global capacity, position policy)."""
    if cf is None:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    cap = math.ceil(cf * expert_ids.shape[0] * expert_ids.shape[1] * K / E)
    seen, keep = [0] * E, torch.zeros_like(expert_ids, dtype=torch.bool)
    for idx in range(expert_ids.numel()):
        e = int(expert_ids.view(-1)[idx])
        keep.view(-1)[idx] = seen[e] < cap
        seen[e] += 1
    return keep


def _hand_count(expert_ids: torch.Tensor, cf, row: int, mode: str) -> list[dict]:
    """Per rank, ``{kind: [intra, inter]}`` bytes from the routing alone."""
    ranks, local = expert_ids.shape[0], E // expert_ids.shape[0]
    want = [{k: [0, 0] for k in KINDS} for _ in range(ranks)]
    keep = _kept(expert_ids, cf)
    forwards = 2 if mode == "recompute" else 1
    for src in range(ranks):
        for e in expert_ids[src][keep[src]].tolist():
            dst = e // local
            if dst == src:
                continue  # stays on its rank
            where = 0 if NODE_OF[dst] == NODE_OF[src] else 1
            want[src][DISPATCH][where] += forwards * row  # rows out
            want[dst][COMBINE][where] += forwards * row  # outputs back
            if mode != "eval":
                want[src][COMBINE_GRAD][where] += row  # output gradients out
                want[dst][DISPATCH_GRAD][where] += row  # row gradients back
        if cf is not None:  # the count exchange: E/ep int64 to each peer
            for peer in range(ranks):
                if peer != src:
                    want[src][COUNTS][0 if NODE_OF[peer] == NODE_OF[src] else 1] += forwards * local * 8
    return want


@pytest.fixture(scope="module")
def layer_calls():
    return run_ranks(_layer_calls, 4)


@pytest.mark.parametrize("name", list(CASES))
def test_layer_counts_equal_the_hand_count(layer_calls, name):
    cf, _, dtype, mode = CASES[name]
    ids = layer_calls[0][name]["expert_ids"]
    if cf is not None:
        assert not _kept(ids, cf).all()  # the capacity drops pairs: they are not sent
    want = _hand_count(ids, cf, D * torch.empty((), dtype=dtype).element_size(), mode)
    assert sum(v[1] for w in want for v in w.values()) > 0 and sum(v[0] for w in want for v in w.values()) > 0
    for rank, res in enumerate(layer_calls):
        assert torch.equal(res[name]["expert_ids"], ids)
        assert res[name]["by_kind"] == want[rank], f"rank {rank}"
        assert res[name]["intra"] == sum(v[0] for v in want[rank].values())
        assert res[name]["inter"] == sum(v[1] for v in want[rank].values())
        assert res[name]["after_take"] == {k: [0, 0] for k in KINDS}  # take() starts again from zero


def _train(rank, world, tmp):
    from moe_dist.train.loop.trainer import train

    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", "train.steps=3", "eval.every=0",
        "parallel.ep=4", "parallel.ranks_per_node=2", "train.grad_accum=2", "train.activation_checkpointing=true"])
    return train(cfg)


@pytest.mark.slow
def test_trainer_logs_the_step_bytes_and_their_means(tmp_path):
    summaries = run_ranks(_train, 4, args=(str(tmp_path),), timeout=300)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # 4 ranks in 2 nodes: each sends to 1 peer on its node and 2 across; with 2 micro-batches, a recomputed
        # forward and 2 MoE layers, every step sends something both ways
        assert isinstance(r["a2a_intra_bytes"], int) and isinstance(r["a2a_inter_bytes"], int)
        assert r["a2a_intra_bytes"] > 0 and r["a2a_inter_bytes"] > 0
        # every row of d_model=64 fp32 values; dropless: no count exchange
        assert r["a2a_intra_bytes"] % (64 * 4) == 0 and r["a2a_inter_bytes"] % (64 * 4) == 0
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["a2a_intra_bytes_per_step"] == pytest.approx(sum(r["a2a_intra_bytes"] for r in rows) / 3)
    assert summary["a2a_inter_bytes_per_step"] == pytest.approx(sum(r["a2a_inter_bytes"] for r in rows) / 3)
    assert all(s["a2a_inter_bytes_per_step"] == summary["a2a_inter_bytes_per_step"] for s in summaries)
