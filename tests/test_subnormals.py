"""No router computes on subnormal floats for ordinary inputs.

x86 cores run arithmetic on subnormal (denormal) values on a slow microcode path, tens of times
slower than on normal ones, and no equality test notices: the results are right, only late.
A ``TorchDispatchMode`` looks at every tensor each operator produces in a forward and backward
of every registered router's layer, at the width of a real model (d_model 512, where similarity
logits span hundreds), in fp32 and bf16, and fails on the first operator that produced
subnormal values, naming it.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.attention_inputs import synthetic_attention_inputs
from moe_dist.moe import MoEArgs, MoELayer, RouterInputs, ROUTERS

# Allocation ops return uninitialised memory (whatever bytes were there): not computed values.
UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
B, S, D, E = 2, 128, 512, 8


class SubnormalCounter(TorchDispatchMode):
    """Per operator: (subnormal values, values) over every floating-point tensor it produced.
    Views are skipped (they show values another operator produced)."""

    def __init__(self):
        super().__init__()
        self.hits: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if schema.name.split("::")[-1] in UNINITIALISED:
            return out
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                a = t.detach().abs()
                n = int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
                if n:
                    hit = self.hits.setdefault(str(func), [0, 0])
                    hit[0] += n
                    hit[1] += t.numel()
        return out

    def describe(self) -> str:
        return "\n".join(f"  {op}: {n:,} subnormal of {total:,} values"
                         for op, (n, total) in sorted(self.hits.items(), key=lambda kv: -kv[1][0]))


def _layer(router: str, options: dict) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, MoEArgs(d_ff=2 * D, num_experts=E, top_k=2, router=router, router_options=options,
                                expert_kernel="loop"))
    return layer.train()


def _run(layer: MoELayer, dtype: torch.dtype, form: str = "scores") -> SubnormalCounter:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_(True)
    ctx = layer.context
    ctx.step, ctx.seed = 1, 3
    prev_top1 = torch.randint(0, E, (B * S,), generator=g)
    attention = synthetic_attention_inputs(x.detach(), heads=8, form=form) if layer.attention_needs else None
    inputs = RouterInputs(batch_shape=(B, S), prev_top1=prev_top1, attention=attention)
    counter = SubnormalCounter()
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = layer(x, inputs)
        (y.float().square().mean() + layer.aux_loss).backward()
    return counter


CASES = [(name, {}, "scores") for name in sorted(ROUTERS)] + [
    ("similarity", {"similarity": "cosine", "learn_similarity": True}, "scores"),
    ("attention", {}, "probs"),
    ("similarity", {"graph_dtype": "bf16"}, "scores"),
    ("attention", {"graph_dtype": "bf16"}, "scores"),
    ("ssr", {"p": 1.0}, "scores"),  # Sinkhorn on every call
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("router,options,form", CASES,
                         ids=[f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}{'-probs' if f == 'probs' else ''}"
                              for n, o, f in CASES])
def test_no_subnormal_values(router, options, form, dtype):
    counter = _run(_layer(router, options), dtype, form)
    assert not counter.hits, f"router {router} {options} ({dtype}) produced subnormal floats:\n{counter.describe()}"


def test_counter_sees_subnormals():
    """Positive control: a product that underflows into the subnormal range is caught, by name."""
    counter = SubnormalCounter()
    with counter:
        torch.full((4,), 1e-30) * torch.full((4,), 1e-10)
        torch.empty(1000)  # uninitialised memory is not a computed value
    assert list(counter.hits) == ["aten.mul.Tensor"] and counter.hits["aten.mul.Tensor"] == [4, 4]
