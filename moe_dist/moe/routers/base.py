"""Shared pieces of every router: the base class and the steps routers have in common."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..routing.types import NO_INPUTS, Routing, RouterInputs, RoutingContext
from ...errors import ConfigError


def check_top_k(num_experts: int, top_k: int) -> None:
    """``model.moe.num_experts`` >= 1 and ``1 <= model.moe.top_k <= num_experts`` (every router
    checks it when built; the config before launch)."""
    if num_experts < 1:
        raise ConfigError(f"model.moe.num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"model.moe.top_k={top_k} must be between 1 and model.moe.num_experts={num_experts}")


def check_group_limit(num_experts: int, largest_k: int, groups: Optional[int], max_groups: Optional[int]) -> None:
    """``model.moe.router_groups`` (G) and ``model.moe.max_groups_per_token`` (M) set together or not
    at all; G divides ``num_experts``; ``1 <= M <= G``; the largest k the router routes with
    (``largest_k``: a k schedule's end, an inference k) fits in M groups of ``num_experts / G`` experts."""
    if groups is None and max_groups is None:
        return
    if groups is None or max_groups is None:
        given, missing = (("router_groups", "max_groups_per_token") if max_groups is None
                          else ("max_groups_per_token", "router_groups"))
        raise ConfigError(f"model.moe.{given} needs model.moe.{missing} (node-limited routing takes both); "
                          "allowed: both set or both null")
    if num_experts % groups:
        raise ConfigError(f"model.moe.router_groups={groups} must divide model.moe.num_experts={num_experts}")
    if not 1 <= max_groups <= groups:
        raise ConfigError(f"model.moe.max_groups_per_token={max_groups} is not allowed; allowed: 1..{groups} "
                          f"(model.moe.router_groups={groups})")
    if largest_k > max_groups * (num_experts // groups):
        raise ConfigError(f"model.moe.max_groups_per_token={max_groups}: {max_groups} group(s) of "
                          f"{num_experts // groups} experts hold fewer than the router's k={largest_k} (its largest: "
                          f"top_k, a k schedule's k_max or an eval_k); allowed: >= "
                          f"{-(-largest_k // (num_experts // groups))}")


class Router(nn.Module):
    """Maps router inputs ``[T, d]`` to a :class:`Routing`. Subclasses implement
    ``route(x, ctx, inputs)``: ``ctx`` is the layer's :class:`RoutingContext`, ``inputs`` the
    :class:`RouterInputs` the model handed the layer's forward.

    Class attributes tell the layer and the model what to supply:
    ``needs_token_layout``: the layer fills ``ctx.token_offset`` / ``ctx.global_tokens`` (layout-invariant noise).
    ``needs_whole_sequences``: the router mixes the tokens of a sequence, so a rank must hold whole
    ``[B, S]`` sequences, rows sequence-major (``inputs.batch_shape``).
    ``attention_needs``: None, or what the model hands over of the attention sub-layer before the
    layer, in ``inputs.attention`` (one of :data:`~moe_dist.moe.routing.types.ATTENTION_NEEDS`): ``scores``
    (queries, keys, values, output and output projection; the attention keeps its fused kernel) or
    ``probs`` (the same and the ``[B, H, S, S]`` probabilities, computed explicitly).
    """

    needs_token_layout = False
    needs_whole_sequences = False
    attention_needs: Optional[str] = None
    # Routing.extras that describe this rank's tokens only, and how the metrics combine them over
    # the ranks holding distinct tokens: "mean" (weighted by router rows) or "sum"
    local_extras: dict[str, str] = {}
    # the aux-loss-free expert bias (DeepSeek-V3) is added to the probabilities this router passes
    # to select_topk; routers that choose otherwise (Sinkhorn, Symphony's graph) leave this False
    supports_expert_bias = False
    # node-limited routing: the router chooses by select_topk of per-token scores, so the choice can be
    # confined to a token's best expert groups (set_group_limit); refusing routers say why in
    # ``group_limit_refusal``
    supports_group_limit = False
    group_limit_refusal = ""
    group_limit: Optional[tuple[int, int]] = None  # (groups, max groups per token) once set
    # router_dtype=fp64: routers whose scores and softmax follow ``self.compute_dtype``
    supports_fp64 = False
    # router tensors with one row per expert along dim 0 (granular upcycling duplicates them per virtual group)
    per_expert_tensors: tuple[str, ...] = ()
    # its gate is softmax(x W) top-k over one [experts, d_model] weight: what a Hugging Face MoE
    # checkpoint's router holds, so `moe-dist export` can write it
    hf_exportable = False
    compute_dtype = torch.float32
    # train.compile compiles the router's forward unless this names why it stays eager
    eager_under_compile: Optional[str] = None

    def __init__(self, d_model: int, num_experts: int, top_k: int):
        super().__init__()
        check_top_k(num_experts, top_k)
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k

    @property
    def final_k(self) -> int:
        """Experts per token the trained model routes to: the k training ends with (a router with a
        k schedule ends above ``top_k``)."""
        return self.top_k

    @classmethod
    def largest_k(cls, top_k: int, options: dict) -> int:
        """The most experts per token a router built with ``top_k`` and ``options`` ever routes to
        (in training or at its inference ``eval_k``), known before it is built."""
        eval_k = options.get("eval_k")
        return max(top_k, int(eval_k)) if eval_k is not None else top_k

    @property
    def k_range(self) -> tuple[int, int]:
        """Experts per token at the first and at the last training step: ``top_k`` both, unless the
        router has a k schedule."""
        return self.top_k, self.top_k

    # ---- inference k (routers with an ``eval_k`` option set ``has_inference_k``) -------------
    has_inference_k = False
    eval_k: Optional[int] = None

    def set_eval_k(self, k: Optional[int]) -> None:
        """Route with ``k`` experts per token in eval mode (None: the k training ends with). Only
        which experts are chosen changes: the gate rule stays the one fixed at build time
        (:func:`gate_normalization`)."""
        if not self.has_inference_k:
            raise ConfigError(f"router {type(self).__name__} has no inference k (model.moe.router_options.eval_k)")
        self.eval_k = check_eval_k(k, self.num_experts)

    def routing_k(self, training_k: int) -> int:
        """Experts per token of this call: ``training_k`` in training; in eval mode ``eval_k``, or
        ``final_k`` when it is unset."""
        if self.training:
            return training_k
        return self.final_k if self.eval_k is None else self.eval_k

    def forward(self, x: torch.Tensor, ctx: RoutingContext, inputs: Optional[RouterInputs] = None) -> Routing:
        return self.route(x, ctx, NO_INPUTS if inputs is None else inputs)

    # ---- what the rest of the code asks of a router family ----------------------------------
    @classmethod
    def options_for_run(cls, options: dict, total_steps: int) -> dict:
        """``options`` with the defaults that depend on the run filled in (its ``total_steps``)."""
        return options

    @classmethod
    def graph_values_per_token(cls, seq_len: int) -> float:
        """Values per token the router keeps of a token graph for backward, per MoE layer, for
        length-``seq_len`` sequences (the planner's activation count); 0 without a token graph."""
        return 0.0

    def synchronize_frozen(self, group: Optional[dist.ProcessGroup] = None, name: str = "") -> bool:
        """Make the tensors the router draws at random but never trains (frozen) the same on every
        rank of ``group`` (collective for a router that has them); False, with no collective, for a
        router without frozen tensors."""
        return False

    def frozen_changed(self) -> None:
        """Hook: the router's tensors were overwritten from outside (initialisation, a checkpoint);
        a router that caches values derived from them drops the cache."""

    @property
    def renormalizes_gates(self) -> bool:
        """The gates sum to one over each token's chosen experts (what an export to a format that
        renormalises them needs)."""
        return bool(getattr(self, "normalize", False))

    @property
    def scorer(self) -> nn.Module:
        """The module whose linear scores the router starts from: itself (a wrapping router's base)."""
        return self

    def expert_graph_state(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(graph [E, E], updates folded in)`` of a router that learns a graph between experts
        (diagnostics snapshot it), else None."""
        return None

    # ---- options the MoE layer sets after construction (registry.check_router_features says which
    # routers support them) --------------------------------------------------------------------
    def enable_expert_bias(self) -> None:
        """Register the per-expert selection bias (a persistent fp32 buffer, zeros: router state that
        checkpoints save; every rank holds the same values, updated by the MoE layer)."""
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32), persistent=True)

    def set_group_limit(self, groups: int, max_groups: int) -> None:
        """Choose each token's experts from its ``max_groups`` best of ``groups`` contiguous expert
        groups (see :func:`select_topk`)."""
        if not self.supports_group_limit:
            raise ConfigError(f"{type(self).__name__} does not support model.moe.max_groups_per_token")
        self.group_limit = (int(groups), int(max_groups))

    def choose_topk(self, scores: torch.Tensor, probs: torch.Tensor, k: int,
                    normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`select_topk` with this router's expert bias and group limit (when set)."""
        return select_topk(scores, probs, k, normalize, self.selection_bias(), self.group_limit)

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype

    def selection_bias(self) -> torch.Tensor | None:
        """The expert bias added to the probabilities for choosing (None when disabled)."""
        return self._buffers.get("expert_bias")

    def _apply(self, fn, recurse=True):
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        after = self._buffers.get("expert_bias")
        if after is not None and after.dtype != torch.float32:  # a dtype cast: the bias stays fp32
            self._buffers["expert_bias"] = after.float() if bias.is_meta else bias.to(after.device)
        return self

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement route()")

    def extra_metrics(self) -> dict:
        """Router-specific figures for metrics.jsonl (override where useful)."""
        return {}

    def after_optimizer_step(self, ctx: RoutingContext) -> None:
        """Called by the trainer once per optimizer step, after ``optimizer.step()``, on every
        rank (collectives allowed over ``ctx.stats_group``). Routers with per-step state
        (Symphony's graph, schedules) update it here."""


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Router scores in fp32 (or ``dtype``, e.g. fp64 for ``router_dtype=fp64``) whatever the
    model dtype (autocast disabled)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def count_nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """NaN/Inf entries of the router logits as a 0-d int64 tensor on their device (no host read:
    the MoE layer reads it with its split sizes and raises :func:`nonfinite_logits_error`)."""
    return torch.isfinite(logits).logical_not_().sum()


def nonfinite_logits_error(where: str, bad: int, total: int) -> FloatingPointError:
    """The error for ``bad`` NaN/Inf router logits out of ``total`` (host numbers)."""
    return FloatingPointError(
        f"{where}: router logits contain {bad} NaN/Inf values (of {total}); "
        "check the learning rate, the input scale or enable bf16 autocast only outside the router"
    )


def select_topk(scores: torch.Tensor, probs: torch.Tensor, k: int, normalize: bool,
                bias: torch.Tensor | None = None,
                groups: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the ``k`` highest ``scores`` per token; gates are the chosen ``probs``.

    With ``normalize`` the gates are renormalised to sum to one over the chosen experts.
    ``bias`` (``[E]``, the aux-loss-free expert bias): choose by ``probs + bias`` instead, the
    gates still the unbiased ``probs`` (DeepSeek-V3; no gradient through the bias).
    ``groups`` = ``(G, M)``: node-limited routing, the choice confined to the token's ``M`` best
    of ``G`` contiguous expert groups (:func:`group_limit_mask`, ranked on the selection scores:
    ``probs``, or ``probs + bias``).
    Returns ``(expert_ids [T, k], gates [T, k])``.
    """
    if bias is not None:
        scores = probs.detach() + bias.to(probs.dtype)
    if groups is not None and groups[1] < groups[0]:
        ranking = scores if bias is not None else probs.detach()
        keep = group_limit_mask(ranking, k, *groups)  # [T, G]
        scores = scores.reshape(*keep.shape, -1).masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    expert_ids = torch.topk(scores, k, dim=-1, sorted=True).indices
    gates = probs.gather(-1, expert_ids)
    return expert_ids, (renormalize(gates) if normalize else gates)


def renormalize(gates: torch.Tensor) -> torch.Tensor:
    """``[T, k]`` gates scaled to sum to one per token (the gate rule's renormalisation; a row of
    zeros stays zeros)."""
    return gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).tiny)


def group_limit_mask(select: torch.Tensor, k: int, groups: int, max_groups: int) -> torch.Tensor:
    """``[T, G]`` bool: each token's ``max_groups`` best expert groups.

    Group ``g`` holds experts ``[g E/G, (g+1) E/G)``; its score for a token is the sum of the token's
    ``max(1, k // max_groups)`` highest ``select`` values in the group (Megatron-Core's
    ``moe_router_group_topk``, DeepSeek-V3's node-limited routing). No host read."""
    tokens, num_experts = select.shape
    per_group = num_experts // groups
    if k > max_groups * per_group:
        raise ValueError(f"k={k} experts per token do not fit in max_groups_per_token={max_groups} group(s) of "
                         f"{per_group} experts")
    best = select.detach().reshape(tokens, groups, per_group).topk(max(1, k // max_groups), dim=-1).values.sum(-1)
    chosen = best.topk(max_groups, dim=-1).indices
    return torch.zeros(tokens, groups, dtype=torch.bool, device=select.device).scatter_(1, chosen, True)


def gate_normalization(train_k: int, normalize: Optional[bool]) -> bool:
    """The gate rule of every router, fixed when the router is built: renormalise the gates over
    the chosen experts or not.

    ``normalize`` (the ``normalize`` option) decides when it is set; unset, the gates are
    renormalised when the router trains with more than one expert per token (``train_k``: its
    ``top_k``, or the k a k schedule ends with) and left as the raw top probability at top-1
    (Switch: a renormalised top-1 gate is 1, with no gradient for the router). Routing at another
    k (an inference k, a k schedule's earlier steps) changes only which experts are chosen, never
    this rule. ``normalize: true`` renormalises at every k, as the HyperRouter / SMoE-Dropout
    reference code does (a softmax over the chosen logits: a gate of 1 at k = 1)."""
    return (train_k > 1) if normalize is None else bool(normalize)


def check_eval_k(k: Optional[int], num_experts: int) -> Optional[int]:
    """``model.moe.router_options.eval_k`` is null or an integer in ``[1, num_experts]``."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ConfigError(f"model.moe.router_options.eval_k must be an integer in [1, num_experts={num_experts}] "
                          f"or null, got {k!r}")
    return int(k)


def set_inference_k(model: nn.Module, k: Optional[int]) -> int:
    """Route with ``k`` experts per token in eval mode in every router of ``model`` that has an
    inference k (None: back to the k training ends with). Returns the number of routers changed."""
    routers = [m for m in model.modules() if isinstance(m, Router) and m.has_inference_k]
    for r in routers:
        r.set_eval_k(k)
    return len(routers)


def layout_invariant_normal(shape_tail: tuple[int, ...], ctx: RoutingContext, local_tokens: int, salt: int, device) -> torch.Tensor:
    """Standard normal noise ``[local_tokens, *shape_tail]`` that does not depend on the layout.

    The noise of the whole global batch is drawn from a generator seeded by (seed, step,
    micro-step, layer, salt) and each rank keeps its own rows, so R ranks draw exactly what
    one process draws for the concatenated batch.
    """
    total = ctx.global_tokens if ctx.global_tokens is not None else local_tokens
    seed = (ctx.seed * 1_000_003 + ctx.step * 10_007 + ctx.micro_step * 101 + ctx.layer_idx * 7 + salt) % (2**63 - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    noise = torch.randn((total,) + tuple(shape_tail), generator=gen, device=device, dtype=torch.float32)
    return noise[ctx.token_offset : ctx.token_offset + local_tokens]


def synchronize_frozen_routers(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> int:
    """:meth:`Router.synchronize_frozen` for every router of ``model`` (collective over ``group``,
    default: the world). Call after ``apply_expert_parallel`` and after loading a checkpoint.
    Returns the number of routers that had frozen tensors."""
    return sum(bool(m.synchronize_frozen(group, name)) for name, m in model.named_modules() if isinstance(m, Router))
