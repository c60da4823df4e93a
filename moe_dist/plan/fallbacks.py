"""What the planner says when no layout fits the GPUs as configured: the layout that fits when
the gradients are reduce-scattered after every micro-batch (``parallel.grad_sync=microbatch``),
how many nodes would fit, what does not shrink with more GPUs, and which ZeRO stage would fit."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..config.layout import ep_sizes
from .memory import uses_fsdp
from .planner import Network, PlanInput, _micro_batch, dispatch_variants, evaluate_layout, recommend


def _floor(inp: PlanInput, counts: dict, nodes: int, gpus_per_node: int, usable: float,
           micro_batch: Optional[int]) -> str:
    """Why even ``nodes`` nodes do not fit: the part of a GPU's memory that does not shrink with more GPUs."""
    world = nodes * gpus_per_node
    mb, _ = _micro_batch(inp, world, micro_batch)
    E = inp.model.moe.num_experts if inp.moe_blocks else 1
    far = min((evaluate_layout(inp, counts, world, gpus_per_node, ep, mb) for ep in ep_sizes(world, E)),
              key=lambda l: l["memory_gib"]["total_with_activation_checkpointing"])
    g = far["memory_gib"]
    text = (f"even {nodes} nodes leave {g['total_with_activation_checkpointing']:.1f} GiB per GPU (ep={far['ep']}, "
            f"activation checkpointing), more than the {usable:.1f} usable; ")
    if uses_fsdp(inp.dense_mode, world):
        experts = ", one MoE layer's experts" if far["experts_sharded_over_edp"] else ""
        local = E // far["ep"]
        whole = ""
        if far["expert_split"] == "experts (padded)":
            whole = (f", and the busiest of the {far['edp']} replicas of each layer's {local} expert(s) holds "
                     f"{-(-local // far['edp'])} whole (parallel.expert_shard splits them on the expert dimension) with "
                     f"their gradients and AdamW state")
        return text + (f"what does not shrink with more GPUs is what FSDP2 gathers ({g['fsdp_gather']:.1f} GiB: the root "
                       f"unit, two blocks{experts}) and the activations of one micro-batch "
                       f"({g['activations_checkpointed']:.1f} GiB){whole}")
    return text + (f"parallel.dense={inp.dense_mode} replicates the dense weights, their gradients and AdamW state "
                   f"({g['weights'] + g['grads'] + g['optimizer']:.1f} GiB with the experts); parallel.dense=fsdp shards them")


def alternatives(inp: PlanInput, counts: dict, layouts: list[dict], nodes: int, gpus_per_node: int, usable: float,
                  micro_batch: Optional[int], max_nodes: int = 1024) -> str:
    """What would fit instead: more nodes (same GPUs), or ZeRO sharding of the experts too."""
    text = ""

    def fits(n: int) -> bool:
        world = n * gpus_per_node
        mb, _ = _micro_batch(inp, world, micro_batch)
        E = inp.model.moe.num_experts if inp.moe_blocks else 1
        eps = ep_sizes(world, E)
        cand = [evaluate_layout(inp, counts, world, gpus_per_node, ep, mb) for ep in eps]
        return bool(cand) and (recommend(cand, usable)[0] is not None or
                               with_microbatch_sync(inp, counts, world, gpus_per_node, eps, mb, usable, None, "")[0]
                               is not None)

    # memory per GPU only falls as nodes are added (more sharding, fewer sequences each): double, then bisect
    lo, hi = nodes, nodes * 2
    while hi <= max_nodes and not fits(hi):
        lo, hi = hi, hi * 2
    if hi <= max_nodes:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        text += f"; {hi} nodes of {gpus_per_node} GPUs would fit"
    else:
        text += "; more nodes do not help: " + _floor(inp, counts, max_nodes, gpus_per_node, usable, micro_batch)
    def fitting(stages: tuple[str, ...]) -> list[tuple[float, int, str]]:
        return sorted((v["total_with_activation_checkpointing"], l["ep"], k) for l in layouts
                      for k, v in l["zero_stages_gib"].items()
                      if k in stages and v["total_with_activation_checkpointing"] <= usable)

    deepspeed, zero3 = fitting(("zero1", "zero2")), fitting(("zero3",))
    if deepspeed:  # what train.engine=deepspeed runs: ZeRO-1/2, experts sharded over their replicas
        need, ep, stage = deepspeed[0]
        text += (f"; DeepSpeed ZeRO-{stage[-1]} (train.engine=deepspeed deepspeed.zero_stage={stage[-1]} parallel.ep={ep}, "
                 f"activation checkpointing) would need {need:.1f} GiB")
    elif zero3:
        need, ep, _ = zero3[0]
        text += (f"; ZeRO-3 over the expert replicas (ep={ep}, activation checkpointing) would need {need:.1f} GiB: "
                 f"moe_dist's engine runs it with parallel.dense=fsdp parallel.ep={ep} (DeepSpeed refuses MoE with ZeRO-3)")
    return text


def with_microbatch_sync(inp: PlanInput, counts: dict, world: int, gpus_per_node: int, eps: list[int], mb: int,
                          usable: float, network: Optional[Network], reason: str) -> tuple[Optional[dict], str]:
    """Where nothing fits while FSDP2 keeps unsharded gradients for the whole step
    (``parallel.grad_sync=step`` with ``grad_accum > 1``): the layout that fits when they are
    reduce-scattered after every micro-batch instead, if one does (more traffic, less memory)."""
    if inp.grad_sync != "step" or inp.grad_accum == 1 or not uses_fsdp(inp.dense_mode, world):
        return None, reason
    other = replace(inp, grad_sync="microbatch")
    layouts = [evaluate_layout(other, counts, world, gpus_per_node, ep, mb) for ep in eps]
    best, why = recommend(layouts, usable)
    if best is None:
        return None, reason
    if network is not None:
        best["dispatch"] = dispatch_variants(other, counts, world, gpus_per_node, best, network, usable)
    return best, (f"with parallel.grad_sync=microbatch (gradients reduce-scattered after every micro-batch, kept "
                  f"sharded; the step's unsharded gradients do not fit): {why}")
