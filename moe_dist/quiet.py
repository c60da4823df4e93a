"""Silencing a native library's writes to stderr for the length of a call.

Some calls into torch's C++ write to file descriptor 2 directly (a store's failed connection
with a stack trace, the profiler's start and stop lines), where Python's ``sys.stderr`` cannot
catch them. :func:`native_stderr_silenced` points descriptor 2 at /dev/null and back; whatever
another thread writes to stderr meanwhile is lost too, so it only wraps short calls.
"""
from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 to /dev/null for the block (nothing done when there is no descriptor 2)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
