"""``moe-dist plan``: parameters, per-GPU memory, all-to-all traffic and a layout that fits.

The input is one of our YAML configs or a Hugging Face ``config.json`` (dense or MoE);
``KEY=VALUE`` overrides apply to either (for a dense Hugging Face config, any ``model.moe.*``
override plans its upcycled MoE instead of the dense model): :mod:`moe_dist.plan.plan_input`.
"""
from __future__ import annotations


import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from ..config import ConfigError
from ..config.layout import ep_sizes
from ..model.params import block_shape, count_params, flops_per_token
from .memory import (GIB, STAGES, Units, Workload, activation_bytes, all_to_all_bytes, autocast_copy_bytes,
                     engine_state_bytes, expert_gathered_fraction, expert_shard_fraction, expert_split, fsdp_gathered_bytes, fsdp_head_grad_bytes, fsdp_reduce_peak_bytes,
                     gathered_bytes_per_param, loss_backward_bytes, grad_sync_bytes, optimizer_step_bytes, snapshot_bytes, state_bytes, uses_fsdp)
from .timing import Cluster, Links, StepWork, passes, step_time, sync_time
from .command import batch_settings, recommended_command
from .dispatch_rows import DISPATCHES, dispatch_bytes, group_shape
from .plan_input import PlanInput, load_plan_input

# the share of each GPU's memory a plan fills: the rest is kept for what it does not model (the CUDA
# context, NCCL's buffers, the caching allocator's rounding and fragmentation)
USABLE_FRACTION = 0.9


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def _zero_stages(dense: int, experts_local: int, world: int, ep: int, stage3_gather: float, act: float,
                 act_ckpt: float) -> dict:
    """Each ZeRO stage's states (GiB per GPU) and totals with the activations, without and with
    activation checkpointing; stage 3 also holds what FSDP2 gathers."""
    stages = {}
    for stage in STAGES:
        st = state_bytes(dense, experts_local, world, ep, stage)
        gather = stage3_gather if stage == 3 else 0.0
        stages[f"zero{stage}"] = {k: _gib(v) for k, v in st.items()} | {
            "total": _gib(sum(st.values()) + act + gather),
            "total_with_activation_checkpointing": _gib(sum(st.values()) + act_ckpt + gather)}
    return stages


def _expert_split(inp: PlanInput, s, ep: int, world: int, experts_local: int, sharded: bool) -> dict:
    """How a layout's experts are split over their ``edp`` replicas (``parallel.expert_shard``):
    the experts unit FSDP2 gathers (its padded all-gather output when split unevenly on the expert
    dimension), the busiest replica's share, that output over the experts' size, and in words."""
    n_moe = len(inp.moe_blocks)
    if not n_moe:
        return {"gathered": 0, "share": 1.0, "fraction": 1.0, "split": "none"}
    shape = (s.num_experts // ep, world // ep, s.d_model, s.expert_d_ff, s.gated, inp.expert_shard)
    fraction = expert_gathered_fraction(*shape)
    return {"gathered": round(experts_local / n_moe * fraction) if sharded else 0,
            "share": expert_shard_fraction(*shape) if sharded else 1.0, "fraction": fraction,
            "split": expert_split(*shape) if sharded else "none"}


def _workload(inp: PlanInput, s, ep: int, micro_batch: int) -> Workload:
    """What one rank's micro-batch makes: tokens, the router's extra values, the rows received."""
    m = inp.model
    n_moe = len(inp.moe_blocks)
    from ..moe.routers import ROUTERS

    router_cls = ROUTERS.get(m.moe.router)
    graph_values = router_cls.graph_values_per_token(inp.seq_len) if n_moe and router_cls is not None else 0.0
    return Workload(seq_len=inp.seq_len, micro_batch=micro_batch, grad_accum=inp.grad_accum,
                    act_bytes=gathered_bytes_per_param(inp.dtype), vocab_size=m.vocab_size, n_layers=m.n_layers,
                    moe_blocks=inp.moe_blocks,
                    graph_values=graph_values,
                    attention_probs=bool(n_moe and router_cls is not None and router_cls.attention_needs == "probs"),
                    received_fraction=(ep - 1) / ep if m.moe.expert_kernel == "loop" else 0.0)


@dataclass(frozen=True)
class _StepPhases:
    """What each phase of the step holds beside the weights and AdamW state (bytes per GPU), and the
    peak over the phases for a given size of activations."""
    held: float  # weights + optimizer state, there in every phase
    optimizer: float
    grads: float
    grads_from_start: float
    autocast: float
    at_rest: float  # FSDP2 units left gathered after forward
    gathered: float
    head_grad: float
    reduce: float
    opt_step: float
    loss_bw: float
    log_softmax: float  # the loss's, part of the activations until its backward

    def phases(self, activations: float) -> dict[str, dict[str, float]]:
        during = {"grads": self.grads_from_start, "activations": activations + self.autocast}
        return {"backward start": {**during, "fsdp_gather": self.at_rest, "temporaries": self.loss_bw},
                "backward": {**during, "activations": activations + self.autocast - self.log_softmax,
                             "fsdp_gather": max(self.gathered, self.at_rest), "temporaries": self.head_grad},
                "gradient reduction": {"grads": self.grads, "fsdp_reduce": self.reduce},
                "optimizer step": {"grads": self.grads, "optimizer_step": self.opt_step}}

    def peak_phase(self, activations: float) -> tuple[float, str, dict[str, float]]:
        totals = [(sum(held_by.values()), name, held_by) for name, held_by in self.phases(activations).items()]
        return max(totals, key=lambda t: t[:2])

    def peak(self, activations: float) -> float:
        return self.held + self.peak_phase(activations)[0]

    def at_peak(self, activations: float) -> dict:
        """Each category at the predicted peak (what the dry run reports), and which phase it is in."""
        _, phase, held_by = self.peak_phase(activations)
        return {"phase": phase, "grads": _gib(held_by["grads"]),
                # AdamW's temporary is made inside its step: torch's tracker files it with its state
                "optimizer": _gib(self.optimizer + held_by.get("optimizer_step", 0.0)),
                **{key: _gib(held_by.get(key, 0.0))
                   for key in ("activations", "fsdp_gather", "fsdp_reduce", "temporaries")}}


def _units(counts: dict, s, split_of: dict) -> Units:
    """The FSDP2 units a rank gathers: the embedding and the head are units of their own when untied."""
    split = bool(counts["lm_head"])
    return Units(root=s.d_model if split else counts["embedding"] + s.d_model, block=counts["largest_dense_block"],
                 experts=split_of["gathered"],
                 output_head=counts["lm_head"] or counts["embedding"], edges_split=split,
                 embedding=counts["embedding"])


def evaluate_layout(inp: PlanInput, counts: dict, world: int, gpus_per_node: int, ep: int, micro_batch: int) -> dict:
    """Memory (GiB per GPU) and traffic of one (world, ep) layout."""
    m = inp.model
    s = block_shape(m)
    n_moe = len(inp.moe_blocks)
    experts_local = n_moe * (s.num_experts // ep) * counts["per_expert"] if n_moe else 0
    dense = counts["dense_params"]
    work = _workload(inp, s, ep, micro_batch)
    act = activation_bytes(s, work, checkpointing=False)
    act_ckpt = activation_bytes(s, work, checkpointing=True)
    fsdp = uses_fsdp(inp.dense_mode, world)
    sharded_experts = fsdp and world // ep > 1
    split_of = _expert_split(inp, s, ep, world, experts_local, sharded_experts)
    busiest_share = split_of["share"]
    units = _units(counts, s, split_of)
    engine = engine_state_bytes(dense, experts_local, world, ep, inp.dense_mode, inp.grad_accum,
                                expert_share=busiest_share, grad_sync=inp.grad_sync)
    # unsharded gradients kept between micro-batches: FSDP2 reduces once per step (parallel.grad_sync=step)
    kept_unsharded = fsdp and inp.grad_accum > 1 and inp.grad_sync == "step"
    whole = (0 if sharded_experts else experts_local) + (0 if fsdp else dense)  # weights FSDP2 does not gather
    largest_group = max(dense / (world if fsdp else 1), experts_local * busiest_share)
    grads = engine["grads"]
    phases = _StepPhases(
        held=engine["weights"] + engine["optimizer"], optimizer=engine["optimizer"], grads=grads,
        # with one micro-batch the gradients are made in backward as the activations are freed; with
        # more, the earlier micro-batches' are there from the start
        grads_from_start=grads if inp.grad_accum > 1 else 0.0,
        autocast=autocast_copy_bytes(whole, inp.dtype),
        # without resharding after forward every FSDP2 unit stays gathered until its backward
        at_rest=0.0 if inp.reshard_after_forward or not fsdp or world == 1 else
        (dense + (experts_local if sharded_experts else 0)) * gathered_bytes_per_param(inp.dtype),
        gathered=fsdp_gathered_bytes(units, world, inp.dtype) if fsdp else 0.0,
        head_grad=fsdp_head_grad_bytes(units, world, inp.dtype) if fsdp else 0.0,
        reduce=fsdp_reduce_peak_bytes(units, world, inp.dtype, inp.backend, kept_unsharded) if fsdp else 0.0,
        opt_step=optimizer_step_bytes(largest_group), loss_bw=loss_backward_bytes(work),
        log_softmax=4.0 * m.vocab_size * work.tokens)
    stages = _zero_stages(dense, experts_local, world, ep, fsdp_gathered_bytes(units, world, inp.dtype), act, act_ckpt)
    a2a = all_to_all_bytes(s, work, ep, gpus_per_node, checkpointing=False)
    a2a_ckpt = all_to_all_bytes(s, work, ep, gpus_per_node, checkpointing=True)
    return {
        "ep": ep, "edp": world // ep, "dp": world, "experts_sharded_over_edp": sharded_experts,
        "expert_split": split_of["split"],
        "micro_batch": micro_batch, "ep_within_node": ep <= gpus_per_node,
        "memory_gib": {
            "weights": _gib(engine["weights"]), "grads": _gib(engine["grads"]), "optimizer": _gib(engine["optimizer"]),
            "fsdp_gather": _gib(phases.gathered), "fsdp_head_grad": _gib(phases.head_grad),
            "fsdp_reduce": _gib(phases.reduce), "autocast_copies": _gib(phases.autocast),
            "optimizer_step": _gib(phases.opt_step), "loss_backward": _gib(phases.loss_bw),
            "activations": _gib(act), "activations_checkpointed": _gib(act_ckpt),
            "total": _gib(phases.peak(act)), "total_with_activation_checkpointing": _gib(phases.peak(act_ckpt)),
            "at_peak": phases.at_peak(act), "at_peak_with_activation_checkpointing": phases.at_peak(act_ckpt),
        },
        "zero_stages_gib": stages,
        "all_to_all": {"bytes_per_gpu_per_step": int(a2a["per_gpu"]),
                       "bytes_per_gpu_per_step_checkpointed": int(a2a_ckpt["per_gpu"]),
                       "inter_node_bytes_per_gpu_per_step": int(a2a["inter_node_per_gpu"]),
                       "bytes_per_step_all_gpus": int(a2a["per_gpu"] * world),
                       "collectives_per_step": a2a["collectives"]},
        "weight_and_grad_sync_bytes_per_gpu_per_step": int(grad_sync_bytes(dense, experts_local, world, ep,
                                                                           inp.dense_mode, inp.grad_accum, inp.dtype,
                                                                           split_of["fraction"], inp.grad_sync)),
        "grad_sync": inp.grad_sync,
        # ckpt.memory_every: kept in the node's host memory and sent once over the inter-node link per snapshot
        "snapshot_bytes_per_rank": int(snapshot_bytes(engine)),
    }


@dataclass(frozen=True)
class Network:
    """What the step-time prediction assumes: links, a compute rate, the dispatches to compare."""

    links: Links
    compute_flops: float  # per GPU, achieved over the step's matmuls
    dispatches: tuple[str, ...] = DISPATCHES
    max_groups: tuple[int, ...] = (1, 2)  # node-limited routing's M values to show (beside no limit)
    fsdp_overlap: bool = True  # FSDP2's collectives overlap compute (GPU streams); False for CPU processes


DEFAULT_INTRA_GBPS = 3600.0  # NVLink 4 (H100): 900 GB/s both directions = 450 GB/s = 3600 Gbit/s each way
DEFAULT_INTER_GBPS = 3200.0  # a node of 8 GPUs with one 400 Gbit/s InfiniBand NIC each
DEFAULT_ALPHA_US = 10.0  # one message's latency across the fabric
DEFAULT_COMPUTE_TFLOPS = 400.0  # H100 SXM bf16: ~40% of its 989 dense TFLOP/s, what large matmul-bound steps reach


def make_network(dispatch: str = "all", max_groups: Iterable[int] = (1, 2), intra_gbps: float = DEFAULT_INTRA_GBPS,
                 inter_gbps: float = DEFAULT_INTER_GBPS, alpha_us: float = DEFAULT_ALPHA_US,
                 compute_tflops: float = DEFAULT_COMPUTE_TFLOPS, fsdp_overlap: bool = True) -> Network:
    """A :class:`Network` from the command line's values, each checked (a :class:`ConfigError` names the option)."""
    if dispatch not in (*DISPATCHES, "all"):
        raise ConfigError(f"--dispatch: {dispatch!r}; allowed: {', '.join(DISPATCHES)}, all")
    groups = tuple(max_groups)
    if any(not isinstance(m, int) or m < 1 for m in groups):
        raise ConfigError(f"--max-groups: {','.join(map(str, groups))!r}; allowed: integers >= 1, comma-separated")
    for key, value in (("--intra-gbps", intra_gbps), ("--inter-gbps", inter_gbps), ("--compute-tflops", compute_tflops)):
        if not value > 0:
            raise ConfigError(f"{key}: {value!r}; allowed: a number > 0")
    if not alpha_us >= 0:
        raise ConfigError(f"--alpha-us: {alpha_us!r}; allowed: a number >= 0")
    return Network(links=Links(intra_gbps=intra_gbps, inter_gbps=inter_gbps, alpha_s=alpha_us * 1e-6),
                   compute_flops=compute_tflops * 1e12, dispatches=DISPATCHES if dispatch == "all" else (dispatch,),
                   max_groups=groups, fsdp_overlap=fsdp_overlap)


def step_work(inp: PlanInput, counts: dict, world: int, gpus_per_node: int, layout: dict, links: Links,
              checkpointing: bool) -> StepWork:
    """One GPU's compute and weight synchronisation per step for ``layout`` (an :func:`evaluate_layout` result)."""
    m, s = inp.model, block_shape(inp.model)
    n_moe = len(inp.moe_blocks)
    tokens = layout["micro_batch"] * inp.seq_len
    per_token = flops_per_token(counts, s.d_model, m.vocab_size, inp.seq_len, m.n_layers, s.top_k)
    p = passes(checkpointing)
    ep = layout["ep"]
    fsdp = uses_fsdp(inp.dense_mode, world)
    experts_local = n_moe * (s.num_experts // ep) * counts["per_expert"] if n_moe else 0
    sync = sync_time(links, Cluster(world // gpus_per_node, gpus_per_node), ep, counts["dense_params"], experts_local,
                     counts["embedding"] + counts["lm_head"] + s.d_model, fsdp, gathered_bytes_per_param(inp.dtype),
                     inp.grad_accum * (2 if inp.reshard_after_forward else 1), inp.backend == "gloo",
                     inp.grad_accum if inp.grad_sync == "microbatch" else 1)
    return StepWork(expert_flops=per_token["expert"] * tokens * p, other_flops=per_token["other"] * tokens * p,
                    tokens=tokens, moe_layers=n_moe, grad_accum=inp.grad_accum, d_model=s.d_model,
                    act_bytes=gathered_bytes_per_param(inp.dtype), checkpointing=checkpointing,
                    overlapped_exchange=m.moe.expert_kernel == "loop", sync_s=sync["total"],
                    sync_first_last_s=sync["first_last"], sync_bytes=sync["bytes_per_gpu"])


def dispatch_variants(inp: PlanInput, counts: dict, world: int, gpus_per_node: int, layout: dict,
                      net: Network, usable_gib: float) -> list[dict]:
    """Bytes per step (intra- and inter-node) and predicted step time of ``layout`` for each dispatch
    of ``net`` (flat, hierarchical), without and with node-limited routing (M nodes per token).
    Activation checkpointing is on where the layout does not fit without it."""
    s = block_shape(inp.model)
    n_moe = len(inp.moe_blocks)
    shape = group_shape(layout["ep"], gpus_per_node, s.num_experts, s.top_k) if n_moe else None
    if n_moe and layout["ep"] > 1 and shape is None:
        return []  # ep groups that neither fill whole nodes nor sit inside one: not modelled
    ckpt = layout["memory_gib"]["total"] > usable_gib
    work = step_work(inp, counts, world, gpus_per_node, layout, net.links, ckpt)
    limits = [None] + [M for M in net.max_groups if shape is not None and M < shape.nodes]
    out = []
    spans_nodes = shape is not None and shape.nodes > 1
    # within one node the hierarchical dispatch is the flat one (the runtime falls back to it too)
    for dispatch in dict.fromkeys(d if spans_nodes else "flat" for d in net.dispatches):
        for M in limits:
            if shape is not None and n_moe and layout["ep"] > 1:
                b = dispatch_bytes(shape, dispatch, M, work.tokens, s.d_model, work.act_bytes, n_moe, inp.grad_accum, ckpt)
            else:
                b = {"intra": 0.0, "inter": 0.0}
            t = step_time(work, shape, dispatch, M, net.links, gpus_per_node, net.compute_flops, net.fsdp_overlap)
            out.append({"dispatch": dispatch, "max_groups": M, "activation_checkpointing": ckpt,
                        "intra_bytes_per_gpu_per_step": int(b["intra"]), "inter_bytes_per_gpu_per_step": int(b["inter"]),
                        "intra_bytes_per_step_all_gpus": int(b["intra"] * world),
                        "inter_bytes_per_step_all_gpus": int(b["inter"] * world),
                        "sync_bytes_per_gpu_per_step": int(work.sync_bytes),
                        **{k: round(v, 6) for k, v in t.items()}})
    return out


def _micro_batch(inp: PlanInput, world: int, override: Optional[int]) -> int:
    """Sequences of the busiest rank per micro-batch (``--micro-batch``, else from the batch settings)."""
    if override is not None:
        return override
    if inp.global_batch is None:
        return 1
    return max(1, math.ceil(inp.global_batch // inp.grad_accum / world))


def recommend(layouts: list[dict], usable_gib: float) -> tuple[Optional[dict], str]:
    """The layout to use, and why: without activation checkpointing if one fits (no recompute),
    EP groups inside a node, then the fewest bytes sent per GPU per step (expert all-to-alls
    plus weight/gradient synchronisation: a larger ep sends more all-to-all traffic but has
    fewer expert replicas to gather and reduce-scatter over, or all-reduce when replicated)."""
    def traffic(l: dict, ckpt: bool) -> int:
        a2a = l["all_to_all"]["bytes_per_gpu_per_step_checkpointed" if ckpt else "bytes_per_gpu_per_step"]
        return a2a + l["weight_and_grad_sync_bytes_per_gpu_per_step"]

    def pick(key: str, ckpt: bool) -> Optional[dict]:
        fits = [l for l in layouts if l["memory_gib"][key] <= usable_gib]
        fits.sort(key=lambda l: (not l["ep_within_node"], traffic(l, ckpt), l["ep"]))
        return fits[0] if fits else None

    def gib(n: float) -> str:
        return f"{n / 2**30:.1f} GiB"

    best = pick("total", False)
    if best is not None:
        return dict(best, activation_checkpointing=False), (
            f"ep={best['ep']} fits without activation checkpointing ({best['memory_gib']['total']:.1f} of "
            f"{usable_gib:.1f} usable GiB) and sends the fewest bytes per GPU per step of the layouts that fit "
            f"({gib(traffic(best, False))}: all-to-all + weight/gradient sync)")
    best = pick("total_with_activation_checkpointing", True)
    if best is not None:
        return dict(best, activation_checkpointing=True), (
            f"no layout fits without activation checkpointing; with it ep={best['ep']} needs "
            f"{best['memory_gib']['total_with_activation_checkpointing']:.1f} of {usable_gib:.1f} usable GiB and sends "
            f"the fewest bytes per GPU per step ({gib(traffic(best, True))})")
    low = min(layouts, key=lambda l: l["memory_gib"]["total_with_activation_checkpointing"])
    mem = low["memory_gib"]
    return None, (f"no layout fits: the smallest need is {mem['total_with_activation_checkpointing']:.1f} GiB per GPU "
                  f"(ep={low['ep']}, activation checkpointing; weights {mem['weights']:.1f}, grads {mem['grads']:.1f}, "
                  f"optimizer {mem['optimizer']:.1f}, activations {mem['activations_checkpointed']:.1f}, FSDP gathers "
                  f"{mem['fsdp_gather']:.1f}) but {usable_gib:.1f} GiB are usable")


def _floor(inp: PlanInput, counts: dict, nodes: int, gpus_per_node: int, usable: float,
           micro_batch: Optional[int]) -> str:
    """Why even ``nodes`` nodes do not fit: the part of a GPU's memory that does not shrink with more GPUs."""
    world = nodes * gpus_per_node
    mb = _micro_batch(inp, world, micro_batch)
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


def _alternatives(inp: PlanInput, counts: dict, layouts: list[dict], nodes: int, gpus_per_node: int, usable: float,
                  micro_batch: Optional[int], max_nodes: int = 1024) -> str:
    """What would fit instead: more nodes (same GPUs), or ZeRO sharding of the experts too."""
    text = ""

    def fits(n: int) -> bool:
        world = n * gpus_per_node
        mb = _micro_batch(inp, world, micro_batch)
        E = inp.model.moe.num_experts if inp.moe_blocks else 1
        eps = ep_sizes(world, E)
        cand = [evaluate_layout(inp, counts, world, gpus_per_node, ep, mb) for ep in eps]
        return bool(cand) and (recommend(cand, usable)[0] is not None or
                               _with_microbatch_sync(inp, counts, world, gpus_per_node, eps, mb, usable, None, "")[0]
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


def _with_microbatch_sync(inp: PlanInput, counts: dict, world: int, gpus_per_node: int, eps: list[int], mb: int,
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
        need = min(l["memory_gib"]["total_with_activation_checkpointing"] for l in layouts)
        return None, reason + (f"; with parallel.grad_sync=microbatch (gradients kept sharded) the smallest need is "
                               f"{need:.1f} GiB") if reason else reason
    if network is not None:
        best["dispatch"] = dispatch_variants(other, counts, world, gpus_per_node, best, network, usable)
    return best, (f"with parallel.grad_sync=microbatch (gradients reduce-scattered after every micro-batch, kept "
                  f"sharded; the step's unsharded gradients do not fit): {why}")


def plan(path: str, nodes: int, gpus_per_node: int, gpu_mem_gib: float, overrides: Iterable[str] = (),
         seq_len: Optional[int] = None, micro_batch: Optional[int] = None, network: Optional[Network] = None) -> dict:
    """The whole plan as a JSON-serialisable dict (``total_params``, ``active_params``, ...); with
    ``network``, every layout also has ``dispatch``: bytes and predicted step time per dispatch."""
    for key, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}: {value!r}; allowed: an integer >= 1")
    if not gpu_mem_gib > 0:
        raise ConfigError(f"--gpu-mem-gib: {gpu_mem_gib!r}; allowed: a number > 0")
    for key, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: {value!r}; allowed: an integer >= 1")
    overrides = list(overrides)
    inp = load_plan_input(path, overrides, seq_len)
    counts = count_params(inp.model, inp.moe_blocks)
    world = nodes * gpus_per_node
    inp, batch_changes = batch_settings(inp, world, micro_batch)  # what the trainer accepts at this world size
    mb = _micro_batch(inp, world, micro_batch)
    E = inp.model.moe.num_experts if inp.moe_blocks else 1
    eps = [ep for ep in ep_sizes(world, E)]
    layouts = [evaluate_layout(inp, counts, world, gpus_per_node, ep, mb) for ep in eps]
    usable = gpu_mem_gib * USABLE_FRACTION
    if network is not None:
        if inp.configured_max_groups is not None and inp.configured_max_groups not in network.max_groups:
            network = replace(network, max_groups=tuple(sorted({*network.max_groups, inp.configured_max_groups})))
        for l in layouts:
            l["dispatch"] = dispatch_variants(inp, counts, world, gpus_per_node, l, network, usable)
    best, reason = recommend(layouts, usable)
    if best is None:  # what would fit instead
        best, reason = _with_microbatch_sync(inp, counts, world, gpus_per_node, eps, mb, usable, network, reason)
    if best is None:
        reason += _alternatives(inp, counts, layouts, nodes, gpus_per_node, usable, micro_batch)
    m = inp.model
    cluster = {"nodes": nodes, "gpus_per_node": gpus_per_node, "world_size": world, "gpu_mem_gib": gpu_mem_gib,
               "usable_gib": round(usable, 3), "usable_fraction": USABLE_FRACTION}
    command = recommended_command(inp.source, inp.kind, overrides, best, batch_changes, cluster, seq_len,
                                  micro_batch) if best else None
    return {
        "source": inp.source, "kind": inp.kind,
        "total_params": counts["total"], "active_params": counts["active"],
        "params": counts,
        "model": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads or m.n_heads,
                  "d_ff": m.d_ff, "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings,
                  "moe_layers": inp.moe_blocks, "num_experts": E if inp.moe_blocks else 0,
                  "top_k": m.moe.top_k if inp.moe_blocks else 0, "expert_d_ff": m.moe.d_ff or m.d_ff,
                  "router": m.moe.router if inp.moe_blocks else None},
        "cluster": cluster,
        "workload": {"seq_len": inp.seq_len, "micro_batch_per_gpu": mb, "grad_accum": inp.grad_accum,
                     "tokens_per_gpu_per_micro_batch": mb * inp.seq_len, "activation_dtype": inp.dtype,
                     "dense_weights": inp.dense_mode, "configured_ep": inp.configured_ep,
                     "configured_dispatch": inp.configured_dispatch, "configured_max_groups": inp.configured_max_groups},
        "layouts": layouts, "recommended": best, "reason": reason, "notes": inp.notes,
        "batch_changes": batch_changes, "command": command,
        **({"network": {"intra_gbps": network.links.intra_gbps, "inter_gbps_per_node": network.links.inter_gbps,
                        "alpha_us": network.links.alpha_s * 1e6, "compute_tflops": network.compute_flops / 1e12,
                        "fsdp_overlap": network.fsdp_overlap}} if network is not None else {}),
    }
