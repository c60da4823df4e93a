"""A test router, registered as ``_test_probe``: top-k routing that asks for attention
probabilities and records what the model gave it (import this module to register it, also in
spawned ranks)."""
from moe_dist.moe.routers import register_router
from moe_dist.moe.routers.topk import TopKRouter
from moe_dist.moe.routing.types import is_recomputing


@register_router("_test_probe")
class ProbeRouter(TopKRouter):
    """Top-k routing that asks for attention probabilities and records what it was given."""

    attention_needs = "probs"

    def __init__(self, d_model, num_experts, top_k, *, normalize=None, noisy=False, init_std=0.02):
        super().__init__(d_model, num_experts, top_k, normalize=normalize, noisy=noisy, init_std=init_std)
        self.seen, self.invocations, self.optimizer_steps = [], 0, []

    def route(self, x, ctx, inputs):
        self.invocations += 1
        if not is_recomputing():  # a stateful router's side effects happen once per forward
            probs = None if inputs.attention is None else inputs.attention.probs
            self.seen.append({"batch_shape": inputs.batch_shape, "causal": inputs.causal, "step": ctx.step,
                              "micro_step": ctx.micro_step, "seed": ctx.seed,
                              "prev_top1": None if inputs.prev_top1 is None else inputs.prev_top1.clone(),
                              "attn_probs": None if probs is None else probs.detach().clone(),
                              "padding_mask": inputs.padding_mask, "tokens": x.shape[0]})
        return super().route(x, ctx, inputs)

    def after_optimizer_step(self, ctx):
        self.optimizer_steps.append(ctx.step)
