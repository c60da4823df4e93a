"""Data: the committed corpus slice -> sentencepiece -> cached memory-mapped tokens -> batches."""
import json
import os
import shutil
import time

import numpy as np
import pytest

from moe_dist.config import load_config
from moe_dist.data import (IndexedFile, Tokenizer, TrainSampler, corpus_files, data_key, eval_batches, is_validation,
                           load_prepared, prepare_data, rank_slice, read_documents, unigram_log_probs,
                           unigram_perplexity)

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "data", "python-docs")


def data_cfg(cache, *overrides):
    return load_config(None, [f"data.corpus={CORPUS}", f"data.cache_dir={cache}", "data.vocab_size=512",
                              "data.val_fraction=0.2", *overrides]).data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    cfg = data_cfg(cache)
    t0 = time.perf_counter()
    directory = prepare_data(cfg, log=lambda _: None)
    return cfg, directory, time.perf_counter() - t0


def test_corpus_documents_and_split():
    files = corpus_files(CORPUS)
    assert len(files) == 26 and all(f.name.endswith(".rst.txt") for f in files)
    docs = list(read_documents(CORPUS))
    assert docs[0].name == "faq/design.rst.txt" and "Python" in docs[0].text
    val = sorted(d.name for d in docs if is_validation(d.name, 0.2))
    assert val == ["faq/gui.rst.txt", "tutorial/appendix.rst.txt", "tutorial/controlflow.rst.txt"]
    # the split is a property of the name alone, and grows monotonically with the fraction
    assert all(is_validation(d.name, 0.3) for d in docs if is_validation(d.name, 0.2))
    names = [f"doc{i}" for i in range(4000)]
    assert 0.07 < np.mean([is_validation(n, 0.1) for n in names]) < 0.13


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.corpus='/nope' does not exist"):
        corpus_files("/nope")
    with pytest.raises(FileNotFoundError, match=r"python3.11-doc"):
        corpus_files("/usr/share/doc/python3.11/nonexistent-dir-for-test")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match=r"holds no files matching .* \(data.pattern\)"):
        corpus_files(str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_documents(str(bad)))
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"no string field 'text' \(data.jsonl_field\)"):
        list(read_documents(str(bad)))


def test_tokenizer_round_trip(prepared):
    cfg, directory, _ = prepared
    data = load_prepared(directory)
    tok = data.tokenizer
    assert tok.vocab_size == 512 and tok.eos_id == 1
    text = next(read_documents(CORPUS)).text[:3000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # identity normalisation, newlines kept
    assert len(ids) < len(text) / 1.5  # it compresses (vocab 512)
    assert tok.decode(tok.encode("naïve ∑ 😀")) == "naïve ∑ 😀"  # byte fallback


def test_manifest_and_token_files(prepared):
    cfg, directory, _ = prepared
    data = load_prepared(directory)
    m = data.manifest
    assert m["source"]["inputs"] == [os.path.abspath(CORPUS)] and m["documents"] == 26
    assert m["tokenizer"]["sha256"] == data.tokenizer.sha256 and m["tokenizer"]["trained"] is True
    assert m["splits"]["val"]["documents"] == 3 and m["splits"]["train"]["documents"] == 23
    assert m["token_count"] == data.train.count + data.val.count
    assert m["bad"] == {"count": 0, "first": []}
    for split in ("train", "val"):  # one shard: Megatron's indexed format, one sequence per document
        f = IndexedFile(os.path.join(directory, m["shards"][0][split]))
        assert f.dtype == np.uint16 and f.num_documents == m["splits"][split]["documents"]
        assert os.path.getsize(f.prefix + ".bin") == m["splits"][split]["tokens"] * 2
        arr = data.train.array() if split == "train" else data.val.array()
        assert isinstance(arr, np.memmap) and arr.max() < 512
    # the validation stream is exactly the held-out documents, each followed by EOS
    val_docs = [d.text for d in read_documents(CORPUS) if is_validation(d.name, 0.2)]
    expected = np.concatenate([np.array(data.tokenizer.encode(t) + [1]) for t in val_docs])
    assert np.array_equal(data.val.array(), expected)


def test_cache_reused_and_keyed(prepared, tmp_path):
    cfg, directory, first_seconds = prepared
    manifest_mtime = os.path.getmtime(os.path.join(directory, "manifest.json"))
    assert prepare_data(cfg, log=lambda _: None) == directory
    assert os.path.getmtime(os.path.join(directory, "manifest.json")) == manifest_mtime  # not rebuilt
    other, _ = data_key(data_cfg(cfg.cache_dir, "data.vocab_size=600"))
    assert other != os.path.basename(directory)
    assert data_key(data_cfg(cfg.cache_dir, "data.val_fraction=0.3"))[0] != os.path.basename(directory)
    # a given tokenizer.model: keyed by its hash, not retrained
    given = data_cfg(str(tmp_path / "c2"), f"data.tokenizer={os.path.join(directory, 'tokenizer.model')}")
    d2 = prepare_data(given, log=lambda _: None)
    m2 = load_prepared(d2).manifest
    assert m2["tokenizer"]["trained"] is False and m2["tokenizer"]["sha256"] == load_prepared(directory).tokenizer.sha256
    assert m2["splits"] == load_prepared(directory).manifest["splits"]
    # a changed corpus is a different cache entry
    corpus2 = tmp_path / "corpus2"
    shutil.copytree(CORPUS, corpus2)
    (corpus2 / "faq" / "index.rst.txt").write_text("changed\n")
    assert data_key(data_cfg(cfg.cache_dir, f"data.corpus={corpus2}"))[0] != os.path.basename(directory)


def test_jsonl_corpus_and_split_errors(tmp_path):
    docs = list(read_documents(CORPUS))
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for d in docs:
            for para in d.text.split("\n\n")[:20]:
                f.write(json.dumps({"content": para}) + "\n")
    cfg = data_cfg(str(tmp_path / "cache"), f"data.corpus={path}", "data.jsonl_field=content", "data.val_fraction=0.1")
    data = load_prepared(prepare_data(cfg, log=lambda _: None))
    n_docs = data.manifest["splits"]["train"]["documents"] + data.manifest["splits"]["val"]["documents"]
    assert n_docs == sum(1 for line in open(path) if json.loads(line)["content"])
    assert 0.05 < data.manifest["splits"]["val"]["documents"] / n_docs < 0.15
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("just one document\n" * 50)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.05 put 0 of 1 documents in the validation split"):
        prepare_data(data_cfg(str(tmp_path / "cache"), f"data.corpus={one}", "data.val_fraction=0.05"), log=lambda _: None)
    with pytest.raises(FileNotFoundError, match="data.tokenizer='/missing.model' does not exist"):
        Tokenizer.load("/missing.model")


def test_sampler_is_layout_independent(prepared):
    _, directory, _ = prepared
    tokens = load_prepared(directory).train.array()
    S, G, A = 32, 12, 3

    def global_step(ranks, sampler_steps=3):
        samplers = [TrainSampler(tokens, S, G, A, r, ranks, seed=5) for r in range(ranks)]
        steps = []
        for _ in range(sampler_steps):
            per_rank = [s.next_step() for s in samplers]
            steps.append([np.concatenate([per_rank[r][m] for r in range(ranks)]) for m in range(A)])
        return steps

    one = global_step(1)
    for ranks in (2, 3, 4):  # 4 ranks: micro-batches of 4 sequences, one each; 3 ranks: uneven is fine too
        other = global_step(ranks)
        for a, b in zip(one, other):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
    batch = one[0][0]
    assert batch.shape == (G // A, S + 1) and batch.dtype == np.int64
    # each row is a contiguous window of the stream starting at a multiple of seq_len
    for row in batch:
        starts = np.flatnonzero(tokens[: len(tokens) - S][::S] == row[0]) * S
        assert any(np.array_equal(tokens[s : s + S + 1], row) for s in starts)
    assert not np.array_equal(one[0][0], one[1][0])
    assert not np.array_equal(global_step(1)[0][0], TrainSampler(tokens, S, G, A, 0, 1, seed=6).next_step()[0])


def test_sampler_epochs_and_restore(prepared):
    _, directory, _ = prepared
    tokens = load_prepared(directory).val.array()
    S = 64
    s = TrainSampler(tokens, S, 4, 1, 0, 1, seed=1)
    n = s.n_windows
    seen = np.concatenate([s.next_step()[0] for _ in range(-(-n // 4))])[:n]
    firsts = sorted(tuple(r) for r in seen)
    assert len(set(firsts)) == n  # one epoch visits every window once
    # save / restore: a new sampler continues exactly where the old one was
    a = TrainSampler(tokens, S, 4, 2, 1, 2, seed=3)
    for _ in range(5):
        a.next_step()
    state = a.state_dict()
    b = TrainSampler(tokens, S, 4, 2, 1, 2, seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))
    for _ in range(3):
        for x, y in zip(a.next_step(), b.next_step()):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="saved with seed=3, this run has 4"):
        TrainSampler(tokens, S, 4, 2, 1, 2, seed=4).load_state_dict(state)


def test_eval_batches_and_unigram(prepared):
    _, directory, _ = prepared
    data = load_prepared(directory)
    tokens = data.val.array()
    full = eval_batches(tokens, 64, 40, 8, 0, 1)
    assert [b.shape for b in full] == [(8, 65)] * 5
    for ranks in (2, 3):
        parts = [eval_batches(tokens, 64, 40, 8, r, ranks) for r in range(ranks)]
        assert len({len(p) for p in parts}) == 1
        for i, b in enumerate(full):
            np.testing.assert_array_equal(np.concatenate([p[i] for p in parts]), b)
    assert sum(b.shape[0] for b in eval_batches(tokens, 64, 10**6, 8, 0, 1)) % 8 == 0
    with pytest.raises(ValueError, match="lower train.seq_len or raise data.val_fraction"):
        eval_batches(tokens[:100], 64, 40, 8, 0, 2)
    lp = unigram_log_probs(data.train.array(), data.vocab_size)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    targets = np.concatenate([b[:, 1:] for b in full])
    counts = np.bincount(data.train.array(), minlength=512) + 1.0
    manual = np.exp(-np.mean(np.log(counts[targets.reshape(-1)] / counts.sum())))
    assert unigram_perplexity(lp, targets) == pytest.approx(manual)
    assert 50 < manual < 512


def test_rank_slice_covers_everything():
    for n in (1, 5, 12):
        for ranks in (1, 2, 3, 4):
            idx = np.concatenate([np.arange(n)[rank_slice(n, r, ranks)] for r in range(ranks)])
            np.testing.assert_array_equal(idx, np.arange(n))
