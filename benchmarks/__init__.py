"""Benchmarks. ``python -m benchmarks.layer`` measures one MoE layer (see benchmarks/README.md)."""
