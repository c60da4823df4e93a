"""Shared helpers for MoE layer tests: a reference run on one process and the same run
split over ranks, both returning outputs, losses, gradients and statistics."""
from __future__ import annotations

from typing import Optional

import torch

from moe_dist.distributed import build_parallel_groups
from moe_dist.moe import MoEArgs, MoELayer, RouterInputs
from moe_dist.parallel import apply_expert_parallel, sync_gradients

D_MODEL, D_FF = 16, 32
RTOL, ATOL = 1e-5, 1e-6


def make_layer(cfg: dict, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    cfg = dict(cfg)
    return MoELayer(cfg.pop("d_model", D_MODEL), MoEArgs(d_ff=cfg.pop("d_ff", D_FF),
                                                         num_experts=cfg.pop("num_experts", 8),
                                                         top_k=cfg.pop("top_k", 2),
                                                         expert_kernel=cfg.pop("expert_kernel", "loop"), **cfg))


def make_batch(tokens: int, seed: int = 1, d_model: int = D_MODEL):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, d_model, generator=g), torch.randn(tokens, d_model, generator=g)


def split_sizes(total: int, parts: int, uneven: bool) -> list[int]:
    if not uneven:
        return [total // parts] * parts
    sizes = [total // parts + (2 * i - parts + 1) for i in range(parts)]
    sizes[-1] = total - sum(sizes[:-1])
    return sizes


def step(layer: MoELayer, x: torch.Tensor, w: torch.Tensor, global_tokens: int,
         inputs: Optional[RouterInputs] = None) -> dict:
    """One forward/backward with loss = sum(out * w) / T_global + aux share (``inputs``: what the
    router reads from a model, handed to the layer's forward)."""
    x = x.clone().requires_grad_(True)
    out = layer(x, inputs)
    loss = (out * w).sum() / global_tokens + layer.aux_loss
    loss.backward()
    return {"out": out.detach(), "x_grad": x.grad}


def collect(layer: MoELayer, res: dict) -> dict:
    s = layer.stats
    res.update(
        router_grads={n: p.grad.clone() for n, p in layer.router.named_parameters() if p.grad is not None},
        expert_grads={n: getattr(layer.experts, n).grad.clone() for n in ("w1", "w3", "w2") if getattr(layer.experts, n) is not None},
        expert_offset=layer.experts.offset,
        counts=s.expert_counts.clone(), aux=s.aux_loss.clone(), z=s.z_loss.clone(), dropped=s.dropped.clone(),
        entropy=s.entropy.clone(),
    )
    return res


def reference(cfg: dict, tokens: int, seed: int = 0) -> dict:
    layer = make_layer(cfg, seed)
    x, w = make_batch(tokens, d_model=cfg.get("d_model", D_MODEL))
    return collect(layer, step(layer, x, w, tokens))


def distributed_case(rank: int, world: int, cfg: dict, tokens: int, ep: int, uneven: bool, seed: int = 0) -> dict:
    """Runs on each rank: the same layer, expert-parallel ``ep``, this rank's slice of the batch."""
    torch.use_deterministic_algorithms(False)
    groups = build_parallel_groups(ep, cfg.get("num_experts", 8))
    layer = apply_expert_parallel(make_layer(cfg, seed), groups)
    x, w = make_batch(tokens, d_model=cfg.get("d_model", D_MODEL))
    sizes = split_sizes(tokens, world, uneven)
    start = sum(sizes[:rank])
    res = step(layer, x[start : start + sizes[rank]], w[start : start + sizes[rank]], tokens)
    sync_gradients(layer, groups)
    return collect(layer, res)


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def check_against_reference(ref, results, tokens):
    out = torch.cat([r["out"] for r in results])
    close(out, ref["out"], "outputs")
    close(torch.cat([r["x_grad"] for r in results]), ref["x_grad"], "input gradients")
    for r in results:
        for name in ("aux", "z", "counts", "dropped", "entropy"):
            close(r[name].double(), ref[name].double(), name)
        for name, g in r["router_grads"].items():
            close(g, ref["router_grads"][name], f"router grad {name}")
        off = r["expert_offset"]
        for name, g in r["expert_grads"].items():
            close(g, ref["expert_grads"][name][off : off + g.shape[0]], f"expert grad {name} (experts {off}..)")
