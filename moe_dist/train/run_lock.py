"""One run per run directory: an exclusive ``flock`` on ``<run.dir>/run.lock`` held for the run's life.

Rank 0 takes the lock before anything in the directory is touched and keeps the file open
until the run ends. The kernel drops the lock when the process ends, however it ends (a crash,
SIGKILL, a lost node's process), so a dead run never leaves the directory locked; the file's
text (pid, host, start time) only serves the message of a refused second run.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
from typing import Optional

LOCK_FILE = "run.lock"


class RunDirLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> Optional[str]:
        """Take the lock; returns None, or why the directory cannot be used (another run holds it)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            return (f"run.dir={os.path.dirname(self.path)!r} is in use by a live run ({holder}); wait for it to end, "
                    "stop it, or choose another run.dir")
        self._fd = fd
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:  # informational only: a full disk must not stop a run that holds the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started {stamp}\n".encode(), 0)
        except OSError:
            pass
        return None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
