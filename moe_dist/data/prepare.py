"""Turn a corpus into a cached, tokenized data directory (done once per corpus + settings).

    directory = prepare_data(cfg.data)          # builds it if missing (atomic), else reuses it
    data = load_prepared(directory)              # tokenizer, train / val token files, manifest

The cache directory name is a hash of everything the tokens depend on: the corpus content
(paths and bytes), pattern, format, JSON field, validation fraction and the tokenizer (its
training settings, or the hash of a given tokenizer.model). Building happens in a private
temporary directory that is renamed into place, so concurrent builders (one per node)
cannot leave a half-written cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from .corpus import corpus_fingerprint, is_validation, read_documents
from .tokenizer import Tokenizer, train_tokenizer
from .tokens import FORMAT, TokenFile, open_split, read_manifest, token_dtype, write_manifest, write_tokens
from ..errors import InputError


@dataclass
class PreparedData:
    directory: str
    manifest: dict
    tokenizer: Tokenizer
    train: TokenFile
    val: TokenFile

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def _tokenizer_spec(data_cfg) -> dict:
    if data_cfg.tokenizer:
        return {"model_sha256": Tokenizer.load(data_cfg.tokenizer).sha256}
    return {"train": {"vocab_size": data_cfg.vocab_size, "type": data_cfg.tokenizer_type,
                      "max_chars": data_cfg.tokenizer_max_chars}}


def data_key(data_cfg, fingerprint: Optional[str] = None) -> tuple[str, dict]:
    """(cache key, the settings it hashes)."""
    spec = {
        "format": FORMAT,
        "corpus_sha256": fingerprint or corpus_fingerprint(data_cfg.corpus, data_cfg.pattern),
        "pattern": data_cfg.pattern,
        "file_format": data_cfg.format,
        "jsonl_field": data_cfg.jsonl_field,
        "val_fraction": data_cfg.val_fraction,
        "tokenizer": _tokenizer_spec(data_cfg),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20], spec


def _build(directory: str, data_cfg, spec: dict, log) -> None:
    t0 = time.perf_counter()
    skipped: list[tuple[str, str]] = []
    docs = list(read_documents(data_cfg.corpus, data_cfg.pattern, data_cfg.format, data_cfg.jsonl_field, skipped))
    if skipped:
        shown = "; ".join(f"{name}: {why}" for name, why in skipped[:5])
        log(f"warning: data: left out {len(skipped)} file(s) of data.corpus that are not text ({shown}"
            f"{'; ...' if len(skipped) > 5 else ''})")
    train_docs = [d.text for d in docs if not is_validation(d.name, data_cfg.val_fraction)]
    val_docs = [d.text for d in docs if is_validation(d.name, data_cfg.val_fraction)]
    if not train_docs or not val_docs:
        raise InputError(f"data.val_fraction={data_cfg.val_fraction} put {len(val_docs)} of {len(docs)} documents in the "
                         f"validation split and {len(train_docs)} in training; both need at least one (documents are "
                         "whole text files or JSON-lines records: add files or change data.val_fraction)")
    if data_cfg.tokenizer:
        tok = Tokenizer.load(data_cfg.tokenizer)
    else:
        tok = train_tokenizer(train_docs, data_cfg.vocab_size, data_cfg.tokenizer_type, data_cfg.tokenizer_max_chars)
    tok.save(os.path.join(directory, "tokenizer.model"))
    dtype = token_dtype(tok.vocab_size)
    splits = {}
    for split, texts in (("train", train_docs), ("val", val_docs)):
        n_tok, n_doc = write_tokens(os.path.join(directory, f"{split}.bin"), tok.encode_batch(texts), tok.eos_id, dtype)
        splits[split] = {"file": f"{split}.bin", "tokens": n_tok, "documents": n_doc,
                         "characters": sum(len(t) for t in texts)}
    write_manifest(directory, {
        "format": FORMAT,
        "source": {"corpus": os.path.abspath(data_cfg.corpus), "pattern": data_cfg.pattern, "format": data_cfg.format,
                   "jsonl_field": data_cfg.jsonl_field, "sha256": spec["corpus_sha256"], "documents": len(docs),
                   "not_text": [name for name, _why in skipped]},
        "tokenizer": {"sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "file": "tokenizer.model", "trained": not data_cfg.tokenizer, **spec["tokenizer"]},
        "dtype": dtype.str,
        "val_fraction": data_cfg.val_fraction,
        "splits": splits,
        "token_count": sum(s["tokens"] for s in splits.values()),
        "key_spec": spec,
        "build_seconds": round(time.perf_counter() - t0, 2),
    })
    log(f"data: {len(docs)} documents -> {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} val tokens "
        f"(vocab {tok.vocab_size}) in {time.perf_counter() - t0:.1f}s")


def prepare_data(data_cfg, log=print) -> str:
    """The cached data directory for these settings, built if it does not exist yet."""
    key, spec = data_key(data_cfg)
    os.makedirs(data_cfg.cache_dir, exist_ok=True)
    directory = os.path.join(data_cfg.cache_dir, key)
    if os.path.exists(os.path.join(directory, "manifest.json")):
        return directory
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=data_cfg.cache_dir)
    try:
        _build(tmp, data_cfg, spec, log)
        try:
            os.rename(tmp, directory)
        except OSError:  # someone else finished first: theirs is identical
            if not os.path.exists(os.path.join(directory, "manifest.json")):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def load_prepared(directory: str) -> PreparedData:
    manifest = read_manifest(directory)
    tok = Tokenizer.load(os.path.join(directory, manifest["tokenizer"]["file"]))
    if tok.sha256 != manifest["tokenizer"]["sha256"]:
        raise InputError(f"{directory}: tokenizer.model does not match the manifest's hash; delete the directory to rebuild")
    return PreparedData(directory, manifest, tok, open_split(directory, manifest, "train"), open_split(directory, manifest, "val"))
