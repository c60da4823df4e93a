"""What a run that diverged leaves for the next start: checkpoints set aside and a record.

When training stops (or rolls back) for divergence, every complete checkpoint written after
the last healthy state (see :func:`last_good_step`) is renamed ``step_N.diverged``: kept, never
loaded by ``resume=auto``, never pruned. While ``moe-dist eval`` reads the run directory nothing
is moved under it (``read.lock``): the renames then wait for the next start, which makes them
before it picks a checkpoint (:func:`set_aside_pending`). ``run.dir/divergence.json`` records
the event::

    {"pending": {first_bad_step, last_good_step, stopped_at, reason, set_aside, resume_from,
                 resume_step, skipped_steps, rollbacks, automatic} or null,
     "history": [the events already taken up by a resume, each with resumed_at and skipped_batches]}

The next start takes the pending event up (:func:`take_pending`): ``resume=auto`` continues
from ``resume_from``, the run's counters continue from the event's, and the batches of steps
``resume_step + 1 .. first_bad_step`` may be skipped (``train.skip_divergent_batches``).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from ...safe_io import MIB, UnreadableFile, read_json
from ..setup.run_lock import readers_excluded
from .files import scan, set_aside, write_json_durably
from .schema import Boolean, Integer, ListOf, Nullable, Number, Obj, Text, mismatch

RECORD = "divergence.json"
DIVERGED_SUFFIX = ".diverged"
RECORD_LIMIT = 16 * MIB
# what record_divergence writes and the next start reads
PENDING = Obj({"first_bad_step": Integer(0), "last_good_step": Integer(0), "stopped_at": Integer(0), "reason": Text(),
               "set_aside": ListOf(Text()), "set_aside_later": Boolean(), "resume_from": Nullable(Text()),
               "resume_step": Integer(0), "skipped_steps": Integer(0), "rollbacks": Integer(0), "automatic": Boolean()},
              required=("first_bad_step", "last_good_step"))
RECORD_FIELDS = Obj({"pending": Nullable(PENDING), "history": ListOf(Obj({"resumed_at": Nullable(Number())}))})


def last_good_step(first_bad_step: int) -> int:
    """The last step whose state is trusted when step ``first_bad_step`` was the first bad one: the
    state after step ``first_bad_step - 1`` produced that bad step, so the last step whose
    successor was still healthy is ``first_bad_step - 2``."""
    return max(first_bad_step - 2, 0)


def set_aside_after(run_dir: str, step: int) -> list[str]:
    """Rename every complete checkpoint of a step after ``step`` to ``step_N.diverged``; returns the new paths."""
    return [set_aside(path, DIVERGED_SUFFIX) for saved, path in scan(run_dir)[0] if saved > step]


def set_aside_pending(run_dir: str, log: Callable[[str], None] = print) -> list[str]:
    """Rank 0 at a start, while it holds ``read.lock``: the renames a pending divergence could not make
    while a reader was there (none left otherwise); returns the new paths."""
    pending = read_record(run_dir, log)["pending"]
    return set_aside_after(run_dir, int(pending["last_good_step"])) if pending else []


def read_record(run_dir: str, log: Callable[[str], None] = print) -> dict:
    """The divergence record (empty where there is none). A record that is not whole or not of this
    form (a crash or a full disk cut it, or it was edited) is set aside as ``divergence.json.damaged``
    and said in one line: the checkpoints it set aside stay set aside, only its counters are lost."""
    path = os.path.join(run_dir, RECORD)
    if not os.path.lexists(path):
        return {"pending": None, "history": []}
    try:
        record = read_json(path, RECORD_LIMIT)
        problem = mismatch(record, RECORD_FIELDS)
    except UnreadableFile as e:
        problem = e.why
    if problem is not None:
        aside = set_aside(path)
        log(f"{path}: {problem}; set aside as {aside} (what it recorded is lost: the divergence's counters, and "
            f"checkpoints it had still to set aside as *{DIVERGED_SUFFIX} at this start)")
        return {"pending": None, "history": []}
    return {"pending": record.get("pending"), "history": list(record.get("history") or [])}


def record_divergence(run_dir: str, event: dict, rollback: bool) -> dict:
    """Rank 0: set aside the checkpoints after the event's ``last_good_step`` (at the next start if a
    reader is there: ``set_aside_later``) and record the event as pending. Returns the event completed with ``set_aside``, ``resume_from`` (the checkpoint
    ``resume=auto`` will take, or None: step 0), ``resume_step`` and ``automatic``: whether the job
    rolls back by itself (``rollback`` asked for it, and there is a checkpoint to roll back to: a
    start from step 0 is the operator's call)."""
    good = event["last_good_step"]
    with readers_excluded(run_dir) as alone:  # never move what `moe-dist eval` is reading
        later = [os.path.basename(p) + DIVERGED_SUFFIX for saved, p in scan(run_dir)[0] if saved > good]
        if alone:
            later = [os.path.basename(p) for p in set_aside_after(run_dir, good)]
    trusted = [p for saved, p in scan(run_dir)[0] if saved <= good]
    resume_from = trusted[-1] if trusted else None
    event = {**event, "set_aside": later, "set_aside_later": not alone, "resume_from": resume_from,
             "resume_step": _step_of(resume_from), "automatic": rollback and resume_from is not None}
    record = read_record(run_dir)
    if record["pending"]:  # a stop nobody resumed from: history too
        record["history"].append({**record["pending"], "resumed_at": None, "skipped_batches": 0})
    record["pending"] = event
    write_json_durably(os.path.join(run_dir, RECORD), record)
    return event


def take_pending(run_dir: str, resumed_at: int, skipped_batches: int) -> None:
    """Rank 0, once a start has taken the pending event up: move it to the history."""
    record = read_record(run_dir)
    if record["pending"] is None:
        return
    record["history"].append({**record["pending"], "resumed_at": resumed_at, "skipped_batches": skipped_batches})
    record["pending"] = None
    write_json_durably(os.path.join(run_dir, RECORD), record)


def _step_of(path: Optional[str]) -> int:
    return int(os.path.basename(path).split("_")[1]) if path else 0
