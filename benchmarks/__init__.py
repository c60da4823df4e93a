"""Benchmarks and the GPU check, outside the installed package: run from a checkout's root,
``python -m benchmarks.layer`` (one MoE layer) and the others listed in benchmarks/README.md;
their figures are in benchmarks/results/, one page per subject."""
