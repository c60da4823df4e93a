"""The output directory of a conversion from a Hugging Face checkpoint: what ``moe-dist import``
and ``moe-dist upcycle`` write alike.

Both write ``config.yaml`` (our config, ``ckpt.init_from`` pointing at the directory,
``data.tokenizer`` at the copied tokenizer), the weights (``model.safetensors`` or shards and an
index, in the output dtype), the tokenizer files and a record (``import.json`` /
``upcycle.json``) written last: its presence means a finished conversion. The directory is made
beside ``--out`` and moved into place when complete (:class:`~moe_dist.weights.OutputDirectory`).
Before a weight is written the tokenizer is checked against the vocabulary and the source's
headers are checked whole (nothing missing, nothing unexplained).

It lives here rather than in :mod:`moe_dist.weights` because it adopts the Hugging Face tokenizer
and writes our config, which sit at and above that package's layer.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Optional

import torch

from ..config import Config, save_config
from ..errors import UsageError
from ..weights import OutputDirectory, ShardedWriter, output_dtype
from .config import kept_values, source_dtype
from .tokenizer import adopt_tokenizer, check_tokenizer_fits

Tensors = Iterable[tuple[str, torch.Tensor]]


def write_converted(kind: str, source_dir: str, source_name: str, out_dir: str, ckpt, cfg: Config, dtype: str, *,
                    tensors: Callable[[], Tensors], record: Callable[[torch.dtype], dict],
                    prepare: Optional[Callable[[], None]] = None, max_shard_bytes: int, log: Callable[[str], None],
                    started: float) -> tuple[dict, dict]:
    """Write the converted checkpoint of ``ckpt`` (a source checkpoint: ``spec``, ``family``,
    ``check_explained()``) to ``out_dir`` (replaced only when complete) and return its record
    (``<kind>.json``) and the parameter counts.

    ``prepare()`` runs once the tokenizer is adopted and ``cfg.ckpt.init_from`` is set, before
    any weight; ``tensors()`` yields the weights by name (cast to the output dtype here);
    ``record(out_dtype)`` gives the record's entries of this kind of conversion, called after the
    weights are written. ``source_name`` names the source in the refusal of ``--out`` = source."""
    from ..model.params import count_params  # the planner's counts, so presets and conversions agree

    out_dtype = output_dtype(dtype, source_dtype(ckpt.spec.raw))
    target = os.path.abspath(out_dir)
    if target == os.path.abspath(source_dir):
        raise UsageError(f"--out {out_dir!r} is the {source_name}'s directory; choose another")
    with OutputDirectory(target, kind) as out:
        n_tok = check_tokenizer_fits(source_dir, cfg.model.vocab_size)
        ckpt.check_explained()  # headers only: nothing missing, nothing unexplained, before the weights are written
        copied = adopt_tokenizer(source_dir, out.path, cfg.data, log, final_dir=target)
        cfg.ckpt.init_from = target  # `moe-dist train` starts from these weights
        if prepare is not None:
            prepare()
        writer = ShardedWriter(out.path, max_shard_bytes, metadata={"format_of": "moe_dist", **out.metadata})
        for name, t in tensors():
            writer.add(name, t.to(out_dtype))
        files = writer.close()
        save_config(cfg, os.path.join(out.path, "config.yaml"), home=target)
        counts = count_params(cfg.model)
        info = {"source": os.path.abspath(source_dir), "family": ckpt.family, "notes": ckpt.spec.notes,
                **record(out_dtype),
                "dtype": str(out_dtype).replace("torch.", ""), "weights": files, "tokenizer_files": copied,
                "tokenizer": cfg.data.tokenizer, "tokenizer_entries": n_tok,
                "total_params": counts["total"], "active_params": counts["active"],
                "source_config": kept_values(ckpt.spec.raw), "source_dtype": source_dtype(ckpt.spec.raw),
                "seconds": round(time.perf_counter() - started, 2)}
        out.finish(info)
    return info, counts
