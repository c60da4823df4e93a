"""Checkpoints with torch.distributed.checkpoint (DCP), independent of the parallel layout.

One module per concept, each importing only the ones listed before it:

* :mod:`.files`: the directory of one checkpoint and its crash safety (partial directory,
  manifest, atomic rename, checksums, the safe metadata reader), finding the latest one, pruning;
* :mod:`.collective`: small collectives of host objects (a failure on one rank fails all);
* :mod:`.rng`: every rank's RNG states as tensors;
* :mod:`.state`: the model and optimizer state keyed by global expert (layout-independent);
* :mod:`.checkpointer`: :class:`Checkpointer`, the collective save (also async) and the checked load;
* :mod:`.holder`: a node's host-memory holder of in-memory snapshot shards (/dev/shm), their packed
  form, and the merge of one step's shards into a checkpoint directory;
* :mod:`.snapshots`: :class:`~.snapshots.Snapshots` (``ckpt.memory_every``): taking them (buddy copy on
  another node) and choosing / fetching the newest complete one on a restart;
* :mod:`.resume`: :class:`TrainingCheckpoints`, what the trainer saves and the resume policy
  (the newest complete in-memory snapshot first, when newer than the disk checkpoint).

What a checkpoint holds: one DCP state dict of tensors only (the model's weights with experts
keyed by global index, ``optim.<parameter>.<state>``, ``rng.rank_<r>.<generator>``), ``meta.json``
(step, data sampler position, learning-rate schedule, layout, the resolved config) and
``COMPLETE`` (the manifest). Nothing in it is ever unpickled beyond DCP's allowlisted metadata
and weights-only tensor records (:class:`~.files.SafeFileSystemReader`).
"""
from .checkpointer import Checkpointer, check_model_tensors, config_sha256, load_checkpoint, save_checkpoint
from .files import (META, CheckpointError, DamagedCheckpoint, IncompleteCheckpoint, UnsafeCheckpoint, latest_checkpoint,
                    read_manifest, read_meta, step_dir)
from .files import MARKER  # the completion marker's file name, COMPLETE
from .resume import TrainingCheckpoints, model_differences
from .state import expert_keyed_state_dict, optimizer_state_dict

__all__ = ["MARKER", "META", "CheckpointError", "DamagedCheckpoint", "IncompleteCheckpoint", "UnsafeCheckpoint",
           "Checkpointer", "TrainingCheckpoints", "check_model_tensors",
           "config_sha256", "expert_keyed_state_dict", "latest_checkpoint", "load_checkpoint", "model_differences",
           "optimizer_state_dict", "read_manifest", "read_meta", "save_checkpoint", "step_dir"]
