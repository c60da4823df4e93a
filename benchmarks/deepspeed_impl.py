"""DeepSpeed-MoE (``deepspeed.moe.layer.MoE``) on the same sizes, weights and capacity
settings as the moe_dist layer, for comparison. Optional: needs the ``deepspeed`` extra."""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from .impls import Impl, _clear_grads
from .workload import Workload, imbalance


def deepspeed_available() -> tuple[bool, str]:
    """(importable, reason if not)."""
    if not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # also silences DeepSpeed's warning
    try:
        import deepspeed  # noqa: F401
        from deepspeed.moe.layer import MoE  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip these cases
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def init_deepspeed_comm() -> None:
    """Let DeepSpeed's comm layer adopt the already initialised torch.distributed group."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


class _SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False) if gated else None
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DeepSpeedImpl(Impl):
    """``deepspeed.moe.layer.MoE`` with ``ep_size`` ranks per expert-parallel group.

    Same gate weights as the reference top-k router and the second expert chosen by plain
    top-2 (``top2_2nd_expert_sampling=False``), so it routes like ``topk``; dropless maps to
    ``drop_tokens=False`` (DeepSpeed then pads every expert to the busiest one).
    """

    impl = "deepspeed"
    router = "topk"

    def __init__(self, work: Workload, ep_size: int):
        from deepspeed.moe.layer import MoE

        s, ref = work.sizes, work.reference
        self.work = work
        dropless = s.capacity_factor is None
        cf = 1.0 if dropless else s.capacity_factor
        moe = MoE(s.d_model, _SwiGLU(s.d_model, s.d_ff, s.activation == "swiglu"), num_experts=s.num_experts,
                  ep_size=ep_size, k=s.top_k, capacity_factor=cf, eval_capacity_factor=cf, min_capacity=s.min_capacity,
                  drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False)
        moe.set_deepspeed_parallelism()
        local = s.num_experts // ep_size
        first = torch.distributed.get_rank(moe.deepspeed_moe.ep_group) * local if ep_size > 1 else 0
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(ref.router.weight)
            for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                for name in ("w1", "w3", "w2"):
                    lin = getattr(expert, name)
                    if lin is not None:
                        lin.weight.copy_(getattr(ref.experts, name)[first + i].t())
        self.moe = moe.to(work.device, work.dtype).train()
        self.x = work.x.detach().clone().requires_grad_(True)
        self.params = list(self.moe.parameters())
        self.counts = None

    def step(self) -> None:
        _clear_grads(self.params + [self.x])
        out, l_aux, counts = self.moe(self.x)
        torch.autograd.backward([out, l_aux], [self.work.grad_out, torch.ones_like(l_aux)])
        self.counts = counts

    def info(self) -> dict:
        counts = [int(c) for c in self.counts.tolist()] if self.counts is not None else []
        return {"kernel": "loop", "imbalance": imbalance(counts) if counts else float("nan")}
