"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine schedule."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ...parallel import expert_parameters


def build_optimizer(model: nn.Module, train_cfg) -> torch.optim.AdamW:
    """Parameter groups: dense matrices (decay), dense vectors (no decay), experts (decay).

    Experts get their own group because under FSDP2 dense parameters are DTensors and
    experts plain tensors, and the fused (or foreach) kernels must not mix the two. The fused
    AdamW where the device has it, else foreach; a checkpoint's parameter groups bring back the
    kernel they were saved with.
    """
    experts = {id(p) for p in expert_parameters(model)}
    seen: set[int] = set()
    dense_decay, dense_plain, expert = [], [], []
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in experts:
            expert.append(p)
        elif p.dim() >= 2:
            dense_decay.append(p)
        else:
            dense_plain.append(p)
    groups = [{"params": dense_decay, "weight_decay": train_cfg.weight_decay, "name": "dense"},
              {"params": dense_plain, "weight_decay": 0.0, "name": "dense_no_decay"},
              {"params": expert, "weight_decay": train_cfg.weight_decay, "name": "experts"}]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=1e-8)
    try:  # one fused kernel per parameter group: faster than foreach on the CPUs measured (benchmarks/results/training.md)
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except RuntimeError:  # a device without the fused kernel
        return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_at(step: int, train_cfg) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up to ``lr``, then cosine
    down to ``lr * min_lr_ratio`` at the last step."""
    peak, steps = train_cfg.lr, train_cfg.steps
    warmup = min(train_cfg.warmup_steps, steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * train_cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
