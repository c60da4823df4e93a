"""The MoE layer on an accelerator against the same layer on the CPU, for every registered router.

Runs only when ``MOE_DIST_TEST_DEVICE`` names a usable device (``cuda``, or ``cpu`` to test this
file's own logic); skipped otherwise, so the default CPU suite skips it:

    MOE_DIST_TEST_DEVICE=cuda python -m pytest -q tests/test_device_layer.py

Each case builds one layer from a seed on the CPU (fp32), copies it to the device, and runs two
training calls on both with the same inputs (sequence structure, padding, the previous layer's
top-1, the attention before the layer: whatever a router may read), calling
``after_optimizer_step()`` after each. Compared: outputs, the chosen experts, aux loss and the
layer's statistics, input gradients (the attention inputs' too), every parameter's gradient and
the router's state after the step. fp32 on the device runs with TF32 off, so differences are
rounding only (reduction order). A bf16 autocast forward and backward on the device must be finite.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from benchmarks.attention_inputs import synthetic_attention_inputs
from moe_dist.moe import MoEArgs, MoELayer, RouterInputs
from moe_dist.moe.routers import ROUTERS
from moe_dist.moe.routers import base as router_base

DEVICE_ENV = "MOE_DIST_TEST_DEVICE"


def _unusable(name: str) -> str | None:
    """Why the device ``name`` cannot run these tests, or None when it can."""
    if not name:
        return f"{DEVICE_ENV} is not set (e.g. {DEVICE_ENV}=cuda); this file compares a device with the CPU"
    try:
        torch.empty(1, device=name).add_(1)
    except Exception as e:  # a device torch does not know, or has no driver for
        return f"{DEVICE_ENV}={name}: the device is not available ({type(e).__name__}: {str(e).splitlines()[0]})"
    return None


DEVICE_NAME = os.environ.get(DEVICE_ENV, "").strip()
_reason = _unusable(DEVICE_NAME)
if _reason:
    pytest.skip(_reason, allow_module_level=True)
DEVICE = torch.device(DEVICE_NAME)

# fp32 on both sides; only the order of floating-point sums differs between CPU and device
RTOL = 1e-4
ATOL_OF_SCALE = 1e-5  # absolute tolerance as a fraction of the reference's largest magnitude
B, S, D_MODEL, D_FF, E, K = 2, 16, 32, 64, 8, 2
CALLS = 2  # training calls per case, after_optimizer_step() after each (the second reads the first's state)

# options that reach each router's device paths (noise, Sinkhorn on every call, the k schedule, the AC
# clusters, Symphony's bias correction); a router not listed runs with its defaults. Sinkhorn runs a
# fixed number of iterations (a tolerance it never reaches), so both sides stop at the same iteration.
FIXED_SINKHORN = {"tol": 1e-12, "max_iters": 24}
ROUTER_OPTIONS = {
    "ssr": {"p": 1.0, "noise_alpha": 1.0, **FIXED_SINKHORN},
    "sinkhorn": dict(FIXED_SINKHORN),
    "hyper": {"k_max": 4, "k_schedule_steps": 8, "embed_dim": 16, "hyper_dim": 32},
    "smoe_dropout": {"k_max": 4, "k_schedule_steps": 8},
    "ac": {"start_layer": 0},
    "symphony": {"bias_correction": True},
}


@pytest.fixture(autouse=True)
def _exact_fp32_and_cpu_noise(monkeypatch):
    """TF32 off (fp32 matmuls stay fp32 on the GPU), and the routers' training noise drawn on the
    CPU and moved: a CUDA generator draws other numbers than the CPU's from the same seed, which is
    not what these tests compare (``test_device_noise_is_standard_normal`` checks the device's own draw)."""
    if DEVICE.type == "cuda":
        try:
            monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        except RuntimeError:  # torch versions that refuse the legacy flag once the new one was used
            monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    original = router_base.layout_invariant_normal

    def cpu_noise(shape_tail, ctx, local_tokens, salt, device):
        return original(shape_tail, ctx, local_tokens, salt, "cpu").to(device)

    for module in _modules_using_noise():
        monkeypatch.setattr(module, "layout_invariant_normal", cpu_noise)


def _modules_using_noise() -> list:
    """Every router module that calls ``layout_invariant_normal`` by its own name (not ``base``,
    where it is defined: ``test_device_noise_is_standard_normal`` reads it there)."""
    import sys

    return [m for name, m in list(sys.modules.items())
            if name.startswith("moe_dist.moe.routers.") and m is not router_base
            and getattr(m, "layout_invariant_normal", None) is router_base.layout_invariant_normal]


# ---- one case: the same layer and calls on the CPU and on the device ------------------------------
def make_layer(router: str, capacity_factor=None, expert_kernel: str = "loop", **extra) -> MoELayer:
    torch.manual_seed(0)
    args = MoEArgs(d_ff=D_FF, num_experts=E, top_k=K, router=router, router_options=ROUTER_OPTIONS.get(router, {}),
                   capacity_factor=capacity_factor, expert_kernel=expert_kernel, **extra)
    return MoELayer(D_MODEL, args)


def call_inputs(layer: MoELayer, call: int) -> dict:
    """CPU tensors of one call: the input, the upstream gradient's weights and what the model hands
    the router (padding: the last token of each sequence; labels: a previous layer's top-1)."""
    g = torch.Generator().manual_seed(100 + call)
    x = torch.randn(B, S, D_MODEL, generator=g)
    w = torch.randn(B, S, D_MODEL, generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -1] = False
    labels = torch.randint(0, E, (B * S,), generator=g)
    need = layer.attention_needs
    attention = synthetic_attention_inputs(x, heads=4, seed=call, form=need) if need else None
    return {"x": x, "w": w, "mask": mask, "labels": labels, "attention": attention}


def _leaf(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().to(device).requires_grad_(t.requires_grad)


def run_calls(layer: MoELayer, device: torch.device, autocast: torch.dtype | None = None) -> list[dict]:
    """``CALLS`` training calls of ``layer`` (already on ``device``); per call a record of CPU tensors."""
    layer.train()
    records = []
    for call in range(CALLS):
        cpu = call_inputs(layer, call)
        x = _leaf(cpu["x"], device).requires_grad_(True)
        attention = cpu["attention"]
        if attention is not None:
            attention = dataclasses.replace(attention, **{f.name: _leaf(getattr(attention, f.name), device)
                                                          for f in dataclasses.fields(attention)})
        inputs = RouterInputs(batch_shape=(B, S), padding_mask=cpu["mask"].to(device),
                              prev_top1=cpu["labels"].to(device), attention=attention)
        ctx = layer.context
        ctx.step, ctx.micro_step, ctx.seed, ctx.layer_idx = 3 + call, 0, 11, 0
        for p in layer.parameters():
            p.grad = None
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            y = layer(x, inputs)
        loss = (y.float() * cpu["w"].to(device)).sum() / (B * S) + layer.aux_loss
        loss.backward()
        layer.after_optimizer_step()
        records.append(_record(layer, y, x, attention))
    return records


def _record(layer: MoELayer, y, x, attention) -> dict:
    s = layer.stats
    out = {"out": y, "x_grad": x.grad, "aux_loss": layer.aux_loss,
           "expert_ids": layer.last_routing.expert_ids.sort(dim=-1).values,
           "counts": s.expert_counts, "dropped": s.dropped, "z_loss": s.z_loss, "entropy": s.entropy}
    if attention is not None:
        for f in dataclasses.fields(attention):
            t = getattr(attention, f.name)
            if t is not None and t.grad is not None:
                out[f"attention.{f.name}_grad"] = t.grad
    for name, p in layer.named_parameters():
        if p.grad is not None:
            out[f"grad {name}"] = p.grad
    for name, v in _router_state(layer.router).items():
        out[f"router state {name}"] = v
    return {k: v.detach().cpu() for k, v in out.items() if torch.is_tensor(v)}


def _router_state(router) -> dict:
    state = dict(router.state_dict())
    for name in ("last_dual", "last_weights"):  # per-call router state kept outside the state dict
        value = getattr(router, name, None)
        if torch.is_tensor(value):
            state[name] = value
    return state


def assert_same(ref: list[dict], got: list[dict], what: str) -> None:
    for call, (r, g) in enumerate(zip(ref, got)):
        assert set(r) == set(g), f"{what} call {call}: recorded {sorted(set(r) ^ set(g))} on one side only"
        if not torch.equal(r["expert_ids"], g["expert_ids"]):
            rows = (r["expert_ids"] != g["expert_ids"]).any(-1).nonzero().flatten().tolist()
            raise AssertionError(f"{what} call {call}: the device chose other experts for tokens {rows} "
                                 f"(CPU {r['expert_ids'][rows].tolist()}, device {g['expert_ids'][rows].tolist()})")
        first = ["out", "aux_loss", "x_grad"]  # the layer's results first: the clearest message
        for key in first + sorted(set(r) - set(first)):
            a, b = r[key], g[key]
            assert a.shape == b.shape, f"{what} call {call}: {key} shape {tuple(b.shape)} != CPU {tuple(a.shape)}"
            if not (a.is_floating_point() or b.is_floating_point()):
                assert torch.equal(a, b), f"{what} call {call}: {key} {b.tolist()} != CPU {a.tolist()}"
                continue
            atol = ATOL_OF_SCALE * max(float(a.double().abs().max()) if a.numel() else 0.0, 1e-30)
            torch.testing.assert_close(b.double(), a.double(), rtol=RTOL, atol=atol,
                                       msg=lambda m, key=key: f"{what} call {call}: {key}: {m}")


def compare_with_cpu(router: str, capacity_factor=None, expert_kernel: str = "loop", **extra) -> None:
    reference = make_layer(router, capacity_factor, expert_kernel, **extra)
    on_device = copy.deepcopy(reference).to(DEVICE)
    ref = run_calls(reference, torch.device("cpu"))
    got = run_calls(on_device, DEVICE)
    cf = "dropless" if capacity_factor is None else f"capacity factor {capacity_factor}"
    assert_same(ref, got, f"router {router}, {cf}, kernel {expert_kernel}, {DEVICE}")


# ---- the tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity1.0"])
@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_layer_matches_cpu(router, capacity_factor):
    compare_with_cpu(router, capacity_factor)


@pytest.mark.parametrize("kernel", ["loop", "bmm", "grouped_mm"])
def test_expert_kernel_matches_cpu(kernel):
    compare_with_cpu("topk", 1.0, kernel)


def test_expert_bias_and_probs_drops_match_cpu():
    """The aux-loss-free expert bias (updated in after_optimizer_step) and the probs drop policy."""
    compare_with_cpu("topk", 0.75, expert_bias=True, expert_bias_rate=0.05, drop_policy="probs")


def _finite_bf16_step(layer: MoELayer) -> None:
    records = run_calls(layer.to(DEVICE), DEVICE, autocast=torch.bfloat16)
    for call, rec in enumerate(records):
        for key, t in rec.items():
            if t.is_floating_point():
                assert torch.isfinite(t).all(), f"bf16 autocast call {call}: {key} is not finite"
    assert layer.last_routing.probs.dtype == torch.float32, "router math must stay fp32 under autocast"


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_router_layer_bf16_autocast_is_finite(router):
    _finite_bf16_step(make_layer(router, 1.0))


@pytest.mark.parametrize("kernel", ["loop", "bmm", "grouped_mm"])
def test_expert_kernel_bf16_autocast_is_finite(kernel):
    _finite_bf16_step(make_layer("topk", None, kernel))


def test_device_noise_is_standard_normal():
    """The routers' noise drawn by the device's own generator (unpatched): the right shape, finite,
    mean 0 and std 1, the same on every draw of the same key."""
    ctx = MoELayer(D_MODEL, MoEArgs(d_ff=D_FF, num_experts=E, top_k=K)).context
    draw = router_base.layout_invariant_normal
    a = draw((E,), ctx, 4096, 1, DEVICE)
    b = draw((E,), ctx, 4096, 1, DEVICE)
    assert a.shape == (4096, E) and a.device.type == DEVICE.type and torch.isfinite(a).all()
    assert torch.equal(a, b), "the same (seed, step, layer, salt) must draw the same noise"
    assert abs(float(a.mean())) < 0.05 and abs(float(a.std()) - 1.0) < 0.05, (float(a.mean()), float(a.std()))


def test_the_comparison_sees_a_small_difference():
    """Negative control: one expert weight off by 1e-3 of its size on the device side fails the comparison."""
    reference = make_layer("topk")
    on_device = copy.deepcopy(reference).to(DEVICE)
    with torch.no_grad():
        on_device.experts.w2[0, 0, 0] += 1e-3 * float(on_device.experts.w2.abs().max())
    with pytest.raises(AssertionError, match="perturbed call 0: out: Tensor-likes are not close"):
        assert_same(run_calls(reference, torch.device("cpu")), run_calls(on_device, DEVICE), "perturbed")
