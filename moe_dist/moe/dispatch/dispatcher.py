"""The interface of a token dispatcher: the three phases an MoE layer's forward runs, once each.

A dispatcher is chosen once per layer, when its process groups are set
(:meth:`~moe_dist.moe.layer.MoELayer.set_groups`): :class:`~moe_dist.moe.dispatch.flat.FlatDispatcher`
(the default, and one process) or :class:`~moe_dist.moe.dispatch.hierarchical.HierarchicalDispatcher`
(``parallel.dispatch: hierarchical`` over several nodes). Both give bit-identical outputs and
gradients; they differ in the rows that cross nodes. The dispatcher owns every exchange (the one
overlapped with the loop kernel included, :func:`~moe_dist.moe.dispatch.exchange.experts_across`);
the experts only compute.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..routing.types import Routing


@dataclass(frozen=True)
class DispatchCall:
    """What one forward tells the dispatcher besides its rows and routing.

    keep: the capacity's mask ``[T, k]`` (None: every pair kept).
    read_along: a small integer tensor that rides on the dispatch's host read (``plan.read_along``).
    known_counts: ``[ep, E]`` every expert-parallel peer's kept pairs per expert when the layer knows
        them already (dropless: the gathered routing statistics), a tensor on the device, or a dry
        run's modelled counts on the host (a list of lists: then nothing is read from the device);
        None: the dispatcher exchanges or gathers them itself."""

    keep: Optional[torch.Tensor] = None
    read_along: Optional[torch.Tensor] = None
    known_counts: Optional[object] = None


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
    models_counts: bool = True  # whether a dry run's modelled counts can stand in for its host read

    @abstractmethod
    def dispatch(self, rows: torch.Tensor, routing: Routing, call: DispatchCall) -> tuple[torch.Tensor, Plan]:
        """The kept pairs' rows of ``rows`` ``[T, d]`` (``routing``'s choices, ``call.keep`` of them),
        and the plan."""

    @abstractmethod
    def experts(self, experts: torch.nn.Module, routed: torch.Tensor, plan: Plan) -> torch.Tensor:
        """The experts' outputs for ``routed``, in the same row order."""

    @abstractmethod
    def combine(self, y: torch.Tensor, plan: Plan, num_tokens: int) -> torch.Tensor:
        """The outputs ``y`` summed into ``num_tokens`` rows, weighted by the gates."""
