"""A test router, registered as ``_test_probe``: top-k routing that asks for attention
probabilities and records what the model gave it (import this module to register it, also in
spawned ranks)."""
from moe_dist.moe.routers import register_router
from moe_dist.moe.routers.topk import TopKRouter
from moe_dist.moe.routing import is_recomputing


@register_router("_test_probe")
class ProbeRouter(TopKRouter):
    """Top-k routing that asks for attention probabilities and records what it was given."""

    needs_attention = True

    def __init__(self, d_model, num_experts, top_k, *, normalize=None, noisy=False, init_std=0.02):
        super().__init__(d_model, num_experts, top_k, normalize=normalize, noisy=noisy, init_std=init_std)
        self.seen, self.invocations, self.optimizer_steps = [], 0, []

    def route(self, x, ctx):
        self.invocations += 1
        if not is_recomputing():  # a stateful router's side effects happen once per forward
            self.seen.append({"batch_shape": ctx.batch_shape, "causal": ctx.causal, "step": ctx.step,
                              "micro_step": ctx.micro_step, "seed": ctx.seed,
                              "prev_top1": None if ctx.prev_top1 is None else ctx.prev_top1.clone(),
                              "attn_probs": None if ctx.attn_probs is None else ctx.attn_probs.detach().clone(),
                              "padding_mask": ctx.padding_mask, "tokens": x.shape[0]})
        return super().route(x, ctx)

    def after_optimizer_step(self, ctx):
        self.optimizer_steps.append(ctx.step)
