"""Apply parallelism to a model (built on the meta device, or for one process), and finish its gradients.

Experts: expert parallelism keeps each rank's slice (global init kept); the replicas of the
same experts (the expert-data-parallel group) shard them with FSDP2 when the dense weights
use FSDP2 (gradients reduce-scattered), else sum their gradients. Dense weights: FSDP2
``fully_shard`` over all data-parallel ranks (one unit per block plus the root), or
replicated with summed gradients. Every reduction is a plain SUM, which matches the
loss-shares convention (each rank's loss is its share of the global loss).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.bootstrap import Runtime
from ..distributed.ranges import COLLECTIVE, timed_range
from ..model.init import is_meta, materialize
from ..moe import moe_layers
from ..moe.routers import synchronize_frozen_routers
from .expert_parallel import apply_expert_parallel, dense_parameters, expert_parameters
from .expert_shard import shard_dim
from .grad_sync import sync_gradients


class Parallelized:
    """What the trainer needs to know about how ``model`` is spread."""

    def __init__(self, model: nn.Module, rt: Runtime, dense: str, grad_sync: str = "step"):
        self.model, self.rt, self.dense, self.grad_sync = model, rt, dense, grad_sync
        self.fsdp = dense == "fsdp" and rt.distributed
        self.sharded_experts = shards_experts(rt, dense)

    def set_gradient_sync(self, enabled: bool) -> None:
        """FSDP2 (``parallel.grad_sync``): ``step`` skips the reduce-scatter on micro-batches before
        the last one of a step (each unit keeps its unsharded gradient until then); ``microbatch``
        reduce-scatters after every micro-batch, FSDP2 summing into the sharded gradient."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(enabled or self.grad_sync == "microbatch")

    def finish_gradients(self) -> None:
        """After the last backward of a step: sum what FSDP did not already reduce."""
        groups = self.rt.groups
        if self.fsdp:  # dense gradients were reduce-scattered by FSDP; experts too when sharded over edp
            sync_gradients(self.model, dataclasses.replace(groups, dp=None, edp=None if self.sharded_experts else groups.edp))
        else:
            sync_gradients(self.model, groups)

    def grad_norm(self) -> torch.Tensor:
        """The true global gradient norm: every dense weight and every expert counted once."""
        dense_sq = _sum_of_squares(dense_parameters(self.model), self.rt.device)
        expert_sq = _sum_of_squares(expert_parameters(self.model), self.rt.device)
        with timed_range(COLLECTIVE):
            if self.fsdp:  # each rank holds a different shard of the dense gradients
                dist.all_reduce(dense_sq, group=self.rt.groups.dp)
            if self.sharded_experts:  # each expert's gradient is split over its edp ranks: every rank holds a distinct part
                dist.all_reduce(expert_sq, group=self.rt.groups.dp)
            elif self.rt.groups.ep_size > 1:  # an expert-parallel group holds every expert exactly once
                dist.all_reduce(expert_sq, group=self.rt.groups.ep)
        return (dense_sq + expert_sq).sqrt()

    def clip_gradients(self, max_norm: Optional[float]) -> float:
        """Scale all gradients so the global norm is at most ``max_norm``; returns the norm before."""
        norm = float(self.grad_norm())
        if max_norm is not None and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            torch._foreach_mul_(_local_grads(self.model.parameters()), scale)
        return norm


def _local_grads(params) -> list[torch.Tensor]:
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]


def _sum_of_squares(params, device: torch.device) -> torch.Tensor:
    """Sum of squared gradient entries (per-tensor norms in the gradient dtype, summed in fp64)."""
    grads = [g for g in _local_grads(params) if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


def shards_experts(rt: Runtime, dense: str) -> bool:
    """Whether expert weights are sharded over the expert-data-parallel ranks (FSDP2 on the
    ``edp`` mesh): with FSDP2 for the dense weights, whenever several ranks hold the same experts."""
    return dense == "fsdp" and rt.distributed and rt.groups.edp_size > 1


def mixed_precision(dtype: str):
    """FSDP2's policy for ``train.dtype``: bf16 gathers bf16 copies of the fp32 master weights
    (half the bytes of fp32) and reduces gradients in fp32; fp32 changes nothing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def expert_placement(edp: int, choice: str) -> Callable[[nn.Parameter], object]:
    """FSDP2's ``shard_placement_fn`` for an MoE layer's experts: ``Shard(d)`` with the dimension
    :func:`moe_dist.parallel.expert_shard.shard_dim` picks for the parameter's shape."""
    from torch.distributed.tensor import Shard

    return lambda p: Shard(shard_dim(tuple(p.shape), edp, choice))


def _fully_shard(model: nn.Module, rt: Runtime, reshard_after_forward: bool, dtype: str = "fp32",
                 expert_shard: str = "auto") -> None:
    """FSDP2 units: under bf16 the routers, all in one unit (their math stays fp32, so they are
    gathered in fp32 whatever ``train.dtype``; one unit: one gather and one reduce-scatter per step
    for all of them, not one per layer), each MoE layer's experts over the ``edp`` ranks (the
    replicas of those experts: weights, gradients and optimizer state split edp ways, on the
    dimension ``parallel.expert_shard`` picks, gradients reduce-scattered during backward), then
    each block, the embedding and the output projection
    (:func:`_edge_units`) and the root over every data-parallel rank for the rest."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    policy, fp32 = mixed_precision(dtype), mixed_precision("fp32")
    sharded_experts = shards_experts(rt, "fsdp")
    routers = [layer.router for layer in moe_layers(model)
               if dtype != "fp32" and any(p.requires_grad for p in layer.router.parameters())]
    if routers:
        fully_shard(routers, mesh=rt.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=fp32)
    for layer in moe_layers(model):
        if sharded_experts:
            fully_shard(layer.experts, mesh=rt.edp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=policy, shard_placement_fn=expert_placement(rt.groups.edp_size, expert_shard))
    experts = set() if sharded_experts else set(expert_parameters(model))  # else left out of the dense units
    units = list(getattr(model, "blocks", [])) + _edge_units(model)
    for unit in units:
        fully_shard(unit, mesh=rt.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params={p for p in unit.parameters() if p in experts})
    fully_shard(model, mesh=rt.dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                ignored_params=experts)
    for m in model.modules():
        if isinstance(m, FSDPModule):  # SUM, not mean; gloo has no PREMUL_SUM, so force plain sums
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _edge_units(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output projection, each an FSDP2 unit of its own when they are
    not tied (as torchtitan does). In the root unit both were gathered at the start of every forward
    and held to its end, beside FSDP2's all-gather buffer of the same size; now each is gathered only
    while it runs. Tied, they stay in the root."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if not (isinstance(embed, nn.Module) and isinstance(head, nn.Module)):
        return []
    if any(p is q for p in embed.parameters() for q in head.parameters()):
        return []
    return [embed, head]


def parallelize(model: nn.Module, rt: Runtime, parallel_cfg,
                fill: Optional[Callable[[nn.Module], None]] = None, dtype: str = "fp32") -> Parallelized:
    """Expert parallelism, then FSDP2 or replication for the dense weights (in place).

    A model built on the meta device (``build_model(..., device="meta")``) is split first and
    then only this rank's part is allocated on ``rt.device`` and filled by ``fill(model)``
    (:func:`moe_dist.model.init.init_weights` or a checkpoint's rows): no rank ever holds the
    whole model. A model built for real is moved to ``rt.device`` and sliced (small models).
    ``dtype``: ``train.dtype``; with FSDP2, bf16 gathers bf16 weights (:func:`mixed_precision`)."""
    meta = is_meta(model)
    if meta and fill is None:
        raise ValueError("parallelize: a model on the meta device needs fill= (how to set its weights)")
    if not meta:
        model.to(rt.device)
    apply_expert_parallel(model, rt.groups)
    fsdp = parallel_cfg.dense == "fsdp" and rt.distributed
    if fsdp:
        _fully_shard(model, rt, parallel_cfg.reshard_after_forward, dtype,
                     parallel_cfg.expert_shard)
    if meta:
        fill(materialize(model, rt.device))
    if rt.distributed:  # frozen routers (HyperRouter, SMoE-Dropout): broadcast from rank 0, hash-checked
        synchronize_frozen_routers(model, rt.groups.dp)
    if rt.distributed and not fsdp:
        for p in dense_parameters(model):  # replicas start equal by construction; make sure of it
            dist.broadcast(p.data, src=0, group=rt.groups.dp)
    return Parallelized(model, rt, parallel_cfg.dense, parallel_cfg.grad_sync)
