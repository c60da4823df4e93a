"""Files that someone else may have made: read them bounded, write beside them without following links.

A run directory, a checkpoint, a model directory or an input file may have been cut short by a
crash, filled by a full disk, or prepared by someone else. Every reader and writer of those files
goes through this module, so that one rule holds everywhere:

- **reads** open the file without blocking and take only regular files (a FIFO, a device, a
  socket or a directory is refused by name), up to a size limit given by the caller; text must be
  UTF-8 (the error names the line); JSON is strict (:func:`parse_json`): no duplicate keys, no
  NaN / Infinity, no number that is not a finite double, no integer longer than
  :data:`MAX_INT_DIGITS` digits, no nesting deeper than :data:`MAX_JSON_DEPTH`;
- **writes** go to a fresh temporary file (created exclusively, never through a link) in the
  target's directory and are renamed over the target (:func:`write_atomically`): a link planted
  at the target is replaced, never followed, and a crash leaves the old file whole; appends open
  the file with ``O_NOFOLLOW`` (:func:`open_append`); directories a run writes into must be real
  directories (:func:`own_directory`);
- **names** a file lists (a checkpoint's manifest, a weights index) stay inside their directory
  (:func:`confined`).

Failures raise :class:`UnreadableFile` or :class:`UnsafePath` with one line naming the file and
what is wrong; callers turn them into their own error classes (a damaged checkpoint, a bad input).
This module imports only :mod:`moe_dist.errors`, so every layer can use it.
"""
from __future__ import annotations

import errno
import fcntl
import io
import json
import math
import os
import stat
import tempfile
from typing import Any, BinaryIO, Optional

from .errors import UserError

MAX_JSON_DEPTH = 64  # a checkpoint's meta.json nests about 6 deep
MAX_INT_DIGITS = 30  # 2**64 has 20 digits; more than this is never a count, a size or a seed
KIB, MIB = 1 << 10, 1 << 20
LOG_LIMIT = 4 << 30  # a JSON-lines log a run appends to (metrics.jsonl: about 2 KB a step)


class UnreadableFile(UserError):
    """A file that is not a regular file, too large, not UTF-8 or not the JSON it should be.
    ``path`` is the file, ``why`` the reason without the path."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


class UnsafePath(UserError):
    """A path that leads outside where it must stay: a link where a run writes, a listed name that
    leaves its directory."""


# ---- reading ------------------------------------------------------------------------------------------
def kind_of(mode: int) -> str:
    """What a ``stat`` mode is, in words."""
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a regular file"


def open_regular(path: str, limit: Optional[int] = None) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file (links to one are fine) of at most
    ``limit`` bytes. Opening never blocks: a FIFO is refused instead of waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UnreadableFile(path, "does not exist") from None
    except OSError as e:
        raise UnreadableFile(path, f"cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(path, f"is {kind_of(st.st_mode)}, not a regular file")
        if limit is not None and st.st_size > limit:
            raise UnreadableFile(path, f"holds {st.st_size} bytes, more than the {_size(limit)} such a file may hold")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (a file that grows while read is cut there)."""
    with open_regular(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFile(path, f"grew past the {_size(limit)} such a file may hold while it was read")
    return data


def decode_utf8(data: bytes, path: str) -> str:
    """``data`` (the bytes of ``path``) as UTF-8; the error names the line and byte of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UnreadableFile(path, f"is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                                   f"(line {line})") from None


def read_text(path: str, limit: int) -> str:
    return decode_utf8(read_bytes(path, limit), path)


def parse_json(text: str, source: str, nonfinite: bool = False) -> Any:
    """Strict JSON (see the module's docstring); :class:`UnreadableFile` names ``source`` and the problem.
    ``nonfinite``: accept NaN, Infinity and -Infinity, as Python's json writes them (a metrics row of a
    skipped non-finite step)."""
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=float if nonfinite else _no_constant,
                           parse_int=_bounded_int, parse_float=float if nonfinite else _finite_float)
    except _Refused as e:
        raise UnreadableFile(source, f"not accepted as JSON: {e}") from None
    except RecursionError:
        raise UnreadableFile(source, f"not accepted as JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise UnreadableFile(source, f"not valid JSON ({e}; cut short by a crash or a full disk?)") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise UnreadableFile(source, f"not accepted as JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(path: str, limit: int = 16 * MIB) -> Any:
    """A JSON file of at most ``limit`` bytes, read as :func:`parse_json` reads text."""
    return parse_json(read_text(path, limit), path)


def read_json_lines(path: str, limit: int) -> tuple[list[dict], list[tuple[int, str, str]]]:
    """``(rows, bad)`` of a JSON-lines log (each line an object; NaN and Infinity allowed, as a log of
    figures holds them): the whole rows in order, and ``(line number, the line, why)`` for every line
    that is not one (a line cut by a crash, a line of another program). Blank lines are neither."""
    data = read_bytes(path, limit)
    rows, bad = [], []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = parse_json(decode_utf8(raw, path), f"{path} line {number}", nonfinite=True)
        except UnreadableFile as e:
            bad.append((number, raw.decode("utf-8", "replace"), e.why))
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append((number, raw.decode("utf-8", "replace"), "not a JSON object"))
    return rows, bad


class _Refused(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"key {json.dumps(key)} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is beyond a double's range")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a parsed value, iteratively (a deep value must not exhaust the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((child, depth + 1) for child in item)
    return deepest


def _size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / KIB:g} KiB" if n >= KIB else f"{n} bytes"


# ---- writing ------------------------------------------------------------------------------------------
def write_atomically(path: str, data: bytes | str, durable: bool = False) -> None:
    """Replace ``path`` by a file holding ``data``: written to a fresh temporary file in the same
    directory (created exclusively and without following links), then renamed over ``path``. A link
    at ``path`` is replaced, not followed; a crash leaves the old file whole. ``durable``: fsync the
    file and the directory too."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_directory(directory)


def write_json_atomically(path: str, obj: Any, durable: bool = False, indent: Optional[int] = 2,
                          sort_keys: bool = False) -> None:
    write_atomically(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n", durable=durable)


def write_figure(fig, path: str, **savefig_kwargs) -> None:
    """A matplotlib figure saved as PNG at ``path`` through :func:`write_atomically`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig_kwargs)
    write_atomically(path, buffer.getvalue())


def fsync_directory(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every file system lets a directory be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_append(path: str) -> io.TextIOWrapper:
    """``path`` opened for appending UTF-8 text, created if missing; a link there is refused
    (:class:`UnsafePath`), not followed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link to {os.readlink(path)!r}; refusing to write through it "
                             "(remove the link)") from None
        raise
    return io.TextIOWrapper(os.fdopen(fd, "wb"), encoding="utf-8", line_buffering=False)


def open_lock_file(path: str, flags: int) -> int:
    """``os.open(path, flags)`` for a lock file of a run directory, never through a link, and only a
    regular file: anything else is refused (:class:`UnsafePath`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link to {os.readlink(path)!r}; a run directory's lock file must "
                             "be a regular file (remove the link)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafePath(f"{path} is {kind_of(mode)}; a run directory's lock file must be a regular file (remove it)")
    return fd


def own_directory(parent: str, name: str) -> str:
    """``parent/name`` as a real directory (created if missing): a link there, or any other kind of
    file, is refused (:class:`UnsafePath`), so nothing is written or deleted outside ``parent``."""
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    refuse_link(path, "a run directory's sub-directory")
    if not os.path.isdir(path):
        raise UnsafePath(f"{path} is {kind_of(os.lstat(path).st_mode)}, where a directory belongs; move it away")
    return path


def refuse_link(path: str, what: str) -> None:
    """:class:`UnsafePath` if ``path`` is a symbolic link (``what``: what ``path`` must be, in words)."""
    if os.path.islink(path):
        raise UnsafePath(f"{path} is a symbolic link to {os.readlink(path)!r}; {what} must not be a link, so that "
                         "nothing is written or deleted outside it (remove the link; to keep a run on another disk, "
                         "link the run directory itself)")


# ---- names a file lists --------------------------------------------------------------------------------
def confined(directory: str, name: str, what: str) -> str:
    """``directory/name`` for a relative ``name`` that a file of ``directory`` lists (a weights
    index): :class:`UnsafePath` if it is absolute or climbs out with ``..``. ``what``: where the name
    was listed, in words. Links inside the directory are followed as they are (the Hugging Face cache
    links every file of a snapshot to its blob store)."""
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or ".." in parts or "\x00" in name:
        raise UnsafePath(f"{what} names {name!r}, a path outside {directory}; refused (a listed file must stay "
                         "inside its directory)")
    return os.path.join(directory, name)
