"""Bridges to other training frameworks. Each submodule imports its framework itself, so
``import moe_dist`` never needs one; ``moe_dist.integrations.megatron`` needs megatron-core
(``pip install 'moe_dist[megatron]'``)."""
