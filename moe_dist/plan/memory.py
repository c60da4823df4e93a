"""Per-GPU memory and communication of one training layout, from the model's shapes.

Conventions (those of moe_dist's trainer): weights, gradients and AdamW's two moments are
fp32 (4 + 4 + 8 bytes per parameter; the same 16 bytes as bf16 weights + grads + fp32
master/moments). Every rank holds distinct tokens (data-parallel size = world size); each
MoE layer's experts are split over ``ep`` ranks and replicated over ``edp = world / ep``.

ZeRO stages shard over the ranks that hold a copy: dense weights over all ``world`` ranks,
experts over their ``edp`` replicas. Stage 1 shards the optimizer state, 2 also the
gradients, 3 also the weights. moe_dist's own engine (``parallel.dense=fsdp``) is stage 3
for dense weights and stage 0 for experts (they are already split by expert parallelism);
``parallel.dense=replicate`` is stage 0 for both.

Activations are estimated from the tensors each block keeps for backward (elements per
token, activation dtype of ``e`` bytes): attention ``2d + (2H + 3KV) hd`` (norm in/out, q, k,
v, rotated q, k, output; fused attention keeps no S x S matrix), dense SwiGLU ``2d + 3 ff``,
MoE ``2d + k (2d + 3 ff_e)`` plus fp32 router scores, and ``V (e + 8)`` for logits with an fp32
cross-entropy. Routers that read attention probabilities add an fp32 ``H x S`` row per token.
With activation checkpointing each block keeps only its input (``d`` per token) and one block
is recomputed at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from .params import BlockShape

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
    attention_probs: bool = False  # the router reads [H, S, S] attention probabilities

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


def engine_state_bytes(dense_params: int, expert_params_local: int, world: int, dense_mode: str) -> dict[str, float]:
    """moe_dist's trainer: FSDP2 (dense sharded over all ranks, experts whole) or replicated."""
    shard = world if dense_mode == "fsdp" else 1
    return {"weights": (dense_params * 4) / shard + expert_params_local * 4,
            "grads": (dense_params * 4) / shard + expert_params_local * 4,
            "optimizer": (dense_params * 8) / shard + expert_params_local * 8}


def block_activation_elems(s: BlockShape, is_moe: bool, act_bytes: int, seq_len: int, attention_probs: bool) -> float:
    """Elements (in activation dtype units) kept per token by one block for backward."""
    attn = 2 * s.d_model + (2 * s.n_heads + 3 * s.n_kv_heads) * s.head_dim
    if is_moe:
        ffn = 2 * s.d_model + s.top_k * (2 * s.d_model + 3 * s.expert_d_ff) + 2 * s.num_experts * 4 / act_bytes
        if attention_probs:
            ffn += s.n_heads * seq_len * 4 / act_bytes
    else:
        ffn = 2 * s.d_model + 3 * s.d_ff
    return attn + ffn


def activation_bytes(s: BlockShape, w: Workload, checkpointing: bool) -> float:
    """Peak activation bytes of one micro-batch on one GPU."""
    moe = set(w.moe_blocks)
    per_block = [block_activation_elems(s, i in moe, w.act_bytes, w.seq_len, w.attention_probs) for i in range(w.n_layers)]
    logits = w.vocab_size * (w.act_bytes + 8) / w.act_bytes
    edges = 3 * s.d_model  # embedding output, final norm in/out
    if checkpointing:
        elems = w.n_layers * s.d_model + max(per_block) + logits + edges
    else:
        elems = sum(per_block) + logits + edges
    return elems * w.tokens * w.act_bytes


def fsdp_transient_bytes(dense_block_params: int, root_params: int, world: int) -> float:
    """Full fp32 copies FSDP2 gathers at once: the root unit (embeddings, head) and two blocks
    (the running one and the prefetched next)."""
    if world == 1:
        return 0.0
    return (root_params + 2 * dense_block_params) * 4.0


def all_to_all_bytes(s: BlockShape, w: Workload, ep: int, gpus_per_node: int, checkpointing: bool) -> dict[str, float]:
    """Bytes one GPU sends in expert all-to-alls per optimizer step (uniform routing: a token's
    k copies go to each of the ep ranks equally). Forward: dispatch + combine; backward: the
    same two in reverse; activation checkpointing repeats the forward pair."""
    if ep == 1 or not w.moe_blocks:
        return {"per_gpu": 0.0, "inter_node_per_gpu": 0.0, "collectives": 0}
    rows = w.tokens * s.top_k
    passes = 6 if checkpointing else 4
    per_layer = rows * s.d_model * w.act_bytes * (ep - 1) / ep
    per_gpu = per_layer * passes * len(w.moe_blocks) * w.grad_accum
    off_node = max(0, ep - gpus_per_node) / (ep - 1)  # EP groups are contiguous ranks
    return {"per_gpu": per_gpu, "inter_node_per_gpu": per_gpu * off_node,
            "collectives": passes * len(w.moe_blocks) * w.grad_accum}


def grad_sync_bytes(dense_params: int, expert_params_local: int, world: int, ep: int, dense_mode: str,
                    grad_accum: int) -> float:
    """Bytes one GPU sends for weights and gradients per step (ring collectives): FSDP2
    gathers dense weights in forward and backward of each micro-batch and reduce-scatters the
    gradients once; replicated weights all-reduce their gradients; experts all-reduce over edp."""
    edp = world // ep
    ring = (world - 1) / world if world > 1 else 0.0
    if dense_mode == "fsdp":
        dense = dense_params * 4 * ring * (2 * grad_accum + 1)
    else:
        dense = dense_params * 4 * 2 * ring
    experts = expert_params_local * 4 * 2 * ((edp - 1) / edp if edp > 1 else 0.0)
    return dense + experts
