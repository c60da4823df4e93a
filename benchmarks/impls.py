"""The implementations a benchmark case compares. Each does one forward + backward per
``step()`` on its workload and reports what it did in ``info()``.

- ``moe_dist``: :class:`moe_dist.moe.MoELayer` with any registered router.
- ``floor``: only the expert computation, on the rows the reference router sends to each
  expert, already grouped: a batched matmul on a padded ``[E, max rows, d]`` tensor,
  ``torch._grouped_mm``, or a loop over experts. The fastest of them is the floor.
- ``deepspeed``: ``deepspeed.moe.layer.MoE`` (see :mod:`benchmarks.deepspeed_impl`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from moe_dist.distributed import ParallelGroups
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routing.types import RouterInputs
from moe_dist.parallel import apply_expert_parallel
from moe_dist.tuning.expert_kernel import agree_expert_kernels
from .attention_inputs import synthetic_attention_inputs
from .workload import Workload, imbalance

FLOOR_KERNELS = ("bmm", "grouped_mm", "loop")


class Impl:
    impl: str = ""
    router: str = "-"
    kernel: str = "-"

    def step(self) -> None:
        raise NotImplementedError

    def info(self) -> dict:
        return {}


def _clear_grads(tensors) -> None:
    for t in tensors:
        t.grad = None


class MoEDistImpl(Impl):
    """This project's layer. ``groups`` decides expert parallelism (``ep_size``) and which
    ranks share router statistics (``dp``); ``ep_size == 1`` on several processes is the
    no-expert-parallel control."""

    impl = "moe_dist"

    def __init__(self, work: Workload, router: str, groups: ParallelGroups, router_options: Optional[dict] = None,
                 expert_kernel: str = "loop"):
        s, ref = work.sizes, work.reference
        self.work, self.router = work, router
        layer = MoELayer(s.d_model, MoEArgs(d_ff=s.d_ff, num_experts=s.num_experts, top_k=s.top_k, router=router,
                                            router_options=router_options or {}, activation=s.activation,
                                            capacity_factor=s.capacity_factor, min_capacity=s.min_capacity,
                                            expert_kernel=expert_kernel))
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                w = getattr(layer.experts, name)
                if w is not None:
                    w.copy_(getattr(ref.experts, name))
            # same scores (and the same skew) as the reference router; a wrapping router's base scores
            w = getattr(layer.router.scorer, "weight", None)
            if isinstance(w, torch.Tensor) and w.shape == ref.router.weight.shape:
                w.copy_(ref.router.weight)
        if groups.ep_size > 1:
            apply_expert_parallel(layer, groups)
        else:
            layer.set_groups(groups)
        self.layer = layer.to(work.device, work.dtype).train()
        if expert_kernel == "auto":  # what the trainer does: one kernel, decided once over all ranks
            agree_expert_kernels(self.layer, work.tokens * s.top_k, work.dtype, work.device, seed=work.seed)
        needs = self.layer.attention_needs  # what a model's attention sub-layer would hand over
        self.inputs = RouterInputs(
            batch_shape=work.batch_shape, prev_top1=work.prev_top1,
            attention=synthetic_attention_inputs(work.x, heads=s.heads, kv_heads=s.kv_heads, form=needs) if needs else None)
        self.x = work.x.detach().clone().requires_grad_(True)
        self.params = list(self.layer.parameters())
        self.one = torch.ones((), device=work.device)

    def step(self) -> None:
        _clear_grads(self.params + [self.x])
        self.layer.context.step += 1  # routers with per-step coins (SSR) see a training run's mix of steps
        out = self.layer(self.x, self.inputs)
        torch.autograd.backward([out, self.layer.aux_loss], [self.work.grad_out, self.one.to(self.layer.aux_loss.dtype)])

    def info(self) -> dict:
        st = self.layer.stats
        counts = [int(c) for c in st.expert_counts.tolist()]
        return {"kernel": getattr(self.layer.experts, "last_kernel", self.layer.experts.kernel),
                "dropped": float(st.dropped) / max(1.0, float(st.pairs)), "imbalance": imbalance(counts)}


class FloorImpl(Impl):
    """The bare expert computation (forward and backward, input and weight gradients) on
    the reference routing's grouped rows, with one of three kernels."""

    impl = "floor"

    def __init__(self, work: Workload, kernel: str):
        if kernel not in FLOOR_KERNELS:
            raise ValueError(f"floor kernel {kernel!r}; allowed: {list(FLOOR_KERNELS)}")
        self.work, self.kernel = work, kernel
        ref = work.reference.experts
        self.swiglu = ref.activation == "swiglu"
        self.w = [getattr(ref, n).detach().to(work.device, work.dtype).requires_grad_(True)
                  for n in (("w1", "w3", "w2") if self.swiglu else ("w1", "w2"))]
        rows, self.counts = work.routed()
        d = rows.shape[1]
        gen = torch.Generator().manual_seed(work.seed + 17)
        grad_rows = torch.randn(rows.shape, generator=gen).to(work.device, work.dtype)
        if kernel == "bmm":
            cap = max(self.counts)
            self.x = rows.new_zeros((len(self.counts), cap, d))
            self.gy = grad_rows.new_zeros((len(self.counts), cap, d))
            start = 0
            for e, c in enumerate(self.counts):
                self.x[e, :c], self.gy[e, :c] = rows[start : start + c], grad_rows[start : start + c]
                start += c
        else:
            self.x, self.gy = rows, grad_rows
        self.x.requires_grad_(True)
        if kernel == "loop":  # separate leaves per expert: no slicing in the autograd graph
            self.w = [[w[e].detach().clone().requires_grad_(True) for w in self.w] for e in range(len(self.counts))]
            self.x = [c.detach().clone().requires_grad_(True) for c in rows.split(self.counts)]
            self.gy = list(grad_rows.split(self.counts))
        self.offs = torch.cumsum(torch.tensor(self.counts, dtype=torch.int32), 0, dtype=torch.int32).to(work.device)
        self.supported = kernel != "grouped_mm" or (hasattr(torch, "_grouped_mm")
                                                    and work.reference.experts.grouped_mm_supported(work.dtype))

    def _ffn(self, mm, x, w):
        if self.swiglu:
            w1, w3, w2 = w
            return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)
        w1, w2 = w
        return mm(F.gelu(mm(x, w1)), w2)

    def step(self) -> None:
        if self.kernel == "loop":
            _clear_grads([t for ws in self.w for t in ws] + self.x)
            pairs = [(self._ffn(torch.mm, x, w), g) for x, w, g in zip(self.x, self.w, self.gy) if x.shape[0]]
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
            return
        _clear_grads(self.w + [self.x])
        if self.kernel == "bmm":
            y = self._ffn(torch.bmm, self.x, self.w)
        else:
            y = self._ffn(lambda a, b: torch._grouped_mm(a, b, offs=self.offs), self.x, self.w)
        y.backward(self.gy)

    def info(self) -> dict:
        return {"kernel": self.kernel, "imbalance": imbalance(self.counts), "dropped": 0.0}
