"""How an MoE layer's routed rows reach their experts and come back.

:mod:`.dispatcher`: the one interface the layer calls (dispatch, experts, combine);
:mod:`.flat`: every pair's row straight to its expert's rank (sort-based, no capacity padding);
:mod:`.hierarchical`: node-aware, a token crosses to a remote node once;
:mod:`.exchange`: the expert-parallel all-to-alls, overlapped with the loop kernel;
:mod:`.loop_kernel`: the loop expert kernel's spans; :mod:`.traffic`: the bytes the exchanges send;
:mod:`.counting`: integer histograms (kept pairs per expert).

Nothing is imported here: the experts import the exchange, and the dispatchers import the experts.
"""
