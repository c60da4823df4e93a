"""Bridges to other training frameworks. Each submodule imports its framework itself, so
``import moe_dist`` never needs one; ``moe_dist.integrations.megatron`` needs megatron-core
(the ``megatron`` extra: ``EXTRAS=dev,megatron bash scripts/setup.sh``)."""
