"""Who may use a run directory at the same time: one run, and any number of readers (``moe-dist eval``).

Two ``flock`` files in ``<run.dir>``:

* ``run.lock``: the run's, exclusive, held by rank 0 for the run's life: one run per directory.
* ``read.lock``: readers hold it shared while they read (:class:`RunDirReadLock`). A run holds it
  exclusive while it may move or delete what a reader reads: from its start through its resume
  (which tidies the directory: leftovers removed, checkpoints of another timeline moved aside,
  damaged ones renamed, metrics rows cut) until :meth:`RunDirLock.admit_readers`; afterwards it
  only publishes new checkpoints (an atomic rename of a finished directory) and prunes old ones
  when no reader is there (:func:`readers_excluded`). So a run does not start while a reader
  reads, a reader may read a run that trains, and what it reads is never removed under it.

The kernel drops a lock when its process ends, however it ends (a crash, SIGKILL, a lost node's
process), so a dead run or reader never leaves the directory locked; the files' text (pid, host,
start time) only serves the messages of a refusal.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import time
from typing import Iterator, Optional

from ...safe_io import UnsafePath, open_lock_file

LOCK_FILE = "run.lock"
READ_LOCK_FILE = "read.lock"
READ_WAIT_S = 10.0  # how long a reader waits for a run's start (or a pruning) before it gives up
_HOLDER_BYTES = 512


def _holder_text() -> bytes:
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {stamp}".encode().ljust(_HOLDER_BYTES)[:_HOLDER_BYTES]


def _write_holder(fd: int) -> None:
    """This process's pid, host and time at the start of the file (one fixed-size write: concurrent
    holders of a shared lock never mix their texts). Informational only: a full disk is ignored."""
    try:
        os.pwrite(fd, _holder_text(), 0)
    except OSError:
        pass


def _read_holder(fd: int, default: str) -> str:
    try:
        return os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace").strip() or default
    except OSError:
        return default


def _open(path: str, *, create: bool = True) -> Optional[int]:
    """A descriptor of the lock file ``path`` (created if needed), or None where it cannot be opened."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        return open_lock_file(path, flags)
    except OSError:
        try:  # a directory this process may only read: lock what is there
            return open_lock_file(path, os.O_RDONLY)
        except OSError:
            return None


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _unlock(fd: Optional[int]) -> None:
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class RunDirLock:
    """A run's hold on its directory: ``run.lock`` for its life, ``read.lock`` until :meth:`admit_readers`."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: Optional[int] = None
        self._read_fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Take both locks; returns None, or why the directory cannot be used (another run, or a reader, holds
        it; a lock file that is a link or not a regular file)."""
        try:
            return self._acquire()
        except UnsafePath as e:
            return str(e)

    def _acquire(self) -> Optional[str]:
        os.makedirs(self.run_dir, exist_ok=True)
        fd = open_lock_file(self.path, os.O_RDWR | os.O_CREAT)
        if not _try_lock(fd, fcntl.LOCK_EX):
            holder = _read_holder(fd, "another process")
            os.close(fd)
            return (f"run.dir={self.run_dir!r} is in use by a live run ({holder}); wait for it to end, stop it, or choose "
                    "another run.dir")
        try:
            read_fd = open_lock_file(os.path.join(self.run_dir, READ_LOCK_FILE), os.O_RDWR | os.O_CREAT)
        except BaseException:
            _unlock(fd)
            raise
        if not _try_lock(read_fd, fcntl.LOCK_EX):
            reader = _read_holder(read_fd, "another process")
            os.close(read_fd)
            _unlock(fd)
            return (f"run.dir={self.run_dir!r} is being read by `moe-dist eval` ({reader}); a run would move or delete "
                    "what it reads: start once it ends, or choose another run.dir")
        self._fd, self._read_fd = fd, read_fd
        try:  # informational only: a full disk must not stop a run that holds the lock
            os.ftruncate(fd, 0)
        except OSError:
            pass
        _write_holder(fd)
        return None

    def admit_readers(self) -> None:
        """The run has started and tidied its directory: readers may come (see :func:`readers_excluded`)."""
        _unlock(self._read_fd)
        self._read_fd = None

    def release(self) -> None:
        self.admit_readers()
        _unlock(self._fd)
        self._fd = None


class RunDirReadLock:
    """A reader's shared hold on ``read.lock``: no run starts, resumes or prunes checkpoints while it is held."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._fd: Optional[int] = None

    def acquire(self, wait_s: float = READ_WAIT_S) -> Optional[str]:
        """Take the shared lock, waiting up to ``wait_s`` while a run starts or prunes; returns None,
        or why the directory cannot be read now. A directory this process cannot write, without a
        ``read.lock``, is read without one (no run of this process's user can change it)."""
        try:
            fd = _open(os.path.join(self.run_dir, READ_LOCK_FILE))
        except UnsafePath as e:
            return str(e)
        if fd is None:
            return None
        deadline = time.monotonic() + wait_s
        while not _try_lock(fd, fcntl.LOCK_SH):
            if time.monotonic() >= deadline:
                run_fd = _open(os.path.join(self.run_dir, LOCK_FILE), create=False)
                holder = _read_holder(run_fd, "another process") if run_fd is not None else "another process"
                if run_fd is not None:
                    os.close(run_fd)
                os.close(fd)
                return (f"run.dir={self.run_dir!r}: the run there ({holder}) is starting, resuming or removing old "
                        f"checkpoints (waited {wait_s:g} s for it); try again in a moment")
            time.sleep(0.05)
        self._fd = fd
        _write_holder(fd)
        return None

    def release(self) -> None:
        _unlock(self._fd)
        self._fd = None


@contextlib.contextmanager
def readers_excluded(run_dir: str) -> Iterator[bool]:
    """For a run that is about to delete checkpoints (pruning): yields True while no reader holds
    ``read.lock`` (and none can take it), False when one does: then delete nothing now."""
    fd = _open(os.path.join(run_dir, READ_LOCK_FILE))
    if fd is None:
        yield True
        return
    if not _try_lock(fd, fcntl.LOCK_EX):
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        _unlock(fd)
