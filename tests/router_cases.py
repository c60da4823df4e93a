"""1-process-vs-R-ranks cases for routers that read the routing context (step, coins,
previous layer's top-1) and keep state (duals, cluster weights, running statistics, k).

A case is a layer config plus a list of calls; each call sets the context, runs one
forward/backward on its own batch (rank r takes its slice) and records outputs, input
gradients, summed router/expert gradients, statistics, extras and the router's state.
"""
from __future__ import annotations

import torch

from moe_cases import D_MODEL, collect, make_batch, make_layer, split_sizes, step
from moe_dist.dist import build_parallel_groups
from moe_dist.dist.groups import ParallelGroups
from moe_dist.moe.routers.hyper import set_inference_k
from moe_dist.parallel import apply_expert_parallel, sync_gradients

RTOL, ATOL = 1e-5, 1e-6
TOKENS = 96


def call_labels(call_idx: int, tokens: int, num_experts: int) -> torch.Tensor:
    """Previous-layer top-1 labels for the global batch; the last cluster holds a single token."""
    g = torch.Generator().manual_seed(100 + call_idx)
    labels = torch.randint(0, num_experts - 1, (tokens,), generator=g)
    labels[tokens // 3] = num_experts - 1
    return labels


def router_state(router) -> dict:
    state = {k: v.detach().clone() for k, v in router.state_dict().items()}
    for name in ("last_dual", "last_weights"):
        value = getattr(router, name, None)
        if value is not None:
            state[name] = value.detach().clone()
    return state


def run_calls(layer, groups, calls: list, tokens: int, rank: int, world: int, uneven: bool, prepare=None) -> list:
    sizes = split_sizes(tokens, world, uneven)
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    cfg_d = layer.d_model
    if prepare is not None:
        prepare(layer, rank)
    out = []
    for i, call in enumerate(calls):
        x, w = make_batch(tokens, seed=1 + i, d_model=cfg_d)
        layer.train(call.get("train", True))
        if "eval_k" in call:  # inference k of scheduled-k routers (None: back to the schedule)
            set_inference_k(layer, call["eval_k"])
        ctx = layer.context
        ctx.step, ctx.micro_step = call.get("step", 0), call.get("micro_step", 0)
        ctx.seed, ctx.layer_idx = call.get("seed", 7), call.get("layer_idx", 0)
        ctx.prev_top1 = call_labels(i, tokens, layer.num_experts)[sl] if call.get("labels") else None
        for p in layer.parameters():
            p.grad = None
        res = step(layer, x[sl], w[sl], tokens)
        sync_gradients(layer, groups)
        res = collect(layer, res)
        res["extras"] = {k: v.detach().clone() for k, v in layer.stats.extras.items() if torch.is_tensor(v)}
        res["k"] = layer.last_routing.top_k
        res["state"] = router_state(layer.router)
        out.append(res)
    return out


def reference_calls(cfg: dict, calls: list, tokens: int = TOKENS, seed: int = 0) -> list:
    return run_calls(make_layer(cfg, seed), ParallelGroups.single(), calls, tokens, 0, 1, False)


def distributed_calls(rank: int, world: int, cfg: dict, calls: list, groups, uneven: bool, tokens: int = TOKENS,
                      seed: int = 0, prepare=None) -> list:
    layer = apply_expert_parallel(make_layer(cfg, seed), groups)
    return run_calls(layer, groups, calls, tokens, rank, world, uneven, prepare)


def close(a, b, what: str) -> None:
    if a.dtype.is_floating_point or b.dtype.is_floating_point:
        torch.testing.assert_close(a.double(), b.double(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def check_calls(ref: list, per_rank: list, what: str) -> None:
    """``per_rank[r][i]``: rank r's record of call i; ``ref[i]``: the 1-process record."""
    for i, ref_call in enumerate(ref):
        calls = [r[i] for r in per_rank]
        tag = f"{what} call {i}"
        close(torch.cat([c["out"] for c in calls]), ref_call["out"], f"{tag}: outputs")
        close(torch.cat([c["x_grad"] for c in calls]), ref_call["x_grad"], f"{tag}: input gradients")
        for c in calls:
            assert c["k"] == ref_call["k"], f"{tag}: k {c['k']} != {ref_call['k']}"
            for name in ("aux", "z", "counts", "dropped", "entropy"):
                close(c[name], ref_call[name], f"{tag}: {name}")
            for name in set(c["router_grads"]) | set(ref_call["router_grads"]):  # None == zeros (sync fills zeros)
                g, g_ref = c["router_grads"].get(name), ref_call["router_grads"].get(name)
                g = torch.zeros_like(g_ref) if g is None else g
                close(g, torch.zeros_like(g) if g_ref is None else g_ref, f"{tag}: router grad {name}")
            off = c["expert_offset"]
            for name, g in c["expert_grads"].items():
                close(g, ref_call["expert_grads"][name][off : off + g.shape[0]], f"{tag}: expert grad {name}")
            assert set(c["extras"]) == set(ref_call["extras"]), f"{tag}: extras keys"
            for name, v in c["extras"].items():
                close(v, ref_call["extras"][name], f"{tag}: extra {name}")
            assert set(c["state"]) == set(ref_call["state"]), f"{tag}: state keys"
            for name, v in c["state"].items():
                close(v, ref_call["state"][name], f"{tag}: router state {name}")


def differs(ref: list, per_rank: list) -> bool:
    """True when some call's outputs differ from the reference beyond the tolerance."""
    for i, ref_call in enumerate(ref):
        out = torch.cat([r[i]["out"] for r in per_rank])
        if not torch.allclose(out.double(), ref_call["out"].double(), rtol=RTOL, atol=ATOL):
            return True
    return False


def layouts(world: int) -> list:
    """(ep, uneven) layouts one spawn of ``world`` ranks runs: ep = world, plus ep 2 on 4 ranks."""
    eps = [world] + ([2] if world == 4 else [])
    return [(ep, uneven) for ep in eps for uneven in (False, True)]


def groups_by_ep(world: int, num_experts: int = 8) -> dict:
    """Build every layout's groups once (collective, same order on all ranks)."""
    return {ep: build_parallel_groups(ep, num_experts) for ep in sorted({ep for ep, _ in layouts(world)})}


__all__ = ["D_MODEL", "TOKENS", "reference_calls", "distributed_calls", "check_calls", "differs", "layouts",
           "groups_by_ep", "call_labels", "close"]
