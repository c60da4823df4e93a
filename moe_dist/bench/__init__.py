"""Benchmarks. ``python -m moe_dist.bench.layer`` measures one MoE layer (see bench/README.md)."""
