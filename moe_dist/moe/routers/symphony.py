"""SymphonySMoE ("Modeling Expert Interactions in SMoE via Graph Structures").

Each layer keeps an ``E x E`` expert graph ``A`` and routes with ``g = A @ softmax(logits)``
(top-k on g, gates g, renormalised over the chosen experts by the gate rule of every router;
``normalize: false`` keeps the paper's gates, which sum to less than 1). ``A`` is learned
without gradient from how often experts are chosen together by the base router:

* during training forwards (not in eval, not in activation-checkpoint recomputation) the
  co-selection counts ``C = S^T S`` of the base top-k are accumulated as int64;
* once per optimizer step (``after_optimizer_step``, called on every rank) the raw counts
  are summed over the ranks holding distinct tokens (one all-reduce of ``E*E`` int64),
  normalised (row / column / symmetric), folded into ``A`` by EMA, and reset. Every rank
  applies the same arithmetic to the same integers, so ``A`` stays bit-identical across
  ranks and equal to what one process computes on the concatenated batch.

``A`` is a persistent fp32 buffer (saved in the state dict) that stays fp32 when the
module is cast to bf16/fp16.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...checks import check_choice
from ...errors import ConfigError
from ...distributed.collectives import all_reduce_sum
from ..counting import count_values
from ..routing.types import SCOPES, Routing, RouterInputs, RoutingContext, is_recomputing
from .base import gate_normalization, renormalize
from .registry import register_router
from .wrapping import WrappingRouter, topk_set_changed

NORMALIZATIONS = ("row", "column", "symmetric")
INITS = ("zero", "identity")
COUNT_SOURCES = ("base", "final")


def normalize_counts(counts: torch.Tensor, how: str) -> torch.Tensor:
    """``[E, E]`` co-selection counts -> fp32 graph update. ``row``: ``D^-1 C``; ``column``:
    ``C D^-1``; ``symmetric``: ``D^-1/2 C D^-1/2`` with ``D = diag(row sums)`` (C is symmetric).
    Rows / columns of never-selected experts come out zero."""
    check_choice("model.moe.router_options.normalization", how, NORMALIZATIONS)
    c = counts.double()
    d = c.sum(-1)
    if how == "row":
        out = c / d.clamp_min(1)[:, None]
    elif how == "column":
        out = c / d.clamp_min(1)[None, :]
    else:
        r = d.clamp_min(1).rsqrt()
        out = r[:, None] * c * r[None, :]
    return out.float()


def topk_descending_stable(scores: torch.Tensor, tiebreak: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest ``scores`` per row; ties broken by larger ``tiebreak``, then lower index
    (deterministic; with ``A = 0`` every score ties and the base router's choice wins)."""
    order = torch.sort(tiebreak, dim=-1, descending=True, stable=True).indices
    pos = torch.sort(scores.gather(-1, order), dim=-1, descending=True, stable=True).indices[:, :k]
    return order.gather(-1, pos)


@register_router("symphony")
class SymphonyRouter(WrappingRouter):
    """SymphonySMoE gating over a base router.

    base / base_options: the router supplying the logits and ``softmax`` (default ``topk``).
    beta: EMA factor of the graph update (paper 0.9).
    init: ``zero`` (paper) or ``identity`` (routes exactly like the base router at first; safer
        for upcycled models).
    normalization: ``row`` (Alg. 1, default), ``column`` or ``symmetric``.
    count_source: co-selection from the ``base`` top-k (Alg. 1, default) or the ``final`` top-k.
    scope: ranks the counts are summed over: ``global`` (all ranks with distinct tokens),
        ``ep`` or ``local`` (per-rank graphs, as per-GPU code would do; breaks invariance).
    normalize: renormalise the k gates to sum to one. Unset: the gate rule of every router
        (``gate_normalization``: renormalised at top_k > 1); ``false`` is the paper's gates g.
        The default follows router study II (docs/router-study.md): at top-2 the paper's gates
        trained 2.7 ppl worse than renormalised ones (1200 steps, both seeds); renormalised,
        Symphony ends within 0.2 ppl of ``topk`` over 3000 steps.
    bias_correction: route with ``A / (1 - beta^t)`` after t updates (zero init only).
    """

    local_extras = {"topk_changed": "mean", "gate_sum": "mean"}  # figures of this rank's tokens
    group_limit_refusal = ("it chooses through its expert graph, whose scores the zero-initialised graph makes "
                           "equal for every expert (so for every group) and which learns from the base router's "
                           "unlimited choices")

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, base: str = "topk",
                 base_options: Optional[dict] = None, beta: float = 0.9, init: str = "zero",
                 normalization: str = "row", count_source: str = "base", scope: str = "global",
                 normalize: Optional[bool] = None, bias_correction: bool = False):
        super().__init__(d_model, num_experts, top_k, base, base_options)
        check_choice("model.moe.router_options.init", init, INITS)
        check_choice("model.moe.router_options.normalization", normalization, NORMALIZATIONS)
        check_choice("model.moe.router_options.count_source", count_source, COUNT_SOURCES)
        check_choice("model.moe.router_options.scope", scope, SCOPES)
        if not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
            raise ConfigError(f"model.moe.router_options.beta must be in [0, 1), got {beta!r}")
        if bias_correction and init != "zero":
            raise ConfigError("model.moe.router_options.bias_correction=true needs init='zero'")
        self.beta, self.init, self.normalization = float(beta), init, normalization
        self.count_source, self.scope = count_source, scope
        self.normalize, self.bias_correction = gate_normalization(top_k, normalize), bool(bias_correction)
        A = torch.eye(num_experts) if init == "identity" else torch.zeros(num_experts, num_experts)
        self.register_buffer("A", A, persistent=True)
        self.register_buffer("n_updates", torch.zeros((), dtype=torch.long), persistent=True)
        # int64 co-selection counts of the current optimizer step: a plain attribute (not a
        # buffer) so that no buffer broadcast or state-dict round trip can clobber it
        self._counts: Optional[torch.Tensor] = None

    # ---- A stays fp32 --------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        before = self._buffers["A"]
        super()._apply(fn, recurse)
        after = self._buffers["A"]
        if after is not None and after.dtype != torch.float32:
            # a dtype cast: keep the fp32 values, take only the new device
            self._buffers["A"] = (after.float() if before.is_meta else before.to(after.device))
        if self._counts is not None:
            self._counts = self._counts.to(self._buffers["A"].device)
        return self

    # ---- routing -------------------------------------------------------------------------
    def expert_graph_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A, self.n_updates

    def expert_graph(self) -> torch.Tensor:
        """The graph routing uses now (fp32, with bias correction when enabled)."""
        A = self.A.float()
        if self.bias_correction:  # on the device: no host read of the update count
            t = self.n_updates.to(torch.float64)
            correction = (1.0 - torch.full_like(t, self.beta).pow(t)).float()
            A = torch.where(t > 0, A / correction, A)
        return A

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        base = self.base_routing(x, ctx, inputs)
        probs = base.probs  # softmax of the base logits, fp32
        with torch.autocast(device_type=x.device.type, enabled=False):
            g = probs @ self.expert_graph().t()  # g[i, j] = sum_k A[j, k] p[i, k]
        expert_ids = topk_descending_stable(g.detach(), probs.detach(), self.top_k)
        gates = g.gather(-1, expert_ids)
        if self.normalize:
            gates = renormalize(gates)
        if self.training and not is_recomputing():
            self._count(base.expert_ids if self.count_source == "base" else expert_ids, inputs.padding_mask)
        with torch.no_grad():
            extras = {**base.extras, "topk_changed": topk_set_changed(expert_ids, base.expert_ids).float().mean(),
                      "gate_sum": gates.sum(-1).mean()}
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=base.logits, extras=extras)

    @torch.no_grad()
    def _count(self, ids: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> None:
        E = self.num_experts
        pairs = ids[:, :, None] * E + ids[:, None, :]  # [T, k, k]
        weights = None
        if padding_mask is not None:  # padding tokens count zero (a weight, not a data-dependent selection)
            real = padding_mask.reshape(-1).to(ids.device, torch.long)
            weights = real[:, None, None].expand(pairs.shape)
        counts = count_values(pairs, E * E, weights).view(E, E)
        self._counts = counts if self._counts is None else self._counts + counts

    def pending_counts(self) -> torch.Tensor:
        """This rank's int64 counts since the last update (zeros if none)."""
        if self._counts is None:
            return torch.zeros(self.num_experts, self.num_experts, dtype=torch.long, device=self.A.device)
        return self._counts

    # ---- once per optimizer step ---------------------------------------------------------
    @torch.no_grad()
    def after_optimizer_step(self, ctx: RoutingContext) -> None:
        """Sum the counts over ``ctx.group_for(scope)`` (every rank calls this, tokens or not),
        normalise, fold into A by EMA (rows of never-selected experts unchanged), reset."""
        super().after_optimizer_step(ctx)
        counts = all_reduce_sum(self.pending_counts(), ctx.group_for(self.scope))
        update = normalize_counts(counts, self.normalization).to(self.A.device)
        selected = (counts.sum(-1) > 0).to(self.A.device)[:, None]
        self.A.copy_(torch.where(selected, self.beta * self.A + (1.0 - self.beta) * update, self.A))
        self.n_updates += 1
        self._counts = None

    def extra_metrics(self) -> dict:
        """Graph figures for metrics.jsonl (host values; call at log time)."""
        A = self.A.detach().double().cpu()
        eig = torch.linalg.eigvals(A).abs().sort(descending=True).values
        return {
            **super().extra_metrics(),
            "graph_updates": int(self.n_updates),
            "graph_row_sum_mean": float(A.sum(-1).mean()),
            "graph_asymmetry": float((A - A.t()).norm()),
            "graph_empty_rows": int((A.abs().sum(-1) == 0).sum()),
            "graph_second_eigenvalue": float(eig[1]) if eig.numel() > 1 else 0.0,
        }
