"""1-process-vs-R-ranks cases for routers that read the routing context (step, coins) or the
previous layer's top-1 and keep state (duals, cluster weights, running statistics, k).

A case is a layer config plus a list of calls; each call sets the context and the inputs, runs one
forward/backward on its own batch (rank r takes its slice) and records outputs, input
gradients, summed router/expert gradients, statistics, extras and the router's state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .moe_cases import D_MODEL, collect, make_batch, make_layer, split_sizes, step
from moe_dist.distributed import build_parallel_groups
from moe_dist.distributed.groups import ParallelGroups
from moe_dist.moe import RouterInputs
from moe_dist.moe.routers import set_inference_k
from moe_dist.parallel import apply_expert_parallel, sync_gradients

RTOL, ATOL = 1e-5, 1e-6
TOKENS = 96

# every router but topk with config overrides that fit configs/test.yaml (small options for the
# hypernetwork routers): the cases of the whole-model tests that run each router
ROUTER_OVERRIDES: dict[str, list[str]] = {
    "sinkhorn": ["model.moe.router=sinkhorn"],
    "ssr": ["model.moe.router=ssr"],
    "ac": ["model.moe.router=ac", "model.moe.router_options={start_layer: 1}"],
    "symphony": ["model.moe.router=symphony"],
    "hyper": ["model.moe.router=hyper", "model.moe.router_options={k_max: 4, k_schedule_steps: 3, embed_dim: 16, "
              "hyper_dim: 32}"],
    "smoe_dropout": ["model.moe.router=smoe_dropout", "model.moe.router_options={k_max: 4, k_schedule_steps: 3}"],
    "xmoe": ["model.moe.router=xmoe"],
    "noisy_topk": ["model.moe.router=noisy_topk"],
    "similarity": ["model.moe.router=similarity"],
    "attention": ["model.moe.router=attention"],
}


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
        labels = call.get("labels")  # True: labels over every expert; an int: over that many (the rest empty)
        clusters = layer.num_experts if labels is True else labels
        inputs = RouterInputs(prev_top1=call_labels(i, tokens, clusters)[sl] if labels else None)
        for p in layer.parameters():
            p.grad = None
        res = step(layer, x[sl], w[sl], tokens, inputs)
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


SPAWN = 4  # one spawn of 4 processes runs every layout
LAYOUTS = [(4, 4), (4, 2), (2, 2)]  # (ranks in the job, expert-parallel size)


class Job:
    """One layout inside a spawn: ``ranks`` processes holding distinct tokens, expert-parallel
    ``ep``. A 2-rank job runs twice, on processes {0, 1} and {2, 3}, with its own groups (not
    the default group), which also checks that routers reduce over the context's group."""

    def __init__(self, ranks: int, ep: int, groups: ParallelGroups, rank: int):
        self.ranks, self.ep, self.groups, self.rank = ranks, ep, groups, rank

    @property
    def group(self):
        return self.groups.dp


def build_jobs(num_experts: int = 8) -> dict:
    """Every layout's groups for this process (collective: same order on every process)."""
    world, me = dist.get_world_size(), dist.get_rank()
    assert world == SPAWN, world
    jobs = {}
    for ranks, ep in LAYOUTS:
        if ranks == world:
            jobs[(ranks, ep)] = Job(ranks, ep, build_parallel_groups(ep, num_experts), me)
            continue
        mine = None
        for start in range(0, world, ranks):  # every process creates every group
            g = dist.new_group(list(range(start, start + ranks)))
            if start <= me < start + ranks:
                mine = g
        groups = ParallelGroups(dp=mine, ep=mine, edp=None, ep_size=ep, ep_rank=me % ranks, dp_size=ranks,
                                dp_rank=me % ranks, edp_size=1)
        assert ep == ranks, "sub-world layouts are pure expert parallelism"
        jobs[(ranks, ep)] = Job(ranks, ep, groups, me % ranks)
    return jobs


def run_layouts(jobs: dict, cases: dict, **kw) -> dict:
    """Every case on every layout, even and uneven splits: ``{(name, ranks, ep, uneven): calls}``."""
    out = {}
    for name, (cfg, calls) in cases.items():
        for (ranks, ep), job in jobs.items():
            for uneven in (False, True):
                out[(name, ranks, ep, uneven)] = distributed_calls(job.rank, ranks, cfg, calls, job.groups, uneven, **kw)
    return out


def per_job(results: list, key_fn):
    """``(label, [record of each rank of one job])`` for every job instance in a spawn's results;
    ``key_fn(ranks, ep, uneven)`` gives the key in each process's result dict."""
    for ranks, ep in LAYOUTS:
        for uneven in (False, True):
            for start in range(0, SPAWN, ranks):
                label = f"ranks={ranks} ep={ep} uneven={uneven} processes {start}..{start + ranks - 1}"
                yield (ranks, ep, uneven), label, [r[key_fn(ranks, ep, uneven)] for r in results[start : start + ranks]]


__all__ = ["D_MODEL", "TOKENS", "SPAWN", "LAYOUTS", "reference_calls", "distributed_calls", "check_calls", "differs",
           "build_jobs", "run_layouts", "per_job", "call_labels", "close"]
