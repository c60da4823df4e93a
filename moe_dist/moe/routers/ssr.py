"""Selective Sinkhorn Routing (SSR) and the every-call Sinkhorn baseline.

SSR: in training, each layer call flips one coin (the same on every rank); with
probability ``p`` the whole call routes by the entropic optimal-transport plan with
uniform expert marginals (gates from the plan, which carries no gradient), otherwise by
plain softmax top-k (which trains the router). Inference is softmax top-k (``inference:
topk``), or the plan of the evaluated batch (``inference: sinkhorn``, what the Sinkhorn
baseline's reference prototype does).

``sinkhorn`` (prior work: Clark et al. 2022, Megatron-Core): the plan is solved on every
training call but only *selects* the experts; the gates come from the router's softmax, so
the router trains on every call.

The plan is ``softmax(C / xi + g)`` per token with ``g`` the expert dual solved by
:func:`sinkhorn_dual`; the column sums are reduced over ``ctx.group_for(scope)``, so with
scope ``global`` R ranks compute the plan one process computes on the concatenated batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..routing.types import SCOPES, Routing, RouterInputs, RoutingContext, is_recomputing
from .base import Router, gate_normalization, fp32_linear, layout_invariant_normal, select_topk
from .registry import register_router
from .sinkhorn import sinkhorn_dual, transport_plan
from .token_stats import real_token_weights, shared_uniform
from ...checks import check_choice
from ...errors import ConfigError

COSTS = ("logits", "softmax")  # SSR-L, SSR-S
GATES = ("plan", "scores")  # SSR (Prop. 4.1) / prior work
INFERENCE = ("topk", "sinkhorn")  # eval mode: softmax top-k (papers) / the plan (the reference prototype)
_COIN_SALT = 0x55F  # separates SSR's coin from other uses of the same (seed, step, layer) keys
_NOISE_SALT = 0x55E


@register_router("sinkhorn", p=1.0, xi=1.0, gates="scores")
@register_router("ssr")
class SelectiveSinkhornRouter(Router):
    """Options (paper symbols in brackets):

    p: probability that a training call uses Sinkhorn (``ssr`` 1e-3; ``sinkhorn`` 1).
    xi: entropic temperature [xi] (0.5; ``sinkhorn`` 1).
    cost: ``logits`` (SSR-L, C = S) or ``softmax`` (SSR-S, C = softmax(S)).
    gates: ``plan`` (gates = the plan renormalised over the chosen k) or ``scores`` (gates =
        router softmax at the experts the plan chose).
    noise_alpha, noise_sigma: training noise ``alpha * sigma * N(0, 1)`` added to the cost for
        selection in both branches (0 = off; paper alpha in {0.3, 1, 4}). The Sinkhorn
        gates use the noisy cost, the softmax gates the clean scores. Drawn for the global
        batch, so it does not depend on the layout.
    max_iters [eta], tol [delta, relative to N/E]: Sinkhorn stopping, when the largest relative
        error of the column marginals is below ``tol``. The Sinkhorn baseline's reference
        prototype stops instead when the L1 change of both scalings falls below 1e-2 (at most
        100 iterations, per GPU batch); that test is not offered (docs/router-study.md, S3).
    check_every: iterations between two stop tests (each test is a host read; default 8).
    scope: ranks whose tokens share one plan: ``global`` (all data-parallel ranks), ``ep``,
        or ``local`` (each rank alone, as Megatron does).
    normalize: renormalise the softmax-branch gates over the chosen k (default: k > 1).
    gate_bias: a trained per-expert bias on the router's scores, initialised 0 (the Sinkhorn
        prototype's linear gate has one; default: none).
    inference: eval-mode routing: ``topk`` (softmax top-k, the papers') or ``sinkhorn`` (the plan
        of the evaluated tokens, solved over ``scope`` as in training, without noise; the
        Sinkhorn baseline's reference prototype solves it on every call).
    """

    group_limit_refusal = ("its Sinkhorn calls choose from a transport plan balanced over the whole batch, not by a "
                           "per-token top-k: confining each token to its best groups would undo that balance")

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, p: float = 1e-3, xi: float = 0.5,
                 cost: str = "logits", gates: str = "plan", noise_alpha: float = 0.0, noise_sigma: float = 1.0,
                 max_iters: int = 100, tol: float = 1e-4, check_every: int = 8, scope: str = "global",
                 normalize: bool | None = None, init_std: float = 0.02, inference: str = "topk",
                 gate_bias: bool = False):
        super().__init__(d_model, num_experts, top_k)
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"model.moe.router_options.p must be in [0, 1], got {p}")
        if not xi > 0:
            raise ConfigError(f"model.moe.router_options.xi must be > 0, got {xi}")
        if noise_alpha < 0 or not noise_sigma > 0:
            raise ConfigError(f"model.moe.router_options.noise_alpha must be >= 0 and noise_sigma > 0, "
                             f"got {noise_alpha}, {noise_sigma}")
        if max_iters < 1 or not tol > 0:
            raise ConfigError(f"model.moe.router_options.max_iters must be >= 1 and tol > 0, got {max_iters}, {tol}")
        if not (isinstance(check_every, int) and check_every >= 1):
            raise ConfigError(f"model.moe.router_options.check_every must be an integer >= 1, got {check_every!r}")
        check_choice("model.moe.router_options.cost", cost, COSTS)
        check_choice("model.moe.router_options.gates", gates, GATES)
        check_choice("model.moe.router_options.scope", scope, SCOPES)
        check_choice("model.moe.router_options.inference", inference, INFERENCE)
        self.inference = inference
        self.p, self.xi, self.cost, self.gate_source = float(p), float(xi), cost, gates
        self.noise_alpha, self.noise_sigma = float(noise_alpha), float(noise_sigma)
        self.max_iters, self.tol, self.check_every, self.scope = int(max_iters), float(tol), check_every, scope
        self.normalize = gate_normalization(top_k, normalize)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=init_std)
        self.gate_bias = nn.Parameter(torch.zeros(num_experts)) if gate_bias else None
        # cumulative counters (identical on every rank: the coin is shared), saved with the model
        self.register_buffer("sinkhorn_calls_total", torch.zeros((), dtype=torch.int64))
        self.register_buffer("sinkhorn_iters_total", torch.zeros((), dtype=torch.int64))
        self.last_dual: torch.Tensor | None = None  # [E] dual of the last Sinkhorn call

    @property
    def needs_token_layout(self) -> bool:  # the noise is drawn for the global batch
        return self.noise_alpha > 0 and self.training

    def uses_sinkhorn(self, ctx: RoutingContext) -> bool:
        """This training call's coin: a function of (seed, step, micro-step, layer) only."""
        if self.p >= 1.0:
            return True
        if self.p <= 0.0:
            return False
        return shared_uniform(ctx.seed, ctx.step, ctx.micro_step, ctx.layer_idx, _COIN_SALT) < self.p

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        logits = fp32_linear(x, self.weight, self.gate_bias)
        probs = torch.softmax(logits, dim=-1)
        extras = {"sinkhorn_calls": logits.new_zeros(()), "sinkhorn_calls_total": self.sinkhorn_calls_total.detach().clone()}
        if not self.training and self.inference == "topk":  # deterministic softmax top-k
            expert_ids, gates = select_topk(logits, probs, self.top_k, self.normalize)
            return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits, extras=extras)

        cost = logits if self.cost == "logits" else probs
        if self.training and self.noise_alpha > 0:
            eps = layout_invariant_normal((self.num_experts,), ctx, x.shape[0], salt=_NOISE_SALT, device=x.device)
            cost = cost + (self.noise_alpha * self.noise_sigma) * eps
        if self.training and not self.uses_sinkhorn(ctx):
            expert_ids, gates = select_topk(cost, probs, self.top_k, self.normalize)
            return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits, extras=extras)

        scores = cost.detach() / self.xi
        result = sinkhorn_dual(scores, group=ctx.group_for(self.scope), max_iters=self.max_iters, tol=self.tol,
                               row_weight=real_token_weights(inputs, ctx, x.shape[0], x.device), check_every=self.check_every)
        self.last_dual = result.dual
        z = scores + result.dual  # log plan + a per-token constant
        if self.gate_source == "plan":  # Prop. 4.1: plan renormalised over the chosen k; no gradient
            expert_ids, gates = select_topk(z, transport_plan(scores, result.dual), self.top_k, self.normalize)
        else:
            expert_ids, gates = select_topk(z, probs, self.top_k, self.normalize)
        if self.training and not is_recomputing():  # the counters count training calls
            self.sinkhorn_calls_total += 1
            self.sinkhorn_iters_total += result.iterations.to(self.sinkhorn_iters_total.device)
        extras.update(sinkhorn_calls=logits.new_ones(()), sinkhorn_calls_total=self.sinkhorn_calls_total.detach().clone(),
                      sinkhorn_iters=result.iterations.float(), sinkhorn_marginal_error=result.error)
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits, extras=extras)

    def extra_metrics(self) -> dict:
        return {"sinkhorn_calls_total": int(self.sinkhorn_calls_total), "sinkhorn_iters_total": int(self.sinkhorn_iters_total)}
