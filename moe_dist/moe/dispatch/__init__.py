"""How an MoE layer's routed rows reach their experts and come back.

:mod:`.dispatcher`: the one interface the layer calls (dispatch, experts, combine) and its per-call
context; :mod:`.flat`: every pair's row straight to its expert's rank (sort-based, no capacity
padding); :mod:`.hierarchical`: node-aware, a token crosses to a remote node once;
:mod:`.layout`: where pairs go (their experts' nodes, the send order, the per-node sum order);
:mod:`.exchange`: every expert-parallel all-to-all, the one overlapped with the loop kernel
included (the experts only compute); :mod:`.traffic`: the bytes the exchanges send.

The dispatchers build on the experts (:mod:`moe_dist.moe.experts`) and the row helpers
(:mod:`moe_dist.moe.rows`); nothing below imports a dispatcher. Nothing is imported here.
"""
