"""Model directories written whole or not at all.

The commands that write a model directory (``import``, ``upcycle``, ``convert``, ``export``)
write it into ``<name>.partial-<host>-<pid>-<random>`` beside the target, their record file last
(:data:`~moe_dist.weights.records.RECORDS`: ``import.json``, ``upcycle.json``, ``convert.json``, ``export.json``; its
presence is the completion marker), and only then move it into place (an existing target is
renamed to ``<name>.replaced-...`` first and removed after). A failure removes the partial
directory and leaves the target exactly as it was (or absent); the error says so. What a killed
writer of this host left is tidied by the next writer of the same target: its partial directory
removed, and a target it had renamed aside but not replaced put back.

Their weights name the command in the safetensors metadata (:data:`~moe_dist.weights.records.WRITTEN_BY`), so a reader
(:func:`~moe_dist.weights.records.check_complete`, run by every :class:`~moe_dist.weights.SafetensorsCheckpoint`)
refuses a directory whose weights name a writer whose record is missing: a write that did not
finish, or a partial directory given by its own name.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import sys
from typing import Optional

from ..errors import CheckpointError, ConfigError, UsageError, UserError
from ..safe_io import MIB, UnreadableFile, read_json
from .records import RECORDS, WRITTEN_BY, writer_of
from .safetensors_io import SafetensorsCheckpoint

def stored_writer(directory: str) -> Optional[str]:
    """The command named by the metadata of the weights in ``directory``, or None (also for
    unreadable or absent weights)."""
    try:
        return writer_of(SafetensorsCheckpoint(directory, require_complete=False).metadata())
    except UserError:
        return None


def read_record(directory: str) -> tuple[Optional[str], Optional[dict]]:
    """``(writer, record)`` of the first record file in ``directory``, or ``(None, None)``."""
    for writer, name in RECORDS.items():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            try:
                return writer, read_json(path, 16 * MIB)
            except UnreadableFile as e:
                raise CheckpointError(str(e)) from None
    return None, None


def check_tokenizer_named(directory: str, data_tokenizer: Optional[str]) -> None:
    """Refuse to evaluate or train the weights in ``directory`` with a tokenizer built from the
    corpus when its import / upcycle record says they came without their own and ``data.tokenizer``
    (``data_tokenizer``) names none."""
    writer, record = read_record(directory)
    if data_tokenizer or writer not in ("import", "upcycle"):
        return
    if any(name in ("tokenizer.model", "tokenizer.json") for name in record.get("tokenizer_files") or []):
        return
    raise ConfigError(f"{directory} was converted by `moe-dist {writer}` from {record.get('source', 'a checkpoint')} "
                      "without its tokenizer: a tokenizer built from the corpus would give ids that mean nothing to the "
                      "model; name the model's tokenizer with data.tokenizer=PATH (its tokenizer.model or tokenizer.json)")


def _owner() -> str:
    """``<host>-<pid>``: who writes a partial directory (so a later writer can tell it is dead)."""
    return f"{re.sub(r'[^A-Za-z0-9.]', '_', socket.gethostname()) or 'host'}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class OutputDirectory:
    """``with OutputDirectory(out, "import") as o:`` write into ``o.path``, end with
    ``o.finish(record)``; on leaving, the directory replaces ``out``.

    ``out`` may be absent, an empty directory, an output of the same command (its record present,
    or, left by a write that did not finish, its weights naming the command; with
    ``replace_complete``), or anything with ``force`` (a ``--force`` option; None: the command has
    none). Anything else is refused before a byte is written."""

    def __init__(self, target: str, writer: str, *, replace_complete: bool = True, force: Optional[bool] = None):
        self.target = os.path.normpath(os.path.abspath(target))
        self.writer, self.record = writer, RECORDS[writer]
        self.replace_complete, self.force = replace_complete, force
        self.path = self._aside = ""
        self._finished = False
        self._existed = False

    @property
    def metadata(self) -> dict:
        """Safetensors metadata naming the writer (see :func:`~moe_dist.weights.records.check_complete`)."""
        return {WRITTEN_BY: self.writer}

    def _check_target(self) -> None:
        t = self.target
        if os.path.lexists(t) and not os.path.isdir(t):
            raise UsageError(f"--out {t!r} exists and is not a directory; choose another")
        self._existed = os.path.isdir(t)
        if not self._existed or not os.listdir(t) or self.force:
            return
        if self.replace_complete and (os.path.isfile(os.path.join(t, self.record)) or stored_writer(t) == self.writer):
            return
        what = f", and is not a `moe-dist {self.writer}` output (no {self.record})" if self.replace_complete else ""
        hint = " or pass --force to replace it" if self.force is not None else " or remove it first"
        raise UsageError(f"--out {t!r} exists and is not empty{what}; choose another directory{hint}")

    def _tidy(self, parent: str, name: str) -> None:
        """Undo what writers of this target on this host that died (``kill -9``) left beside it."""
        host = _owner().rsplit("-", 1)[0]
        for kind in (".replaced-", ".partial-"):  # a target renamed aside first: it is put back
            prefix = f"{name}{kind}{host}-"
            for entry in sorted(os.listdir(parent)):
                pid = entry[len(prefix):].split("-")[0] if entry.startswith(prefix) else ""
                if not pid.isdigit() or _alive(int(pid)):
                    continue
                path = os.path.join(parent, entry)
                if kind == ".replaced-" and not os.path.lexists(self.target):
                    os.rename(path, self.target)
                    print(f"moe-dist {self.writer}: put {entry} back as {name}: a write that did not finish had "
                          "moved it aside", flush=True)
                else:
                    shutil.rmtree(path, ignore_errors=True)
                    print(f"moe-dist {self.writer}: removed {entry}, left by a write that did not finish", flush=True)

    def __enter__(self) -> "OutputDirectory":
        parent, name = os.path.split(self.target)
        if os.path.isdir(parent):
            self._tidy(parent, name)
        self._check_target()
        os.makedirs(parent, exist_ok=True)
        while True:  # os.mkdir, not mkdtemp: the directory gets the umask's permissions, as the target would
            tag = f"{_owner()}-{secrets.token_hex(4)}"
            self.path, self._aside = (os.path.join(parent, f"{name}{kind}{tag}") for kind in (".partial-", ".replaced-"))
            try:
                os.mkdir(self.path)
                return self
            except FileExistsError:
                continue

    def finish(self, record: dict) -> None:
        """Write the record (the completion marker): the last file of the directory."""
        with open(os.path.join(self.path, self.record), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        self._finished = True

    def _state(self) -> str:
        return f"{self.target} was left as it was" if self._existed else f"{self.target} was not created"

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and not self._finished:
            exc = RuntimeError(f"{self.writer}: the output was not finished (no {self.record} written)")
        if exc_type is not None or not self._finished:
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, UserError) and exc.args:  # the one line the command prints says it
                exc.args = (f"{exc.args[0]}; {self._state()}", *exc.args[1:])
            else:
                print(f"moe-dist {self.writer}: {self._state()} (the partial output was removed)", file=sys.stderr,
                      flush=True)
            if exc_type is None:
                raise exc
            return False
        self._move_into_place()
        return False

    def _move_into_place(self) -> None:
        if not os.path.exists(self.target):
            os.rename(self.path, self.target)
            return
        os.rename(self.target, self._aside)
        try:
            os.rename(self.path, self.target)
        except BaseException:
            os.rename(self._aside, self.target)
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        shutil.rmtree(self._aside, ignore_errors=True)
