"""Tiny Megatron-Core MoE layers with moe_dist routers, and the moe_dist reference they are
compared with (helpers for tests/test_megatron.py; run inside gloo processes).

Two MoE layers in a row (layer 2 reads layer 1's output, and the AC router clusters layer
2's tokens by their top-1 expert at layer 1), the same weights in both implementations.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from . import megatron_shim
from moe_dist.moe import RouterInputs

H, FFN, E, K = 16, 32, 4, 2
B, S = 4, 6  # batch split over ranks along B (whole sequences per rank)
AUX, Z = 0.01, 0.001
CAPACITY = 1.0  # capacity factor of the dropping cases (k * tokens / E slots per expert: some pairs drop)
ROUTERS = {
    "topk": {},
    "sinkhorn": {},
    "ac": {"start_layer": 1},  # the second layer uses the first one's clusters
    "symphony": {},
    "similarity": {},
}


def init_megatron(ep: int) -> None:
    megatron_shim.apply()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, create_gloo_process_groups=False)


def finish_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


GROUPS = (2, 1)  # group-limited cases: 2 groups of 2 experts, each token's experts from its best one


def config(dispatcher: str, load_balancing: str = "aux_loss", aux: float = AUX, z=Z, capacity=None, groups=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN,
                             moe_ffn_hidden_size=FFN, num_moe_experts=E, moe_router_topk=K,
                             moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type=load_balancing,
                             moe_aux_loss_coeff=aux, moe_z_loss_coeff=z, use_cpu_initialization=True,
                             moe_grouped_gemm=False, gated_linear_unit=True, activation_func=F.silu,
                             add_bias_linear=False, bias_activation_fusion=False, params_dtype=torch.float32,
                             moe_expert_capacity_factor=capacity, moe_token_drop_policy="probs",
                             moe_router_num_groups=groups[0] if groups else None,
                             moe_router_group_topk=groups[1] if groups else None)


def megatron_layers(dispatcher: str, router: str | None, options: dict | None = None, load_balancing="aux_loss",
                    aux: float = AUX, z=Z, capacity=None, groups=None) -> torch.nn.ModuleList:
    """Two Megatron-Core MoE layers; ``router=None`` keeps Megatron's own TopKRouter."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_dist.integrations.megatron import link_routers, use_moe_dist_router

    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    if router is not None:
        spec = use_moe_dist_router(spec, router=router, router_options=options)
    cfg = config(dispatcher, load_balancing, aux, z, capacity, groups)
    layers = torch.nn.ModuleList()
    for n in (1, 2):
        layer = MoELayer(cfg, spec.submodules.mlp.submodules, layer_number=n)
        layer.set_layer_number(n)
        layers.append(layer)
    link_routers(layers)
    return layers


def reference_layers(router: str, options: dict, capacity=None, groups=None) -> torch.nn.ModuleList:
    """Two moe_dist MoELayers (the single-process reference), seeded; with a capacity, the
    global scope and the ``probs`` drop policy."""
    from moe_dist.moe import MoEArgs, MoELayer

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        MoELayer(H, MoEArgs(d_ff=FFN, num_experts=E, top_k=K, router=router, router_options=options, aux_loss_coef=AUX,
                            z_loss_coef=Z, expert_kernel="loop", capacity_factor=capacity, drop_policy="probs",
                            capacity_scope="global", router_groups=groups[0] if groups else None,
                            max_groups_per_token=groups[1] if groups else None), layer_idx=i, init_std=0.15)
        for i in range(2))
    with torch.no_grad():  # O(1) router scores and outputs, so that an absolute tolerance means something
        for p in layers.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0.0, 0.5)
        for layer in layers:  # Symphony starts from a zero graph (zero gates): start from a random one instead
            if hasattr(layer.router, "A"):
                A = torch.rand(E, E)
                layer.router.A.copy_(A / A.sum(-1, keepdim=True))
    return layers


@torch.no_grad()
def copy_weights(ref: torch.nn.ModuleList, meg: torch.nn.ModuleList, megatron_router: bool = False) -> None:
    """moe_dist weights -> Megatron layers (this rank's experts; the router's whole state)."""
    for ours, theirs in zip(ref, meg):
        if megatron_router:
            theirs.router.weight.copy_(ours.router.weight)
        else:
            theirs.router.router.load_state_dict(ours.router.state_dict())
        for j, g in enumerate(theirs.local_expert_indices):
            mlp = theirs.experts.local_experts[j]
            mlp.linear_fc1.weight.copy_(torch.cat([ours.experts.w1[g].t(), ours.experts.w3[g].t()], 0))
            mlp.linear_fc2.weight.copy_(ours.experts.w2[g].t())


def expert_grads(layer, megatron: bool) -> dict[int, torch.Tensor]:
    """Global expert index -> its gradients flattened in moe_dist's layout."""
    out = {}
    if megatron:
        for j, g in enumerate(layer.local_expert_indices):
            mlp = layer.experts.local_experts[j]
            w1, w3 = mlp.linear_fc1.weight.grad.chunk(2, 0)
            out[g] = torch.cat([w1.t().reshape(-1), w3.t().reshape(-1), mlp.linear_fc2.weight.grad.t().reshape(-1)])
    else:
        ex = layer.experts
        for g in range(ex.num_experts):
            out[g] = torch.cat([ex.w1.grad[g].reshape(-1), ex.w3.grad[g].reshape(-1), ex.w2.grad[g].reshape(-1)])
    return out


def data(seed: int = 1):
    """Inputs ``[S, B, H]`` (Megatron's layout), labels for AC's layer 1 and loss weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=gen)
    w = torch.randn(S, B, H, generator=gen)
    return x, w


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's sequences of an ``[S, B, ...]`` batch (the ranks hold distinct tokens)."""
    per = t.shape[1] // world
    return t[:, rank * per:(rank + 1) * per].contiguous()


def padding(seed: int = 2) -> torch.Tensor:
    """``[B, S]`` bool, True = padding (Megatron's convention): the tail of every other sequence."""
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[::2, S // 2:] = True
    return pad


def run_megatron(layers, x, w, dp_size: int, pad: torch.Tensor | None = None) -> dict:
    """Forward both layers, a Megatron-style backward (the loss is this rank's token mean;
    gradients of replicated parameters are then averaged over the data-parallel ranks, expert
    gradients summed over their replicas and divided by the data-parallel size), the
    per-step hook, and a second forward. Returns outputs and gradients."""
    import torch.distributed as dist

    from moe_dist.integrations.megatron import after_optimizer_step, megatron_routers

    x = x.clone().requires_grad_()
    y1, _ = layers[0](x, padding_mask=pad)
    y2, _ = layers[1](x + y1, padding_mask=pad)
    loss = (y2 * w).sum() / (w.shape[0] * w.shape[1])
    loss.backward()
    router_grads = []
    for r in megatron_routers(layers):
        params = [p for p in r.parameters() if p.grad is not None]
        g = torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0)
        if dp_size > 1:
            dist.all_reduce(g)
        router_grads.append(g / dp_size)
    experts = [{e: v / dp_size for e, v in expert_grads(layer, True).items()} for layer in layers]
    after_optimizer_step(layers)
    with torch.no_grad():
        z1, _ = layers[0](x, padding_mask=pad)
        z2, _ = layers[1](x + z1, padding_mask=pad)
    dropped = torch.stack([r.stats.dropped.float() for r in megatron_routers(layers)])
    return {"y1": y1.detach(), "y2": y2.detach(), "x_grad": x.grad / dp_size, "router_grads": router_grads,
            "dropped": dropped,
            "expert_grads": experts, "z2": z2, "router_state": [dict(r.router.state_dict()) for r in megatron_routers(layers)]}


def run_reference(layers, x, w, pad: torch.Tensor | None = None) -> dict:
    """The same computation with moe_dist's own MoELayers on one process (tokens fed in
    [B, S] order, as moe_dist's model does; its padding mask is True for real tokens)."""
    xb, wb = x.transpose(0, 1).contiguous().requires_grad_(), w.transpose(0, 1)
    inputs = RouterInputs(batch_shape=(B, S), padding_mask=None if pad is None else ~pad)

    def forward(inp):
        y1 = layers[0](inp, inputs)
        prev_top1 = layers[0].last_routing.expert_ids[:, 0].detach()
        return y1, layers[1](inp + y1, replace(inputs, prev_top1=prev_top1))

    y1, y2 = forward(xb)
    loss = (y2 * wb).sum() / (S * B) + layers[0].aux_loss + layers[1].aux_loss
    loss.backward()
    router_grads = []
    for layer in layers:
        params = [p for p in layer.router.parameters() if p.grad is not None]
        router_grads.append(torch.cat([p.grad.reshape(-1) for p in params]) if params else torch.zeros(0))
    experts = [expert_grads(layer, False) for layer in layers]
    for layer in layers:
        layer.router.after_optimizer_step(layer.context)
        layer.context.step += 1
    with torch.no_grad():
        _, z2 = forward(xb)
    sb = lambda t: t.transpose(0, 1).detach()  # noqa: E731 - back to [S, B]
    return {"y1": sb(y1), "y2": sb(y2), "x_grad": sb(xb.grad), "router_grads": router_grads, "expert_grads": experts,
            "z2": sb(z2), "router_state": [dict(layer.router.state_dict()) for layer in layers]}
