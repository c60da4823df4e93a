"""Per-GPU memory and communication of one training layout, from the model's shapes.

Conventions (those of moe_dist's trainer): master weights, gradients and AdamW's two moments
are fp32 (4 + 4 + 8 bytes per parameter) whatever ``train.dtype``. Every rank holds distinct
tokens (data-parallel size = world size); each MoE layer's experts are split over ``ep`` ranks
and replicated over ``edp = world / ep``.

ZeRO stages shard over the ranks that hold a copy: dense weights over all ``world`` ranks,
experts over their ``edp`` replicas. Stage 1 shards the optimizer state, 2 also the
gradients, 3 also the weights. moe_dist's own engine (``parallel.dense=fsdp``) is stage 3 for
both: FSDP2 shards the dense weights over all ranks and each MoE layer's experts over its
``edp`` replicas (one FSDP2 unit per layer's experts on the edp mesh; with edp = 1 they are
whole; split on the expert dimension or inside every expert: :mod:`moe_dist.parallel.expert_shard`).
``parallel.dense=replicate`` is stage 0 for both. With ``train.grad_accum > 1`` and
``parallel.grad_sync=step`` FSDP2 keeps each unit's *unsharded* gradient between micro-batches
(it reduce-scatters only on the last one), so gradients take their unsharded size; with
``microbatch`` it reduce-scatters after each and gradients stay sharded.

Transients on top of those states (the peak is the largest of them):

* forward and backward: activations, plus what FSDP2 holds gathered (:func:`fsdp_gathered_bytes`:
  the root unit, two blocks, two layers' experts units when experts are sharded, each the whole
  all-gather output: the layer's local experts, or ``edp x ceil(E_local / edp)`` of them when
  they are split unevenly on the expert dimension (``parallel.expert_shard``); 2
  bytes per parameter under bf16, whose MixedPrecisionPolicy gathers bf16 copies, else 4) and
  the output head's unsharded gradient (computed first, reduced with the root unit, last);
  replicated weights under bf16 autocast keep a bf16 copy of every weight for backward (2
  bytes per parameter held whole);
* a unit's gradient reduction in backward (:func:`fsdp_reduce_peak_bytes`): the fp32 flat
  buffer FSDP2 copies its unsharded gradients into, next to those gradients or, with gloo, the
  reduce-scatter's own copy of that buffer, while the rest stays gathered (the experts unit of
  the running MoE layer, or the root unit at the end of backward);
* the optimizer step: the fused AdamW (:func:`moe_dist.train.loop.optim.build_optimizer`) updates each
  element in place and makes no temporary; the foreach one it falls back to on a device without
  the fused kernel makes one fp32 temporary (sqrt of the second moment) the size of its largest
  parameter group on this rank.

Activations are what the step keeps for backward, per token, as the dry run measures them
(:mod:`moe_dist.plan.dry_run`, torch's CPU kernels; ``e`` = activation bytes, 2 under bf16
autocast): each RMSNorm ``8d`` (its input and the normalised input in fp32; torch's composite
kernel) plus its output as the next matmul keeps it (``e d``; fp32 for a router); attention
``e (2H + 2KV) hd`` (rotated q and k, v, the output) and the fused kernel's fp32 log-sum-exp
(``4H``), with OLMoE's q/k norm also ``8 (H + KV) hd`` (those norms' fp32 inputs and normalised
inputs); dense SwiGLU ``4 e ff`` (both projections, their SiLU, the product); an MoE layer
``k e (2d + 3 ff_e)`` (the dispatched rows in and out, each expert's two projections and product;
``2 ff_e`` for a GELU expert) plus, with the ``loop`` kernel's pipelined exchange over ``ep``
ranks, the ``(ep - 1) / ep`` of those rows that came from peers, and its fp32 router state; the
loss keeps the fp32 log-softmax (``4 V``) and its backward starts with two more fp32 ``V`` rows
(:func:`loss_backward_bytes`), the step's peak when nothing larger is gathered. Routers that read
attention probabilities add an fp32 ``H x S`` row per token. With activation checkpointing each
block keeps only its input (``e d`` per token) and one block is recomputed at a time. CUDA's fused
RMSNorm keeps only the input (``4d`` less per norm than the CPU kernel the dry run runs): the
planner stays on the side of the measured figure.

Not modelled: the framework's own memory (CUDA context / the CPU runtime and libraries),
allocator caching and fragmentation, communication library buffers, and the data pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..model.params import BlockShape
from ..parallel.expert_shard import busiest_share, expert_weight_shapes, gathered_fraction, shard_dim
from .dispatch_rows import flat_rows_per_token, transfers_per_layer

GIB = float(1 << 30)
STAGES = (0, 1, 2, 3)


@dataclass
class Workload:
    seq_len: int
    micro_batch: int  # sequences per GPU per forward
    grad_accum: int
    act_bytes: int  # 2 (bf16 autocast) or 4 (fp32)
    vocab_size: int
    n_layers: int
    moe_blocks: list[int]
    graph_values: float = 0.0  # fp32 values per token a token-graph router keeps (its mixing weights)
    attention_probs: bool = False  # the model hands the router [H, S, S] attention probabilities
    received_fraction: float = 0.0  # dispatched rows the loop kernel's pipelined exchange keeps again: (ep - 1) / ep

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


def state_bytes(dense_params: int, expert_params_local: int, world: int, ep: int, stage: int) -> dict[str, float]:
    """Weights / gradients / optimizer bytes on one GPU at ZeRO ``stage`` (0-3)."""
    edp = world // ep

    def part(bytes_per_param: int, sharded: bool) -> float:
        dense = dense_params * bytes_per_param / (world if sharded else 1)
        experts = expert_params_local * bytes_per_param / (edp if sharded else 1)
        return dense + experts

    return {"weights": part(4, stage >= 3), "grads": part(4, stage >= 2), "optimizer": part(8, stage >= 1)}


def gathered_bytes_per_param(dtype: str) -> int:
    """Bytes of one gathered (or autocast) weight copy: bf16 copies under ``train.dtype=bf16``, fp32 otherwise."""
    return 2 if dtype == "bf16" else 4


def uses_fsdp(dense_mode: str, world: int) -> bool:
    """FSDP2 is applied only across several ranks (one process holds everything whole)."""
    return dense_mode == "fsdp" and world > 1


def expert_shard_fraction(local_experts: int, edp: int, d_model: int = 0, d_ff: int = 0, gated: bool = True,
                          choice: str = "auto") -> float:
    """The largest share of a layer's local experts one of its ``edp`` replicas holds under FSDP2
    with ``parallel.expert_shard=choice`` (:mod:`moe_dist.parallel.expert_shard`): an even ``1 / edp``
    when split on the expert dimension with ``edp`` dividing ``local_experts``, or inside every
    expert; otherwise the first replica's ``ceil(local_experts / edp)`` whole experts (one local
    expert over 8 replicas on the expert dimension: the first holds it whole, the others nothing).
    Without the experts' sizes (``d_model``/``d_ff`` 0) the split is on the expert dimension."""
    if edp <= 1 or local_experts < 1:
        return 1.0
    if not (d_model and d_ff):
        choice = "experts"
    shapes = expert_weight_shapes(local_experts, d_model or 1, d_ff or 1, gated)
    return sum(busiest_share(shape, edp, choice) for shape in shapes) / len(shapes)  # the weights are equal in size


def expert_gathered_fraction(local_experts: int, edp: int, d_model: int, d_ff: int, gated: bool = True,
                             choice: str = "auto") -> float:
    """FSDP2's all-gather (and reduce-scatter) of a layer's local experts relative to their size:
    ``edp * ceil(local_experts / edp) / local_experts`` for an uneven split on the expert dimension
    (padded), 1 otherwise."""
    if edp <= 1 or local_experts < 1:
        return 1.0
    shapes = expert_weight_shapes(local_experts, d_model, d_ff, gated)
    return sum(gathered_fraction(shape, edp, choice) for shape in shapes) / len(shapes)


def expert_split(local_experts: int, edp: int, d_model: int, d_ff: int, gated: bool = True, choice: str = "auto") -> str:
    """How a layer's experts are split over their replicas, in words for the plan: ``experts``
    (whole experts each), ``experts (padded)`` or ``within`` (a block of every expert each)."""
    if edp <= 1:
        return "none"
    dims = {shard_dim(shape, edp, choice) for shape in expert_weight_shapes(local_experts, d_model, d_ff, gated)}
    if dims == {0}:
        return "experts" if local_experts % edp == 0 else "experts (padded)"
    return "within" if 0 not in dims else "mixed"


def engine_state_bytes(dense_params: int, expert_params_local: int, world: int, ep: int, dense_mode: str,
                       grad_accum: int = 1, expert_share: Optional[float] = None,
                       grad_sync: str = "step") -> dict[str, float]:
    """moe_dist's trainer: with FSDP2, dense weights sharded over all ranks and experts over
    their ``edp = world / ep`` replicas (whole when edp = 1); replicated otherwise.
    ``grad_accum > 1`` under FSDP2 with ``grad_sync="step"``: unsharded gradients are kept between
    micro-batches (with ``"microbatch"`` they are reduce-scattered after each, and kept sharded).
    ``expert_share``: the busiest replica's share of the local experts (:func:`expert_shard_fraction`);
    None: an even split."""
    fsdp = uses_fsdp(dense_mode, world)
    dense_shard = world if fsdp else 1
    expert_shard = world // ep if fsdp else 1
    if fsdp and expert_share:
        expert_shard = 1 / expert_share

    def part(bytes_per_param: int, dense_shard: int, expert_shard: float) -> float:
        return dense_params * bytes_per_param / dense_shard + expert_params_local * bytes_per_param / expert_shard

    grads = part(4, 1, 1) if fsdp and grad_accum > 1 and grad_sync == "step" else part(4, dense_shard, expert_shard)
    return {"weights": part(4, dense_shard, expert_shard), "grads": grads,
            "optimizer": part(8, dense_shard, expert_shard)}


def snapshot_bytes(engine_state: dict[str, float]) -> float:
    """Bytes of one rank's in-memory snapshot (ckpt.memory_every): its fp32 weights and AdamW state as
    :func:`engine_state_bytes` counts them (RNG states and the metadata are small); the same bytes go
    to its buddy rank on another node at every snapshot."""
    return engine_state["weights"] + engine_state["optimizer"]


def norm_bytes(d: int, consumer_bytes: int) -> int:
    """Bytes per token one RMSNorm leaves for backward: its fp32 input and normalised input
    (torch's composite kernel) and its output as the matmul after it keeps it."""
    return 8 * d + consumer_bytes * d + 4


def block_activation_bytes(s: BlockShape, is_moe: bool, act_bytes: int, seq_len: int, attention_probs: bool,
                           graph_values: float = 0.0, received_fraction: float = 0.0) -> float:
    """Bytes kept per token by one block for backward (module docstring): with a token-graph router
    also its mixing weights (``graph_values`` fp32 per token), for the ``probs`` attention form every
    head's [S, S] probabilities, and ``received_fraction`` of the dispatched rows kept a second time
    (the pipelined exchange's rows from peers)."""
    e = act_bytes
    attn = norm_bytes(s.d_model, e) + e * (2 * s.n_heads + 2 * s.n_kv_heads) * s.head_dim + 4 * s.n_heads
    if s.qk_norm:  # their fp32 inputs and normalised inputs (the rotary embedding keeps no input)
        attn += 8 * (s.n_heads + s.n_kv_heads) * s.head_dim + 8
    if not is_moe:
        return attn + norm_bytes(s.d_model, e) + 4 * e * s.d_ff
    k = s.top_k
    ffn = (norm_bytes(s.d_model, 4) + k * e * (2 * s.d_model + (3 if s.gated else 2) * s.expert_d_ff)
           + received_fraction * k * e * s.d_model + 8 * s.num_experts + 29 * k + 8)
    if s.shared_d_ff:  # the shared expert's hidden activations and output (and its gate)
        ffn += e * (3 * s.shared_d_ff + s.d_model + (2 if s.shared_gate else 0))
    ffn += graph_values * 4
    if attention_probs:
        ffn += s.n_heads * seq_len * 4
    return attn + ffn


def activation_bytes(s: BlockShape, w: Workload, checkpointing: bool) -> float:
    """Activation bytes of one micro-batch on one GPU at the start of backward: what the blocks
    keep, and the loss's fp32 log-softmax."""
    moe = set(w.moe_blocks)
    per_block = [block_activation_bytes(s, i in moe, w.act_bytes, w.seq_len, w.attention_probs, w.graph_values,
                                        w.received_fraction) for i in range(w.n_layers)]
    edges = norm_bytes(s.d_model, w.act_bytes) + 4 * w.vocab_size  # the final norm; the loss's fp32 log-softmax
    if checkpointing:
        per_token = w.n_layers * s.d_model * w.act_bytes + max(per_block) + edges
    else:
        per_token = sum(per_block) + edges
    return per_token * w.tokens


def loss_backward_bytes(w: Workload) -> float:
    """The loss's backward, its first transient: two fp32 ``[tokens, vocab]`` gradients (of the
    log-softmax and of the logits) beside the activations."""
    return 8.0 * w.vocab_size * w.tokens


@dataclass
class Units:
    """Parameter counts of the FSDP2 units a rank gathers (whole, before sharding)."""

    root: int  # what the root unit holds, gathered for the whole forward and backward (the final norm; also
    # the embedding and the output head when they are tied)
    block: int  # the largest block's dense part (attention, norms, dense FFN or router)
    experts: int  # one MoE layer's experts on this rank (ep-local, padded: see the planner) when an FSDP2 unit, else 0
    output_head: int  # the head's weight
    edges_split: bool = True  # the embedding and the output head are units of their own (untied)
    embedding: int = 0  # the embedding's weight (its unit is the last one backward reduces)


def fsdp_gathered_bytes(units: Units, world: int, dtype: str) -> float:
    """Weights FSDP2 holds gathered at once in backward: the root unit, and two blocks (the running
    one and the one prefetched) and, with experts sharded, two MoE layers' experts (likewise; the
    dry run's peak in backward holds both); or, at the start of backward, the output head's own unit
    with its unsharded gradient and the prefetched last block."""
    if world == 1:
        return 0.0
    blocks = 2 * units.block + 2 * units.experts
    if units.edges_split:
        blocks = max(blocks, 2 * units.output_head + units.block + units.experts)
    return (units.root + blocks) * gathered_bytes_per_param(dtype)


def fsdp_head_grad_bytes(units: Units, world: int, dtype: str) -> float:
    """The output head's unsharded gradient while the rest of backward runs: in the root unit it is
    reduce-scattered only with the root, last; as a unit of its own, right after its backward (then
    counted in :func:`fsdp_gathered_bytes`)."""
    if world == 1 or units.edges_split:
        return 0.0
    return units.output_head * gathered_bytes_per_param(dtype)


def reduce_scatter_bytes(unit_params: int, dtype: str, backend: str, grads_counted: bool) -> float:
    """One unit's gradient reduction (torch's FSDP2 ``foreach_reduce``): its unsharded gradients
    (unless already counted: under grad_accum > 1 they are the state's gradients) are copied
    into an fp32 flat buffer and freed; with gloo the reduce-scatter then copies that buffer
    once more (it runs an all-reduce of the whole buffer underneath; benchmarks/results/planner.md, "gloo's
    reduce-scatter copy"). Peak: the buffer plus the larger of the gradients and gloo's copy."""
    grads = 0 if grads_counted else gathered_bytes_per_param(dtype)
    copy = 4 if backend == "gloo" else 0
    return unit_params * (4 + max(grads, copy))


def fsdp_reduce_peak_bytes(units: Units, world: int, dtype: str, backend: str, grads_counted: bool) -> float:
    """The largest moment of gradient reduction in backward: the running MoE layer's experts unit
    (resharded, its gradients being reduced, while the root and two blocks stay gathered and the
    head's gradient waits) or the root unit at the very end (everything else already resharded)."""
    if world == 1:
        return 0.0
    def rs(unit_params: int) -> float:
        return reduce_scatter_bytes(unit_params, dtype, backend, grads_counted)

    at_root = rs(max(units.root, units.embedding if units.edges_split else 0))
    at_experts = (fsdp_gathered_bytes(units, world, dtype) - units.experts * gathered_bytes_per_param(dtype)
                  + fsdp_head_grad_bytes(units, world, dtype) + rs(units.experts)) if units.experts else 0.0
    at_block = (fsdp_gathered_bytes(units, world, dtype) - units.block * gathered_bytes_per_param(dtype)
                + fsdp_head_grad_bytes(units, world, dtype) + rs(units.block))
    return max(at_root, at_experts, at_block)


def autocast_copy_bytes(unsharded_params_local: int, dtype: str) -> float:
    """bf16 autocast copies of weights FSDP2 does not gather (replicated dense weights, whole
    experts): kept for backward, 2 bytes each."""
    return unsharded_params_local * 2.0 if dtype == "bf16" else 0.0


def optimizer_step_bytes(largest_group_local: float, fused: bool = True) -> float:
    """The optimizer step's temporary: none for the fused AdamW; foreach AdamW's fp32 sqrt of the
    second moment over its largest parameter group."""
    return 0.0 if fused else largest_group_local * 4.0


def all_to_all_bytes(s: BlockShape, w: Workload, ep: int, gpus_per_node: int, checkpointing: bool) -> dict[str, float]:
    """Bytes one GPU sends in expert all-to-alls per optimizer step with the flat dispatch and a
    balanced router (:mod:`moe_dist.plan.dispatch_rows`). Forward: dispatch + combine; backward: the
    same two in reverse; activation checkpointing repeats the forward pair."""
    if ep == 1 or not w.moe_blocks:
        return {"per_gpu": 0.0, "inter_node_per_gpu": 0.0, "collectives": 0}
    rows = flat_rows_per_token(ep, gpus_per_node, s.top_k)
    transfers = transfers_per_layer(checkpointing) * len(w.moe_blocks) * w.grad_accum
    per_row = w.tokens * s.d_model * w.act_bytes * transfers
    return {"per_gpu": (rows["intra"] + rows["inter"]) * per_row, "inter_node_per_gpu": rows["inter"] * per_row,
            "collectives": transfers}


def grad_sync_bytes(dense_params: int, expert_params_local: int, world: int, ep: int, dense_mode: str,
                    grad_accum: int, dtype: str = "fp32", expert_gathered: float = 1.0,
                    grad_sync: str = "step") -> float:
    """Bytes one GPU sends for weights and gradients per step (ring collectives). FSDP2 gathers
    weights in forward and backward of each micro-batch (bf16 copies under bf16) and
    reduce-scatters the fp32 gradients once (``grad_sync="step"``) or after every micro-batch
    (``"microbatch"``): the dense weights over all ranks, the experts over
    their edp replicas (``expert_gathered`` times their size: FSDP2 pads an uneven split on the
    expert dimension, :func:`expert_gathered_fraction`). Replicated weights all-reduce their
    gradients; so do whole experts over edp when FSDP2 does not shard them."""
    edp = world // ep

    def ring(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    gather = gathered_bytes_per_param(dtype)
    if uses_fsdp(dense_mode, world):
        reductions = grad_accum if grad_sync == "microbatch" else 1
        dense = dense_params * ring(world) * (2 * grad_accum * gather + 4 * reductions)
        experts = expert_params_local * expert_gathered * ring(edp) * (2 * grad_accum * gather + 4 * reductions)
    else:
        dense = dense_params * 4 * 2 * ring(world)
        experts = expert_params_local * 4 * 2 * ring(edp)
    return dense + experts
