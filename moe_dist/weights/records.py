"""The completion records of the commands that write a model directory, and the check a reader runs
(:mod:`moe_dist.weights.output_dir` writes the directories; :class:`~moe_dist.weights.SafetensorsCheckpoint`
reads them)."""
from __future__ import annotations

import os
from typing import Optional

from ..errors import CheckpointError

RECORDS = {"import": "import.json", "upcycle": "upcycle.json", "convert": "convert.json", "export": "export.json"}
WRITTEN_BY = "written_by"  # safetensors metadata key: the command that wrote the weights


def writer_of(metadata: dict) -> Optional[str]:
    """The command named by a weights file's metadata (also the ``source`` key of earlier
    ``import`` / ``upcycle`` outputs), or None for weights written otherwise."""
    writer = metadata.get(WRITTEN_BY)
    if writer is None and metadata.get("format_of") == "moe_dist":
        writer = metadata.get("source")
    return writer if writer in RECORDS else None


def check_complete(directory: str, metadata: dict) -> None:
    """Refuse ``directory`` if its weights (``metadata``) were written by one of our commands and
    that command's record, written last, is missing."""
    writer = writer_of(metadata)
    if writer is not None and not os.path.isfile(os.path.join(directory, RECORDS[writer])):
        raise CheckpointError(f"{directory}: an incomplete `moe-dist {writer}` output ({RECORDS[writer]}, written "
                              f"last, is missing): its write did not finish; run `moe-dist {writer}` again")
