"""The last step of a prepare spread over tasks (a Slurm array): check the parts, list their shards.

Task ``i`` of ``N`` writes ``OUT/part-IIIII/`` (its own complete prepare of a slice of the
inputs). :func:`combine_parts` checks that every part is complete, that all used one tokenizer
and one validation rule, and that each shard's files hold the tokens its record says; then it
writes ``OUT/manifest.json`` listing the parts' shards in task order, so ``OUT`` reads as one
dataset.
"""
from __future__ import annotations

import glob
import os
import shutil

from ..errors import InputError
from .indexed import IndexedFile
from .pipeline import MANIFEST, read_record, write_record


def part_dir(out: str, task: int) -> str:
    return os.path.join(out, f"part-{task:05d}")


def combine_parts(out: str) -> dict:
    """Write and return ``OUT/manifest.json`` from the finished parts under ``out``."""
    parts = sorted(glob.glob(os.path.join(out, "part-*")))
    if not parts:
        raise InputError(f"{out}: no part-NNNNN directories (the tasks of a spread prepare write them)")
    manifests = []
    for p in parts:
        path = os.path.join(p, MANIFEST)
        if not os.path.isfile(path):
            raise InputError(f"{p}: not finished (no {MANIFEST}); run its task again, it resumes")
        manifests.append(read_record(path))
    tasks = {m["task"][1] for m in manifests}
    seen = sorted(m["task"][0] for m in manifests)
    if len(tasks) != 1 or seen != list(range(next(iter(tasks)))):
        raise InputError(f"{out}: parts of tasks {seen} of {sorted(tasks)}; every task 0..N-1 of one array must be there")
    first = manifests[0]
    for p, m in zip(parts, manifests):
        for key in ("tokenizer", "validation", "dtype"):
            if m[key] != first[key]:
                raise InputError(f"{p}: its {key} differs from {parts[0]}'s ({m[key]} vs {first[key]})")
    shards = []
    for p, m in zip(parts, manifests):
        rel = os.path.basename(p)
        for sh in m["shards"]:
            for split in ("train", "val"):
                f = IndexedFile(os.path.join(p, sh[split]))
                if f.documents_tokens() != sh[f"{split}_tokens"] or f.num_documents != sh[f"{split}_documents"]:
                    raise InputError(f"{f.prefix}: {f.documents_tokens()} tokens in {f.num_documents} documents, its "
                                     f"record says {sh[split + '_tokens']} in {sh[split + '_documents']}")
            shards.append({**sh, "train": f"{rel}/{sh['train']}", "val": f"{rel}/{sh['val']}"})
    total = {k: sum(m[k] for m in manifests) for k in ("token_count", "documents", "characters", "empty_records")}
    splits = {s: {k: sum(m["splits"][s][k] for m in manifests) for k in ("tokens", "documents")} for s in ("train", "val")}
    combined = {**first, **total, "shards": shards, "splits": splits, "task": [0, 1],
                "source": {**first["source"], "files": sum(m["source"]["files"] for m in manifests),
                           "bytes": sum(m["source"]["bytes"] for m in manifests)},
                "bad": {"count": sum(m["bad"]["count"] for m in manifests),
                        "first": [b for m in manifests for b in m["bad"]["first"]][:10]},
                "seconds": max(m["seconds"] for m in manifests), "parts": len(parts)}
    shutil.copyfile(os.path.join(parts[0], first["tokenizer"]["file"]), os.path.join(out, first["tokenizer"]["file"]))
    write_record(os.path.join(out, MANIFEST), combined)
    return combined
