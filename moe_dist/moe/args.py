"""The MoE layer's arguments as one object, and every rule about them in one place.

:class:`MoEArgs` is what :class:`~moe_dist.moe.layer.MoELayer` is built from. The config schema
embeds it (``model.moe`` is a :class:`~moe_dist.config.schema.MoEConfig`, a subclass that adds
which blocks are MoE blocks), so a key's type, bounds, default and help are declared here once,
and :meth:`MoEArgs.validated` is the one check the config (before launch) and the layer (when
built) both run: a bad value reads the same wherever it is caught.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal, Optional

from ..checks import check_field, knob
from ..distributed.topology import NodeLayout
from .routers import check_group_limit, check_router_features, check_router_options, check_top_k, router_largest_k
from .shared import check_shared_expert

KEY = "model.moe"  # the config key of these arguments; errors name ``model.moe.<field>``


@dataclass
class MoEArgs:
    """How an MoE layer routes, drops, balances and computes (``model.moe`` in a config)."""

    router: str = knob("topk", "router name (see moe_dist.moe.routers)")
    router_options: dict = knob({}, "keyword options of the router (its __init__ arguments)")
    num_experts: int = knob(8, "experts per MoE layer", min=1, max=1 << 16)
    top_k: int = knob(2, "experts per token", min=1, max=1 << 16)
    d_ff: Optional[int] = knob(None, "hidden size of one expert (null = model.d_ff)", min=1, max=1 << 20)
    capacity_factor: Optional[float] = knob(None, "tokens per expert = cf * tokens * k / E; null = dropless", gt=0)
    eval_capacity_factor: Optional[float] = knob(None, "capacity factor in evaluation (null = capacity_factor)", gt=0)
    min_capacity: int = knob(0, "lower bound on the per-expert capacity", min=0)
    drop_policy: Literal["position", "probs"] = knob("position", "which pairs an over-full expert drops")
    capacity_scope: Literal["global", "local"] = knob("global", "capacity over the global batch or per rank")
    loss_scope: Literal["global", "local"] = knob("global", "aux / z statistics over the global batch or per rank")
    aux_loss_coef: float = knob(0.01, "load-balance loss weight", min=0)
    z_loss_coef: float = knob(0.001, "router z-loss weight", min=0)
    activation: Literal["swiglu", "gelu"] = knob("swiglu", "expert activation")
    expert_kernel: Literal["auto", "loop", "bmm", "grouped_mm"] = knob(
        "loop", "expert matmul kernel: loop, bmm, grouped_mm, or auto (timed once per expert shape, the same on every "
        "rank); timings in benchmarks/results/layer.md")
    balance_loss: Literal["batch", "sequence"] = knob("batch", "load-balance loss: batch (Switch/GShard over the batch) or "
                                                      "sequence (DeepSeek-V2/V3: per sequence, averaged over sequences)")
    shared_d_ff: Optional[int] = knob(None, "hidden size of the always-active shared expert(s) beside the routed ones "
                                      "(null = none)", min=1)
    shared_gate: bool = knob(False, "scale the shared expert per token by sigmoid(x w) (Qwen2-MoE's shared_expert_gate)")
    expert_bias: bool = knob(False, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the router "
                             "probabilities for choosing only, updated after each optimizer step from the global counts")
    expert_bias_rate: float = knob(1e-3, "expert-bias update per step: bias += rate * sign(mean count - count)", min=0)
    router_dtype: Literal["fp32", "fp64"] = knob("fp32", "dtype of the router's scores and softmax")
    router_groups: Optional[int] = knob(None, "node-limited routing: the experts in G contiguous groups (group g = "
                                        "experts [g E/G, (g+1) E/G)); G = the expert-parallel nodes makes a group one "
                                        "node's experts; null = no groups", min=1)
    max_groups_per_token: Optional[int] = knob(None, "node-limited routing: each token's experts come from its M best "
                                               "groups (a group's score: the sum of its top max(1, k // M) selection "
                                               "scores), so a token reaches at most M nodes; null = no limit", min=1)

    def validated(self) -> "MoEArgs":
        """A copy with every value in canonical form (an integer given for a number is that number),
        after every rule: each field's type and bounds, the router and its options, ``top_k``
        against ``num_experts``, the expert groups, the features the router supports and the
        shared-expert options.
        Raises :class:`~moe_dist.errors.ConfigError` naming the ``model.moe`` key."""
        hints = typing.get_type_hints(MoEArgs)
        values = {f.name: check_field(getattr(self, f.name), hints[f.name], f"{KEY}.{f.name}", f.metadata)
                  for f in dataclasses.fields(MoEArgs)}
        out = dataclasses.replace(self, **values)
        options = check_router_options(out.router, out.router_options)
        check_top_k(out.num_experts, out.top_k)
        check_group_limit(out.num_experts, router_largest_k(out.router, out.top_k, options), out.router_groups,
                          out.max_groups_per_token)
        check_router_features(out.router, out.expert_bias, out.router_dtype, out.max_groups_per_token is not None)
        check_shared_expert(out.shared_d_ff, out.shared_gate)
        return out

    def node_limit_warning(self, ep_nodes: NodeLayout) -> str:
        """A warning when ``max_groups_per_token`` does not bound the nodes a token reaches: the
        expert-parallel group (``ep_nodes``, the node of each peer) spans several nodes, but an expert
        group does not sit on one node ('' otherwise). Experts are placed in ep rank order, so a group
        sits on one node when ``router_groups`` is a multiple of the nodes and every node holds an
        equal, consecutive block of ep ranks."""
        if self.max_groups_per_token is None or not ep_nodes.multi_node:
            return ""
        nodes = ep_nodes.num_nodes
        if self.router_groups % nodes == 0 and ep_nodes.node_blocks():
            return ""
        return (f"warning: model.moe.max_groups_per_token={self.max_groups_per_token} limits a token to that many "
                f"expert groups, not nodes: the expert-parallel group spans {nodes} nodes "
                f"(ep ranks' nodes {list(ep_nodes.node_of)}) and model.moe.router_groups={self.router_groups} groups "
                f"do not each sit on one node; use a multiple of {nodes} with an equal block of ep ranks per node")

    def capacity_factor_for(self, training: bool) -> Optional[float]:
        """The capacity factor of a training or an evaluation forward (None: dropless)."""
        if training or self.eval_capacity_factor is None:
            return self.capacity_factor
        return self.eval_capacity_factor
