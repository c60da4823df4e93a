"""The routing stage of an MoE layer: :mod:`.stage` (:class:`RoutingStage`: route -> statistics ->
losses -> capacity -> the layer's statistics; used by ``MoELayer`` and the Megatron plug-in);
:mod:`.types` (what routers return and read), :mod:`.statistics` (the routing statistics and their
cross-rank reductions), :mod:`.losses`, :mod:`.capacity`, :mod:`.layer_stats`, :mod:`.stand_in`
(a dry run's routing model). The routers themselves are :mod:`moe_dist.moe.routers`."""
