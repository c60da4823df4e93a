"""Hierarchical (node-aware) dispatch against the flat one, on 4 real gloo ranks declared as 2 nodes
of 2: outputs, input gradients and router gradients bit-identical, expert weight gradients equal to
rounding, the rows that cross nodes fewer by exactly the flat dispatch's duplication; the same
results as one process (layout invariance); the fallbacks to the flat dispatch."""
import dataclasses
import torch

from helpers.dist_harness import run_ranks
from helpers.host_sync import count_host_syncs
from helpers.moe_cases import D_MODEL, check_against_reference, collect, make_batch, make_layer, reference, split_sizes, step
from moe_dist.distributed import build_parallel_groups
from moe_dist.distributed.topology import NodeLayout
from moe_dist.moe.dispatch.hierarchical import dispatch_note, hierarchical_fallback
from moe_dist.moe.dispatch.traffic import COMBINE, DISPATCH
from moe_dist.parallel import apply_expert_parallel, sync_gradients

TOKENS = 96
NODES = [0, 0, 1, 1]

EMPTY_RANK = [40, 30, 26, 0]  # rank 3 has no tokens (it still computes other ranks' rows, and returns them)

# (name, layer config[, tokens per rank]): k = 2 and 4, capacity with both drop policies and dropless,
# a shared expert, the loop kernel (overlapped exchange) and bmm, a rank without tokens
CASES = [
    ("k2 dropless loop", dict(top_k=2)),
    ("k4 dropless loop, empty rank", dict(top_k=4), EMPTY_RANK),
    ("k4 dropless loop", dict(top_k=4)),
    ("k4 dropless bmm", dict(top_k=4, expert_kernel="bmm")),
    ("k4 capacity position", dict(top_k=4, capacity_factor=1.0, drop_policy="position")),
    ("k3 capacity probs bmm", dict(top_k=3, capacity_factor=1.0, drop_policy="probs", expert_kernel="bmm")),
    ("k4 shared expert gelu", dict(top_k=4, shared_d_ff=24, shared_gate=True, activation="gelu")),
]


def _run(layer, groups, rank, world, sizes=None):
    x, w = make_batch(TOKENS)
    sizes = sizes or split_sizes(TOKENS, world, uneven=True)
    x, w = x[sum(sizes[:rank]):sum(sizes[:rank + 1])].clone().requires_grad_(True), w[sum(sizes[:rank]):sum(sizes[:rank + 1])]
    with count_host_syncs() as fwd:
        out = layer(x)
    loss = (out * w).sum() / TOKENS + layer.aux_loss
    with count_host_syncs() as bwd:
        loss.backward()
    sync_gradients(layer, groups)
    res = collect(layer, {"out": out.detach(), "x_grad": x.grad, "syncs": (fwd.describe(), len(fwd), len(bwd)),
                          "traffic": layer.traffic.take().by_kind})
    pairs, rows = layer.inter_node_rows
    res.update(pairs=pairs, rows=rows, hierarchical=layer.hierarchical)
    # the duplication counted from the routing: per token and remote node, its pairs there minus one
    routing = layer.last_routing
    if layer.args.capacity_factor is None:
        node = torch.tensor(NODES)[routing.expert_ids // (layer.num_experts // world)]
        remote = node != NODES[rank]
        per = torch.stack([(remote & (node == n)).sum(1) for n in range(2)], 1)
        res["duplication"] = int((per - 1).clamp(min=0).sum())
    with torch.no_grad():
        res["eval_out"] = layer.eval()(x)
    return res


CASES_BY_NAME = {name: cfg for name, cfg, *_ in CASES}


def _compare(rank, world, cases):
    torch.use_deterministic_algorithms(False)
    flat_groups = build_parallel_groups(world, 8, node_of=NODES)
    hier_groups = build_parallel_groups(world, 8, node_of=NODES, dispatch="hierarchical")
    out = {}
    for name, cfg, *sizes in cases:
        flat = _run(apply_expert_parallel(make_layer(cfg), flat_groups), flat_groups, rank, world, *sizes)
        hier = _run(apply_expert_parallel(make_layer(cfg), hier_groups), hier_groups, rank, world, *sizes)
        out[name] = {"flat": flat, "hier": hier}
    return out


def _equal(a, b):
    return a.shape == b.shape and torch.equal(a, b)


def test_hierarchical_equals_flat_bit_for_bit_and_sends_each_token_once_per_node():
    results = run_ranks(_compare, 4, (CASES,), timeout=180)
    for name, *_ in CASES:
        saved = 0
        for rank, per_rank in enumerate(results):
            flat, hier = per_rank[name]["flat"], per_rank[name]["hier"]
            where = f"{name}, rank {rank}"
            assert hier["hierarchical"] and not flat["hierarchical"], where
            # one host read per forward (the dispatch's counts), as the flat dispatch; none in backward
            described, n_forward, n_backward = hier["syncs"]
            assert n_forward == flat["syncs"][1] and n_backward == 0, described
            assert _equal(hier["out"], flat["out"]), f"{where}: outputs differ"
            assert _equal(hier["eval_out"], flat["eval_out"]), f"{where}: outputs without gradients differ"
            assert _equal(hier["x_grad"], flat["x_grad"]), f"{where}: input gradients differ"
            for n, g in flat["router_grads"].items():
                assert _equal(hier["router_grads"][n], g), f"{where}: router gradient {n} differs"
            for n, g in flat["expert_grads"].items():
                torch.testing.assert_close(hier["expert_grads"][n], g, rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{where}: expert gradient {n}: {m}")
            # the same pairs would cross; the hierarchical dispatch sends one row per token and node
            assert hier["pairs"] == flat["pairs"], where
            assert hier["rows"] <= hier["pairs"], where
            if "duplication" in hier:
                assert flat["rows"] - hier["rows"] == hier["duplication"], where
            saved += flat["rows"] - hier["rows"]
        # the byte meter (metrics' a2a_inter_bytes) sees the rows: D_MODEL fp32 values each, the
        # hierarchical rows with their k gates and k expert ids; the outputs come back as as many rows
        per_rank = [(r[name]["flat"], r[name]["hier"]) for r in results]
        k = dict(CASES_BY_NAME[name])["top_k"]
        for flat, hier in per_rank:
            assert flat["traffic"][DISPATCH][1] == flat["rows"] * D_MODEL * 4, name
            assert hier["traffic"][DISPATCH][1] == hier["rows"] * (D_MODEL + 2 * k) * 4, name
        assert sum(h["traffic"][COMBINE][1] for _, h in per_rank) == sum(h["rows"] for _, h in per_rank) * D_MODEL * 4
        if "k4" in name:
            assert saved > 0, f"{name}: no token had two experts on one remote node"


INVARIANCE_CASES = [dict(top_k=4), dict(top_k=2, capacity_factor=1.25, capacity_scope="global")]


def _invariance(rank, world, cfgs):
    torch.use_deterministic_algorithms(False)
    groups = build_parallel_groups(world, 8, node_of=NODES, dispatch="hierarchical")
    x, w = make_batch(TOKENS)
    sizes = split_sizes(TOKENS, world, uneven=True)
    start = sum(sizes[:rank])
    out = []
    for cfg in cfgs:
        layer = apply_expert_parallel(make_layer(cfg), groups)
        res = step(layer, x[start:start + sizes[rank]], w[start:start + sizes[rank]], TOKENS)
        sync_gradients(layer, groups)
        out.append(collect(layer, res) | {"hierarchical": layer.hierarchical})
    return out


def test_hierarchical_dispatch_is_layout_invariant():
    results = run_ranks(_invariance, 4, (INVARIANCE_CASES,))
    for i, cfg in enumerate(INVARIANCE_CASES):
        per_rank = [r[i] for r in results]
        assert all(r["hierarchical"] for r in per_rank)
        check_against_reference(reference(cfg, TOKENS), per_rank, TOKENS)


def test_fallbacks_and_the_start_up_note():
    one_node = dataclasses.replace(build_parallel_groups(1), ep_size=2, ep_nodes=NodeLayout((0, 0)),
                                   dispatch="hierarchical")
    assert "on one node" in hierarchical_fallback(one_node) and "running the flat dispatch" in dispatch_note(one_node)
    odd = dataclasses.replace(one_node, ep_size=3, ep_nodes=NodeLayout((0, 1, 0)))
    assert "not blocks of equally many consecutive ranks" in hierarchical_fallback(odd)
    two = dataclasses.replace(one_node, ep_size=4, ep_nodes=NodeLayout((0, 0, 1, 1)))
    assert "without its node and rail groups" in hierarchical_fallback(two)
    two = dataclasses.replace(two, ep_node=object(), ep_rail=object())  # stand-ins: only their presence is read
    assert hierarchical_fallback(two) is None and dispatch_note(two) == "dispatch=hierarchical over 2 nodes"
    assert dispatch_note(dataclasses.replace(two, dispatch="flat")) == ""
