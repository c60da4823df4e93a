"""Test infrastructure, not part of the trainer: the one home of the tools that test the project
as its users run it, on one machine.

- :mod:`.cluster`: several "nodes" on one machine (network namespaces on a bridge, each with its
  own address, host name and optionally a rate-limited link). Needs root and ``ip netns``.
- :mod:`.slurm`: a real Slurm cluster (munged, slurmctld, a slurmd per node) on this machine or on
  the nodes of a :class:`.cluster.Cluster`. Needs root and Debian's ``slurm-wlm`` / ``munge``.

Who uses it: the multi-node tests (``tests/test_multinode*.py``, ``tests/test_launch_slurm.py``,
``tests/helpers/multinode_harness.py``), ``scripts/cluster.sh`` (``python -m
moe_dist.testing.cluster``) and the cluster benchmarks in :mod:`moe_dist.bench`
(``plan_time_check``, ``node_dispatch_bench``, ``hierarchical_bytes``). No product module (the
trainer, the launchers, the command line) imports it; ``tests/test_imports.py`` places it below
:mod:`moe_dist.bench` in its layers so that those benchmarks may.
"""
