"""A corpus: text or JSON-lines files, read as documents, split into train / validation.

A document is a whole text file or one JSON-lines record. A document belongs to the
validation split when a hash of its name (relative path, plus the line number for a
JSON-lines record) falls under ``val_fraction``: the split does not depend on file order,
machine or process count, and adding files does not move existing documents.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from ..errors import InputError, MissingInputError
from ..safe_io import kind_of, open_regular

TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier: relative path[:line]
    text: str


def _is_jsonl(path: Path, fmt: str) -> bool:
    return fmt == "jsonl" or (fmt == "auto" and path.name.endswith(JSONL_SUFFIXES))


def corpus_files(corpus: str, pattern: Optional[str] = None) -> list[Path]:
    """The files of a corpus, sorted by relative path."""
    root = Path(corpus)
    if root.is_file():
        return [root]
    if os.path.exists(corpus) and not root.is_dir():
        raise InputError(f"data.corpus={corpus!r} is {kind_of(os.stat(corpus).st_mode)}; allowed: a text or JSON-lines "
                         "file, or a directory of them")
    if not root.is_dir():
        hint = (" (the default corpus comes from Debian's python3.11-doc package: run scripts/setup.sh as root "
                "or `apt-get install python3.11-doc`)") if "python3.11" in str(root) else ""
        raise MissingInputError(f"data.corpus={corpus!r} does not exist{hint}")
    if pattern:
        files = [p for p in root.glob(pattern) if p.is_file()]
    else:
        files = [p for p in root.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise MissingInputError(f"data.corpus={corpus!r} holds no files matching "
                                f"{pattern or '*' + ', *'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} (data.pattern)")
    return files


def _relative(path: Path, corpus: str) -> str:
    root = Path(corpus)
    return path.name if root.is_file() else path.relative_to(root).as_posix()


MAX_BAD_BYTES = 0.01  # a "text" file with more undecodable UTF-8 than this share (or any NUL byte) is not text


def not_text(data: bytes) -> Optional[str]:
    """Why ``data`` is not UTF-8 text (NUL bytes, or more than 1% of it undecodable), or None."""
    if b"\0" in data:
        return "it holds NUL bytes (a binary file?)"
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if bad > MAX_BAD_BYTES * max(len(text), 1):
        return f"{bad / max(len(text), 1):.0%} of it is not valid UTF-8"
    return None


def read_documents(corpus: str, pattern: Optional[str] = None, fmt: str = "auto",
                   jsonl_field: str = "text", skipped: Optional[list] = None,
                   bad: Optional[list] = None) -> Iterator[Document]:
    """Documents in a stable order. Files that are not text are left out; ``skipped`` (a list) is
    given ``(relative path, why)`` for each. A malformed JSON-lines record raises, unless ``bad``
    (a list) is given: then it is passed over and named there."""
    for path in corpus_files(corpus, pattern):
        rel = _relative(path, corpus)
        if _is_jsonl(path, fmt):
            with open_regular(str(path)) as f:
                for i, raw in enumerate(f):
                    if not raw.strip():
                        continue
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        if bad is not None:
                            bad.append((f"{rel}:{i + 1}", "not UTF-8"))
                            continue
                        raise InputError(f"{path}:{i + 1}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                         f"{e.start + 1}); data.format='jsonl' expects UTF-8 JSON lines") from None
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        if bad is not None:
                            bad.append((f"{rel}:{i + 1}", "not valid JSON"))
                            continue
                        # json's message ends with "at" where it names a position ("Invalid control character at")
                        raise InputError(f"{path}:{i + 1}: not valid JSON: {e.msg.removesuffix(' at')} at line {i + 1}, "
                                         f"column {e.colno} (character {e.pos + 1} of the line); data.format='jsonl' "
                                         "expects one JSON object per line") from None
                    if not isinstance(rec, dict) or not isinstance(rec.get(jsonl_field), str):
                        if bad is not None:
                            bad.append((f"{rel}:{i + 1}", f"no string field {jsonl_field!r}"))
                            continue
                        raise InputError(f"{path}:{i + 1}: no string field {jsonl_field!r} (data.jsonl_field)")
                    if rec[jsonl_field]:
                        yield Document(f"{rel}:{i + 1}", rec[jsonl_field])
        else:
            with open_regular(str(path)) as f:
                data = f.read()
            why = not_text(data)
            if why:
                if skipped is not None:
                    skipped.append((rel, why))
                continue
            text = data.decode("utf-8", errors="replace")
            if text:
                yield Document(rel, text)


def is_validation(name: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def corpus_fingerprint(corpus: str, pattern: Optional[str] = None) -> str:
    """sha256 over relative paths and file contents (what makes two corpora the same)."""
    h = hashlib.sha256()
    for path in corpus_files(corpus, pattern):
        h.update(_relative(path, corpus).encode("utf-8") + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0" + str(os.path.getsize(path)).encode())
    return h.hexdigest()
