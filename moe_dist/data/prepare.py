"""The run's data: a corpus prepared into a cache directory once, or prepared datasets blended.

    directory = prepare_data(cfg.data)          # data.corpus: builds the cache if missing (atomic)
    data = load_prepared(directory)              # tokenizer, train / val token streams, manifest
    data = load_datasets(cfg.data)               # data.paths: prepared directories / Megatron prefixes

The cache directory name is a hash of everything the tokens depend on: the corpus content
(paths and bytes), pattern, format, JSON field, validation fraction and the tokenizer (its
training settings, or the hash of a given tokenizer.model). Building calls the same engine as
``moe-dist prepare`` (:mod:`moe_dist.data.pipeline`) in a private temporary directory that is
renamed into place, so concurrent builders (one per node) cannot leave a half-written cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

from .corpus import corpus_fingerprint, is_validation, read_documents
from .datasets import Source, open_blend, open_source
from .pipeline import FORMAT, MANIFEST, PrepareSettings, read_record, run_prepare, write_record
from .stream import TokenStream
from .tokenizer import Tokenizer, train_tokenizer
from ..errors import InputError

IN_PROCESS_BELOW = 64 << 20  # a corpus smaller than this is tokenized in the calling process (no pool start-up)


@dataclass
class PreparedData:
    directory: str
    manifest: dict
    tokenizer: Tokenizer
    sources: list  # [Source]: what training blends
    val_sources: list  # [(weight, TokenStream)]: what validation reads

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def train(self) -> TokenStream:
        """The training stream of a single-source run."""
        if len(self.sources) != 1:
            raise ValueError("a blend has one training stream per source (PreparedData.sources)")
        return self.sources[0].train

    @property
    def val(self) -> TokenStream:
        return TokenStream([p for _, s in self.val_sources for p in s.parts])

    @property
    def train_tokens(self) -> int:
        return sum(s.train.count for s in self.sources)


def _tokenizer_spec(data_cfg) -> dict:
    if data_cfg.tokenizer:
        return {"model_sha256": Tokenizer.resolve(data_cfg.tokenizer).sha256}
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


def _split_error(data_cfg, train: int, val: int) -> InputError:
    return InputError(f"data.val_fraction={data_cfg.val_fraction} put {val} of {train + val} documents in the "
                      f"validation split and {train} in training; both need at least one (documents are "
                      "whole text files or JSON-lines records: add files or change data.val_fraction)")


def _training_texts(data_cfg):
    """The training documents' texts, streamed (records the prepare will name as bad are passed over
    here); the first pass refuses a split with an empty side before a tokenizer is trained on it."""
    passes = []

    def texts():
        counts = [0, 0]
        first = not passes
        passes.append(1)
        for d in read_documents(data_cfg.corpus, data_cfg.pattern, data_cfg.format, data_cfg.jsonl_field, skipped=[],
                                bad=[]):
            held = is_validation(d.name, data_cfg.val_fraction)
            counts[held] += 1
            if not held:
                yield d.text
        if first and not all(counts):
            raise _split_error(data_cfg, *counts)
    return texts


def _build(directory: str, data_cfg, spec: dict, log) -> None:
    if data_cfg.tokenizer:
        tok = Tokenizer.resolve(data_cfg.tokenizer)
    else:
        tok = train_tokenizer(_training_texts(data_cfg), data_cfg.vocab_size, data_cfg.tokenizer_type,
                              data_cfg.tokenizer_max_chars)
    size = sum(os.path.getsize(p) for p in _files(data_cfg))
    workers = data_cfg.prepare_workers or (1 if size < IN_PROCESS_BELOW else 0)
    settings = PrepareSettings(inputs=[data_cfg.corpus], output=directory, format=data_cfg.format,
                               pattern=data_cfg.pattern, field=data_cfg.jsonl_field, val_fraction=data_cfg.val_fraction,
                               workers=workers, memory_mb=data_cfg.prepare_memory_mb, progress=False)
    m = run_prepare(settings, tok, log=lambda line: log(line.replace("prepare: ", "data: ", 1)))
    train, val = m["splits"]["train"]["documents"], m["splits"]["val"]["documents"]
    if not train or not val:
        raise _split_error(data_cfg, train, val)
    bad = m["bad"]
    if bad["count"]:
        shown = "; ".join(f"{where}: {why}" for where, why in bad["first"][:5])
        log(f"warning: data: left out {bad['count']} bad file(s) or record(s) of data.corpus ({shown}"
            f"{'; ...' if bad['count'] > 5 else ''})")
    m["key_spec"] = spec
    m["tokenizer"]["trained"] = not data_cfg.tokenizer
    write_record(os.path.join(directory, MANIFEST), m)


def _files(data_cfg):
    from .corpus import corpus_files

    return corpus_files(data_cfg.corpus, data_cfg.pattern)


def prepare_data(data_cfg, log=print) -> str:
    """The cached data directory for these settings, built if it does not exist yet."""
    key, spec = data_key(data_cfg)
    os.makedirs(data_cfg.cache_dir, exist_ok=True)
    directory = os.path.join(data_cfg.cache_dir, key)
    if os.path.exists(os.path.join(directory, MANIFEST)):
        return directory
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=data_cfg.cache_dir)
    try:
        _build(tmp, data_cfg, spec, log)
        try:
            os.rename(tmp, directory)
        except OSError:  # someone else finished first: theirs is identical
            if not os.path.exists(os.path.join(directory, MANIFEST)):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _check_tokenizer(tok: Tokenizer, source: Source) -> None:
    if source.tokenizer_sha256 and source.tokenizer_sha256 != tok.sha256:
        raise InputError(f"data.paths: {source.path} was prepared with another tokenizer (sha256 "
                         f"{source.tokenizer_sha256[:12]}, this run's is {tok.sha256[:12]}); a blend needs one tokenizer")


def load_prepared(directory: str) -> PreparedData:
    source = open_source(directory)
    tok = Tokenizer.load(source.tokenizer_file)
    manifest = read_record(os.path.join(directory, MANIFEST))
    if tok.sha256 != source.tokenizer_sha256:
        raise InputError(f"{directory}: {os.path.basename(source.tokenizer_file)} does not match the manifest's hash; "
                         "delete the directory to rebuild")
    return PreparedData(directory, manifest, tok, [source], [(1.0, source.val)])


def load_datasets(data_cfg) -> PreparedData:
    """``data.paths`` (and ``data.valid_paths``) opened, with their one tokenizer."""
    sources, val = open_blend(data_cfg.paths, data_cfg.valid_paths, data_cfg.val_fraction)
    if data_cfg.tokenizer:
        tok = Tokenizer.resolve(data_cfg.tokenizer)
    else:
        first = next((s for s in sources if s.tokenizer_file), None)
        if first is None:
            raise InputError("data.paths names only Megatron prefixes, which carry no tokenizer: set data.tokenizer to "
                             "the tokenizer they were made with (a tokenizer.model, tokenizer.json or model directory)")
        tok = Tokenizer.load(first.tokenizer_file)
    for s in sources:
        _check_tokenizer(tok, s)
    manifest = {"format": FORMAT, "source": {"paths": [[s.weight, s.path] for s in sources],
                                             "valid_paths": data_cfg.valid_paths},
                "tokenizer": {"sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
                "token_count": sum(s.train.count for s in sources) + sum(v.count for _, v in val)}
    return PreparedData(sources[0].path, manifest, tok, sources, val)
