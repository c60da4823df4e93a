"""The route stage: a router's call on a layer's rows, with the token layout it may ask for."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.collectives import all_gather_tensor, group_rank, group_size
from . import stand_in
from .routing_types import Routing, RouterInputs, RoutingContext


def token_layout(num_tokens: int, group: Optional[dist.ProcessGroup], device) -> tuple[int, int]:
    """(this rank's first token in the concatenated global batch, global tokens): one all-gather
    of the ranks' token counts over ``group``, read to the host once (a dry run: every rank holds
    ``num_tokens``, :mod:`~moe_dist.moe.stand_in`)."""
    if stand_in.active() is not None:
        return group_rank(group) * num_tokens, group_size(group) * num_tokens
    sizes = all_gather_tensor(torch.full((1,), num_tokens, device=device), group).view(-1).tolist()
    return sum(sizes[: group_rank(group)]), sum(sizes)


def route(router, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
    """``router`` on the rows ``x`` ``[T, d]``. Host synchronisation: one read of the ranks' token
    counts for a router with ``needs_token_layout`` (:func:`token_layout`), plus whatever the router
    itself reads (Sinkhorn: its stop test)."""
    if router.needs_token_layout:
        ctx.token_offset, ctx.global_tokens = token_layout(x.shape[0], ctx.stats_group, x.device)
    return router(x, ctx, inputs)
