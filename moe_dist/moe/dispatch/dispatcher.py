"""The interface of a token dispatcher: the three phases an MoE layer's forward runs, once each.

A dispatcher is chosen once per layer, when its process groups are set
(:meth:`~moe_dist.moe.layer.MoELayer.set_groups`): :class:`~moe_dist.moe.dispatch.flat.FlatDispatcher`
(the default, and one process) or :class:`~moe_dist.moe.dispatch.hierarchical.HierarchicalDispatcher`
(``parallel.dispatch: hierarchical`` over several nodes). Both give bit-identical outputs and
gradients; they differ in the rows that cross nodes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Protocol

import torch

from ..routing_types import Routing


class Plan(Protocol):
    """What every dispatcher's plan tells the layer after :meth:`Dispatcher.dispatch`."""

    read_along: Optional[list]  # host values of the caller's ``read_along`` tensor
    inter_node_pairs: Optional[int]  # kept pairs whose expert is on another node (None: one node)
    inter_node_rows: Optional[int]  # rows this rank sent to other nodes


class Dispatcher(ABC):
    """One forward's rows: :meth:`dispatch` lays them out for the experts (with the forward's one
    host read), :meth:`experts` runs the experts on them (exchanging them with expert
    parallelism), :meth:`combine` sums the outputs into their tokens, weighted by the gates."""

    name: str = ""  # parallel.dispatch as it runs: "flat" or "hierarchical"

    @abstractmethod
    def dispatch(self, rows: torch.Tensor, routing: Routing, keep: Optional[torch.Tensor],
                 read_along: Optional[torch.Tensor], peer_counts: Optional[torch.Tensor] = None,
                 host_counts: Optional[list[list[int]]] = None) -> tuple[torch.Tensor, Plan]:
        """The kept pairs' rows of ``rows`` ``[T, d]`` (``routing``'s choices, ``keep`` the capacity's
        mask, None: all kept), and the plan. ``read_along``: a small integer tensor that rides on the
        dispatch's host read (``plan.read_along``); ``peer_counts``: ``[ep, E]`` every
        expert-parallel peer's kept pairs per expert when already known; ``host_counts``: the same,
        modelled on the host (a dry run)."""

    @abstractmethod
    def experts(self, experts: torch.nn.Module, routed: torch.Tensor, plan: Plan) -> torch.Tensor:
        """The experts' outputs for ``routed``, in the same row order."""

    @abstractmethod
    def combine(self, y: torch.Tensor, plan: Plan, num_tokens: int) -> torch.Tensor:
        """The outputs ``y`` summed into ``num_tokens`` rows, weighted by the gates."""
