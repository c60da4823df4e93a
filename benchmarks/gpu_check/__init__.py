"""The first run on a GPU: what the device is, whether the MoE layer and every router compute on it
what they compute on the CPU, the main job and a model that loads a GPU (tokens/s, MFU, peak memory),
peak memory against the dry run's, host synchronisations per step, the expert kernels against the floor.

    python -m benchmarks.gpu_check --out DIR [--device cuda|cpu] [--quick] [--budget-s 450]
                                       [--sections device,tests,...] [--work DIR]

Sections (:data:`SECTIONS`), each in a process of its own with its own time limit (shares of
``--budget-s`` that finished sections hand on), a failed or timed-out section reported with its
last lines while the others still run:

- ``device``: torch, CUDA, the GPU, CPUs; a measured bf16 matmul rate beside the datasheet's;
- ``tests``: ``tests/test_device_layer.py`` on the device (every router's layer against the CPU);
- ``train``: ``moe-dist train`` of the main job (configs/tiny.yaml, one process) and of a 2-block
  slice of configs/tinyllama-upcycle-8x2.yaml at sequence length 2048, bf16: tokens/s, MFU, peak memory;
- ``memory_vs_dry_run``: that slice's peak allocated memory against ``moe-dist plan --dry-run``'s;
- ``host_syncs``: CUDA synchronisations and device-to-host copies per training step (profiler);
- ``layer_bench``: ``python -m benchmarks.layer``, each expert kernel against the floor.

``DIR`` receives at most four files: ``gpu_check.json`` (every section: status ok / failed /
skipped, seconds, figures, the error's last lines), ``gpu_check.md`` (a short summary), ``sections.log``
(what the sections printed) and, from ``scripts/gpu_check.sh``, ``gpu_check.log``; the runs
themselves go to ``--work``. The JSON and the summary are rewritten after every section, so a run
stopped from outside keeps what it finished. ``--device cpu`` runs everything on the CPU at small
sizes (the check's own test).

The pieces: :mod:`.settings` (paths, sections, sizes), :mod:`.context` (what a section sees), one
module per section (:mod:`.device`, :mod:`.device_tests`, :mod:`.train`, :mod:`.memory`,
:mod:`.host_syncs`, :mod:`.layer_bench`), :mod:`.runner` (each section in its own process, the
budget), :mod:`.report` (gpu_check.json and gpu_check.md), :mod:`.__main__` (the command line).
The machine's helpers come from the package: :func:`moe_dist.hardware.synchronize`,
:func:`~moe_dist.hardware.matmul_peak`, :func:`~moe_dist.hardware.datasheet_tflops` and the
trainer's MFU arithmetic, :class:`moe_dist.train.observe.mfu.Utilisation`.
"""
