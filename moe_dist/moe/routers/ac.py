"""Adaptive Clustering routing (ACMoE; "Tight clusters make specialized experts", ICLR 2025).

Tokens are grouped by their top-1 expert at the previous MoE layer (``inputs.prev_top1``, which
the model hands the layer's forward). Per group k and feature q the router input's dispersion
``s_qk`` (mean absolute deviation by default, or variance) gives a feature weight
``w_qk ~ 1 / (s_qk + eps)``; the router scores ``(x * w_{c(x)}) . e_j`` with ``e_j`` the
L2-normalised expert embeddings, so features on which a cluster is tight count more. Only the
router sees the scaled input; the weights carry no gradient.

The defaults follow the paper. The authors' language-model code differs in ways that change
training, each an option: it rescales the expert embeddings to norm 1.5 in place on every
forward (``embedding_norm``; here after every optimizer step and when made or loaded, the same
values at every forward), its layers before the clustered ones use a gate of their own, a
linear layer with a bias that is never rescaled (``plain_gate: linear``), a cluster of one token
gets dispersion 0 (``min_count: 1``), and empty clusters enter the weights' normalisation
(``empty_clusters: included``).

Where the authors' variant still differs from their code (by design):

- ``empty_clusters: included`` gives every expert a row of weights. The authors make rows for the
  ids up to the largest expert id among the previous layer's choices (all k of them, per rank), so
  the two differ when the highest expert ids were chosen by no token in any of the k places:
  the authors' clamp and means then leave those rows out, here they enter them. This
  router sees only the previous layer's top-1 (``inputs.prev_top1``), not its other choices.
- with ``scope: global`` (the default) the clusters pool the tokens of every rank; the authors'
  statistics are per rank (``scope: local``).

Distributed: the weights come from sufficient statistics summed in fp32 over
``ctx.group_for(scope)`` in two rounds (``[n_k, sum x]``, then ``sum |x - mu_k|`` or
``sum (x - mu_k)^2``), never from per-rank means, so with scope ``global`` R ranks compute the
weights one process computes on the concatenated batch and every rank holds the same weights.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.collectives import all_reduce_sum
from ...distributed.shards import local_rows
from ..routing.types import SCOPES, Routing, RouterInputs, RoutingContext, is_recomputing
from .base import Router, gate_normalization, fp32_linear
from .registry import register_router
from .token_stats import real_token_weights
from ...checks import check_choice
from ...errors import ConfigError

DISPERSIONS = ("mad", "var")
WEIGHT_NORMS = ("feature", "global")
EVAL_MODES = ("batch", "running")
BASES = ("embedding", "linear")
PLAIN_GATES = ("shared", "linear")
EMPTY_CLUSTERS = ("excluded", "included")


@torch.no_grad()
def cluster_dispersion(x: torch.Tensor, labels: torch.Tensor, num_clusters: int, dispersion: str = "mad",
                       group=None, row_weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster size ``[K]`` and per-feature dispersion ``[K, d]`` of ``x [T, d]`` grouped by
    ``labels [T]``, from fp32 sums over ``group`` (two all-reduces). Empty clusters get 0."""
    x = x.detach().float()
    weight = None if row_weight is None else row_weight.float()[:, None]
    d = x.shape[1]
    first = x.new_zeros(num_clusters, d + 1)
    first[:, 0].index_add_(0, labels, x.new_ones(x.shape[0]) if weight is None else weight[:, 0])
    first[:, 1:].index_add_(0, labels, x if weight is None else x * weight)
    first = all_reduce_sum(first, group)  # round 1: counts and sums
    counts = first[:, 0]
    inv = 1.0 / counts.clamp_min(1.0)
    mean = first[:, 1:] * inv[:, None]
    dev = torch.sub(x, mean.index_select(0, labels))
    dev = dev.abs_() if dispersion == "mad" else dev.square_()
    if weight is not None:
        dev.mul_(weight)
    spread = x.new_zeros(num_clusters, d).index_add_(0, labels, dev)
    spread = all_reduce_sum(spread, group)  # round 2: deviations around the global means
    return counts, spread * inv[:, None]


def dispersion_weights(dispersion: torch.Tensor, valid: torch.Tensor, eps: float = 1e-4, clamp: Optional[float] = 10.0,
                       norm: str = "feature") -> torch.Tensor:
    """Feature weights ``[K, d]``: ``1 / (dispersion + eps)``, capped at ``clamp`` times the mean
    weight, divided by the per-feature mean over clusters (``feature``) or the overall mean
    (``global``); clusters that are not ``valid`` (too small) get weight 1. No host sync."""
    w = 1.0 / (dispersion + eps)
    ok = valid.to(w.dtype)[:, None]
    n_ok = ok.sum()
    if clamp:
        w = torch.minimum(w, clamp * (w * ok).sum() / (n_ok * w.shape[1]).clamp_min(1.0))
    if norm == "feature":
        denom = (w * ok).sum(0) / n_ok.clamp_min(1.0)
    else:
        denom = (w * ok).sum() / (n_ok * w.shape[1]).clamp_min(1.0)
    w = w / denom.clamp_min(torch.finfo(w.dtype).tiny)
    return torch.where(valid[:, None], w, torch.ones_like(w))


def _rescale_after_load(router: "AdaptiveClusteringRouter", _incompatible_keys) -> None:
    router._rescale_embeddings()


@register_router("ac")
class AdaptiveClusteringRouter(Router):
    """Options:

    start_layer: first layer (``ctx.layer_idx``) that uses AC; earlier layers, and any call
        without ``inputs.prev_top1``, route by plain top-k on the same scores (default 2: the
        paper's best Switch placement leaves the first two MoE layers plain).
    dispersion: ``mad`` (mean absolute deviation, paper default) or ``var``.
    eps: added to the dispersion before inverting. clamp: cap weights at ``clamp`` x their
        mean (null/0: no cap; reference LM code 10, Swin 1.5). weight_norm: ``feature`` (each
        feature's mean over clusters is 1; LM code) or ``global`` (Swin code).
    min_count: clusters with fewer tokens get weight 1 and stay out of the means.
    scope: ranks whose tokens form the clusters: ``global`` (default, layout-invariant), ``ep``,
        or ``local`` (per rank, as the authors' code).
    eval_mode: ``batch`` (statistics of the evaluated batch, as the paper) or ``running``
        (an EMA of the training statistics, needed to decode one token at a time).
    momentum: EMA weight of a new batch in the running dispersion.
    base: ``embedding`` (scores against L2-normalised expert embeddings, orthogonal init with
        gain 0.32, as the authors' LM code) or ``linear`` (a plain linear router).
    normalize: renormalise the gates over the chosen k (default: k > 1).
    embedding_norm: null (paper) or a norm (authors' code: 1.5) the expert embeddings are
        rescaled to, in place and without gradient, when made or loaded and after every
        optimizer step (so every forward sees that norm, as the authors' per-forward rescale): the
        scores are the same (they use the normalised embeddings), the embeddings' gradient is scaled by
        ``|e| / embedding_norm`` and the optimizer steps on vectors of that norm (base
        ``embedding`` only).
    plain_gate: what scores the calls that do not cluster (layers before ``start_layer``, and
        calls without ``inputs.prev_top1``): ``shared`` (the router's own scores) or ``linear``
        (the authors' code, their ``nn.Linear`` gate of the layers before the clustered ones): a
        gate of its own, ``x P^T + b`` with ``plain_weight`` P ``[E, d]`` and ``plain_bias`` b
        ``[E]``, drawn as a default ``nn.Linear`` (uniform within ``1/sqrt(d)``: rows of norm
        about ``1/sqrt(3)``, and the bias too), drawn before the embeddings so that under one seed
        it equals the ``nn.Linear(d, E)`` that seed gives; ``embedding_norm`` never rescales it.
        Every router holds both sets of tensors (it learns its layer only when called); a layer
        trains only the set its calls use, the other keeps no gradient.
    empty_clusters: ``excluded`` (clusters without a token stay out of the clamp and the means)
        or ``included`` (the authors' code: they enter them with dispersion 0, i.e. weight
        ``1 / eps``).
    """

    supports_expert_bias = supports_group_limit = True

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, start_layer: int = 2, dispersion: str = "mad",
                 eps: float = 1e-4, clamp: Optional[float] = 10.0, weight_norm: str = "feature", min_count: int = 2,
                 scope: str = "global", eval_mode: str = "batch", momentum: float = 0.1, base: str = "embedding",
                 normalize: Optional[bool] = None, init_std: float = 0.02, embedding_norm: Optional[float] = None,
                 plain_gate: str = "shared", empty_clusters: str = "excluded"):
        super().__init__(d_model, num_experts, top_k)
        check_choice("model.moe.router_options.dispersion", dispersion, DISPERSIONS)
        check_choice("model.moe.router_options.weight_norm", weight_norm, WEIGHT_NORMS)
        check_choice("model.moe.router_options.scope", scope, SCOPES)
        check_choice("model.moe.router_options.eval_mode", eval_mode, EVAL_MODES)
        check_choice("model.moe.router_options.base", base, BASES)
        check_choice("model.moe.router_options.plain_gate", plain_gate, PLAIN_GATES)
        check_choice("model.moe.router_options.empty_clusters", empty_clusters, EMPTY_CLUSTERS)
        if embedding_norm is not None and (base != "embedding" or not embedding_norm > 0):
            raise ConfigError("model.moe.router_options.embedding_norm must be null or > 0 with base: embedding, "
                              f"got {embedding_norm} with base: {base}")
        if not eps > 0:
            raise ConfigError(f"model.moe.router_options.eps must be > 0, got {eps}")
        if clamp is not None and clamp < 0:
            raise ConfigError(f"model.moe.router_options.clamp must be >= 0 or null, got {clamp}")
        if min_count < 1:
            raise ConfigError(f"model.moe.router_options.min_count must be >= 1, got {min_count}")
        if not 0 < momentum <= 1:
            raise ConfigError(f"model.moe.router_options.momentum must be in (0, 1], got {momentum}")
        if start_layer < 0:
            raise ConfigError(f"model.moe.router_options.start_layer must be >= 0, got {start_layer}")
        self.start_layer, self.dispersion, self.eps, self.clamp = int(start_layer), dispersion, float(eps), clamp
        self.weight_norm, self.min_count, self.scope = weight_norm, int(min_count), scope
        self.eval_mode, self.momentum, self.base = eval_mode, float(momentum), base
        self.normalize = gate_normalization(top_k, normalize)
        self.embedding_norm = None if embedding_norm is None else float(embedding_norm)
        self.plain_gate, self.empty_clusters = plain_gate, empty_clusters
        self.plain_weight = self.plain_bias = None
        if plain_gate == "linear":  # the authors' gate, drawn first: under one seed it is their nn.Linear(d_model, E)
            gate = nn.Linear(d_model, num_experts)
            self.plain_weight, self.plain_bias = gate.weight, gate.bias
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        if base == "embedding":
            nn.init.orthogonal_(self.weight, gain=0.32)
        else:
            nn.init.normal_(self.weight, std=init_std)
        self._rescale_embeddings()
        # a loaded state (a checkpoint, another run's router) holds embeddings of any norm
        self.register_load_state_dict_post_hook(_rescale_after_load)
        # running statistics for eval_mode='running' (global, identical on every rank)
        self.register_buffer("running_dispersion", torch.ones(num_experts, d_model))
        self.register_buffer("running_valid", torch.zeros(num_experts, dtype=torch.bool))
        self.last_weights: Optional[torch.Tensor] = None  # [E, d] weights of the last AC call

    def router_weight(self) -> torch.Tensor:
        if self.base != "embedding":
            return self.weight
        return F.normalize(self.weight.float(), dim=-1)

    @torch.no_grad()
    def _rescale_embeddings(self) -> None:
        """``embedding_norm``: every expert embedding (``weight``, what the clustered calls score
        against; never ``plain_weight``) set to that norm, in place, on the rows this rank holds
        (whole rows under FSDP2's Shard(0), or the whole tensor). Done when the weight is made or
        loaded and after every optimizer step, never in the forward: a forward's in-place
        change would reach only FSDP2's gathered copy (the shards would keep the old values, and a
        backward that gathers again would mix the two). The authors rescale at the start of every
        forward; the weights every forward sees are the same."""
        if self.embedding_norm is None or self.weight.is_meta:
            return
        w = local_rows(self.weight).local
        if w.numel():
            norms = w.float().norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            w.mul_((self.embedding_norm / norms).to(w.dtype))

    def after_optimizer_step(self, ctx: RoutingContext) -> None:
        self._rescale_embeddings()

    def active(self, ctx: RoutingContext, inputs: RouterInputs) -> bool:
        return inputs.prev_top1 is not None and ctx.layer_idx >= self.start_layer

    @torch.no_grad()
    def _update_running(self, counts: torch.Tensor, dispersion: torch.Tensor) -> None:
        seen = counts >= self.min_count
        running = self.running_dispersion.float()  # fp32 math even if the model was cast
        blended = torch.where(self.running_valid[:, None], torch.lerp(running, dispersion, self.momentum), dispersion)
        self.running_dispersion.copy_(torch.where(seen[:, None], blended, running))
        self.running_valid |= seen

    def feature_weights(self, x: torch.Tensor, labels: torch.Tensor, ctx: RoutingContext,
                        inputs: RouterInputs) -> tuple[torch.Tensor, dict]:
        """``[E, d]`` weights for this call (detached) and the statistics for metrics."""
        if not self.training and self.eval_mode == "running":
            valid = self.running_valid
            w = dispersion_weights(self.running_dispersion.float(), valid, self.eps, self.clamp, self.weight_norm)
            return w, {}
        counts, disp = cluster_dispersion(x, labels, self.num_experts, self.dispersion, ctx.group_for(self.scope),
                                          real_token_weights(inputs, ctx, x.shape[0], x.device))
        valid = counts >= self.min_count
        if self.empty_clusters == "included":
            valid = valid | (counts == 0)
        if self.training and not is_recomputing():
            self._update_running(counts, disp)
        w = dispersion_weights(disp, valid, self.eps, self.clamp, self.weight_norm)
        return w, {"ac_cluster_sizes": counts.detach(), "ac_small_clusters": (~valid).sum().float()}

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        extras: dict = {"ac_active": x.new_zeros((), dtype=torch.float32)}
        if self.active(ctx, inputs):
            labels = inputs.prev_top1.reshape(-1).to(device=x.device, dtype=torch.long)
            if labels.shape[0] != x.shape[0]:
                raise ValueError(f"layer {ctx.layer_idx}: prev_top1 has {labels.shape[0]} labels for {x.shape[0]} tokens")
            w, stats = self.feature_weights(x, labels, ctx, inputs)
            self.last_weights = w
            extras.update(stats, ac_active=x.new_ones((), dtype=torch.float32))
            logits = fp32_linear(x.float() * w.index_select(0, labels), self.router_weight())
        elif self.plain_gate == "linear":
            logits = fp32_linear(x, self.plain_weight, self.plain_bias)
        else:
            logits = fp32_linear(x, self.router_weight())
        probs = torch.softmax(logits, dim=-1)
        expert_ids, gates = self.choose_topk(logits, probs, self.top_k, self.normalize)
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits, extras=extras)
