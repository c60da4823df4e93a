"""What a failed collective was: its name, its group's ranks and the caller, read from the traceback.

A collective that times out (``parallel.timeout_s``) or whose peer went away raises a
``RuntimeError`` from inside ``torch.distributed``; the message of the backend says neither
which collective nor which ranks. The traceback does: the innermost frame in
``distributed_c10d.py`` is the collective, its ``group`` argument names the ranks, and the
frame above it, in moe_dist, is the caller.

    info = failed_collective(exc)         # None if exc did not come out of a collective
    if info and info.timed_out: print(info.describe(timeout_s=15))

An asynchronous collective (``async_op=True``) fails later, in its work handle's ``wait()``, a
frame of no collective: wait on it with :func:`wait_collective`, which names it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from .ranges import timed_range, kind_of

# the package's directory: frames of files under it are moe_dist's (a checkout is often itself named
# moe_dist, e.g. /opt/moe_dist in the Docker images, so a "/moe_dist/" in a path does not say it)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE + os.sep)


_TIMEOUT = re.compile(r"time[d]? ?out|timeout|deadline exceeded", re.IGNORECASE)
_PEER_LOST = re.compile(r"connection (closed|reset)|broken pipe|peer|socket closed|ECONNRESET|EPIPE|"
                        r"remote process exited|ProcessGroupGloo.*(abort|closed)", re.IGNORECASE)


@dataclass
class FailedCollective:
    name: str  # e.g. all_to_all_single
    ranks: Optional[list[int]]  # the group's global ranks (None: not known)
    caller: str  # "moe_dist/moe/dispatch/flat.py:88 in dispatch" (or "")
    timed_out: bool  # the backend gave up waiting (rather than losing a connection)
    peer_lost: bool  # a peer closed its connection (it exited or was killed)

    group: str = ""  # the group's name (ep, edp, world, checkpoint) when known

    def describe(self, timeout_s: Optional[float] = None) -> str:
        ranks = "ranks " + ", ".join(map(str, self.ranks)) if self.ranks else "its group"
        if self.group:
            ranks = f"the {self.group} group ({ranks})"
        where = f" (called from {self.caller})" if self.caller else ""
        if self.timed_out:
            limit = f" within parallel.timeout_s={timeout_s:g} s" if timeout_s else " within parallel.timeout_s"
            return (f"the collective {self.name} over {ranks} did not complete{limit}{where}: a rank of that group "
                    "stopped, hung or died; the job was stopped (resume=auto continues from the last checkpoint)")
        return f"the collective {self.name} over {ranks} failed{where}: another rank went away"


class AsyncCollectiveError(RuntimeError):
    """An asynchronous collective failed while its work was waited on (the backend's message, the
    collective's name and group attached)."""

    def __init__(self, name: str, group, cause: BaseException):
        super().__init__(str(cause))
        self.collective, self.group = name, group


def wait_collective(work, name: str, group=None) -> None:
    """``work.wait()`` of an ``async_op=True`` collective called ``name`` over ``group``; a failure
    is raised as :class:`AsyncCollectiveError` (``failed_collective`` reads it like a blocking one)."""
    try:
        with timed_range(kind_of(name)):
            work.wait()
    except RuntimeError as e:
        raise AsyncCollectiveError(name, group, e) from e


def _group(group) -> tuple[str, Optional[list[int]]]:
    from .groups import describe_group

    known = describe_group(group)
    if known:
        return known
    return "", _group_ranks(group)


def _group_ranks(group) -> Optional[list[int]]:
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:  # noqa: BLE001 - a destroyed or foreign group: ranks unknown
        return None


def failed_collective(exc: BaseException) -> Optional[FailedCollective]:
    """The collective ``exc`` was raised from, or None: the innermost frame of ``distributed_c10d.py``
    (else the outermost of ``torch.distributed``), its ``group`` argument and the moe_dist caller."""
    frames, tb = [], exc.__traceback__
    while tb is not None:  # outermost first
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    if isinstance(exc, AsyncCollectiveError):
        mine = os.path.abspath(__file__)
        ours = [f for f in frames if _ours(f.f_code.co_filename) and os.path.abspath(f.f_code.co_filename) != mine]
        return _described(exc.collective, exc.group, ours[-1] if ours else None, str(exc))
    c10d = [i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(f"distributed{os.sep}distributed_c10d.py")]
    anywhere = [i for i, f in enumerate(frames) if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.f_code.co_filename]
    if not (c10d or anywhere):
        return None
    i = c10d[-1] if c10d else anywhere[0]
    while frames[i].f_code.co_name.startswith("_") and i > 0 and frames[i - 1].f_code.co_filename == \
            frames[i].f_code.co_filename:  # a private helper: name the public collective that called it
        i -= 1
    frame = frames[i]
    ours = [f for f in frames[:i] if _ours(f.f_code.co_filename)]
    return _described(frame.f_code.co_name, frame.f_locals.get("group"), ours[-1] if ours else None, str(exc))


def _described(collective: str, group, caller_frame, message: str) -> FailedCollective:
    caller = ""
    if caller_frame is not None:
        short = os.path.relpath(os.path.abspath(caller_frame.f_code.co_filename), _PACKAGE).replace(os.sep, "/")
        caller = f"moe_dist/{short}:{caller_frame.f_lineno} in {caller_frame.f_code.co_name}"
    timed_out = bool(_TIMEOUT.search(message))
    name, ranks = _group(group)
    return FailedCollective(name=collective, ranks=ranks, caller=caller, timed_out=timed_out,
                            peer_lost=bool(_PEER_LOST.search(message)) and not timed_out, group=name)
