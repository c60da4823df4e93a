"""moe-dist prepare: streamed inputs -> tokenizer workers -> Megatron indexed shards, read back by
megatron-core; bad input counted and named; an interrupted prepare resumes to the same bytes."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moe_dist.data import PrepareSettings, Tokenizer, read_documents, run_prepare, train_tokenizer
from moe_dist.data import pipeline
from moe_dist.data.corpus import is_validation

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "data", "python-docs")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.model")
    train_tokenizer([d.text for d in read_documents(CORPUS)], 512).save(path)
    return path


def paragraphs():
    return [p for d in read_documents(CORPUS) for p in d.text.split("\n\n") if p.strip()][:600]


def write_jsonl(path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def quiet(**kw):
    return PrepareSettings(progress=False, **kw)


def reference(tokenizer, names_texts, val_fraction):
    """Each split's documents encoded one by one, each followed by EOS."""
    out = {"train": [], "val": []}
    for name, text in names_texts:
        out["val" if is_validation(name, val_fraction) else "train"].append(tokenizer.encode(text) + [tokenizer.eos_id])
    return out


def megatron_read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_round_trip_through_megatron_core(tmp_path, tok):
    pytest.importorskip("megatron.core")
    texts = paragraphs()
    a, b, c, d = texts[:150], texts[150:300], texts[300:450], texts[450:]
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_jsonl(inputs / "a.jsonl", a)
    write_jsonl(inputs / "b.jsonl.gz", b, gzip.open)
    try:  # .zst and Parquet inputs need the `data` extra; without it those records go in as plain JSON lines
        import zstandard

        with open(inputs / "c.jsonl.zst", "wb") as raw:
            raw.write(zstandard.ZstdCompressor().compress("".join(json.dumps({"text": t}) + "\n" for t in c).encode()))
        c_name = "c.jsonl.zst"
    except ImportError:
        c_name = "c.jsonl"
        write_jsonl(inputs / c_name, c)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": d, "id": list(range(len(d)))}), inputs / "d.parquet", row_group_size=40)
        d_name = "d.parquet"
    except ImportError:
        d_name = "d.jsonl"
        write_jsonl(inputs / d_name, d)
    m = run_prepare(quiet(inputs=[str(inputs)], output=str(tmp_path / "out"), tokenizer=tok, workers=2,
                          val_fraction=0.1, shard_mb=0.02, memory_mb=256, chunk_kb=8))
    names = [(f"a.jsonl:{i + 1}", t) for i, t in enumerate(a)] + [(f"b.jsonl.gz:{i + 1}", t) for i, t in enumerate(b)]
    names += [(f"{c_name}:{i + 1}", t) for i, t in enumerate(c)] + [(f"{d_name}:{i + 1}", t) for i, t in enumerate(d)]
    ref = reference(Tokenizer.load(tok), names, 0.1)
    assert len(m["shards"]) > 3 and m["bad"]["count"] == 0 and m["documents"] == len(texts)
    for split in ("train", "val"):
        got = [doc for sh in m["shards"] for doc in megatron_read(str(tmp_path / "out" / sh[split]))]
        assert got == ref[split], split
        assert m["splits"][split]["documents"] == len(ref[split])
    # one worker in this process writes the same bytes as two workers
    m1 = run_prepare(quiet(inputs=[str(inputs)], output=str(tmp_path / "one"), tokenizer=tok, workers=1,
                           val_fraction=0.1, shard_mb=0.02, memory_mb=256, chunk_kb=8))
    assert m1["shards"] == m["shards"]
    for sh in m["shards"]:
        for ext in (".bin", ".idx"):
            assert (tmp_path / "one" / (sh["train"] + ext)).read_bytes() == (tmp_path / "out" / (sh["train"] + ext)).read_bytes()


def test_hf_tokenizer_json_and_model_directory(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator(paragraphs(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    hf.save(str(model_dir / "tokenizer.json"))
    write_jsonl(tmp_path / "x.jsonl", paragraphs()[:50])
    m = run_prepare(quiet(inputs=[str(tmp_path / "x.jsonl")], output=str(tmp_path / "out"), tokenizer=str(model_dir),
                          workers=2, val_fraction=0.0))
    assert m["tokenizer"]["file"] == "tokenizer.json" and m["tokenizer"]["eos_id"] == hf.token_to_id("</s>")
    from moe_dist.data import IndexedFile

    f = IndexedFile(str(tmp_path / "out" / m["shards"][0]["train"]))
    starts, ends = f.document_spans()
    expected = [hf.encode(t, add_special_tokens=False).ids + [hf.token_to_id("</s>")] for t in paragraphs()[:50]]
    assert [f.tokens[s:e].tolist() for s, e in zip(starts, ends)] == expected


def test_bad_input_is_counted_and_named(tmp_path, tok):
    inputs = tmp_path / "in"
    inputs.mkdir()
    good = paragraphs()[:20]
    lines = [json.dumps({"text": t}) for t in good[:10]]
    lines.insert(3, '{"text": "unterminated')  # line 4: malformed JSON
    lines.insert(5, json.dumps({"body": "x"}))  # line 6: missing field
    lines.insert(7, json.dumps({"text": 5}))  # line 8: not a string
    lines.insert(8, json.dumps({"text": ""}))  # line 9: empty, counted apart
    data = ("\n".join(lines) + "\n").encode()
    data += b'{"text": "caf\xe9"}\n'  # line 15: not UTF-8
    data += json.dumps({"text": "y" * (3 << 20)}).encode() + b"\n"  # line 16: far larger than the rest
    data += json.dumps({"text": good[10]}).encode() + b"\n"
    (inputs / "a.jsonl").write_bytes(data)
    (inputs / "empty.jsonl").write_bytes(b"")
    (inputs / "blob.txt").write_bytes(bytes(range(256)) * 4)
    (inputs / "ok.txt").write_text(good[11])
    m = run_prepare(quiet(inputs=[str(inputs)], output=str(tmp_path / "out"), tokenizer=tok, workers=2,
                          max_record_mb=1, val_fraction=0.0))
    named = dict(m["bad"]["first"])
    assert m["bad"]["count"] == 7 and m["empty_records"] == 1
    assert named["a.jsonl:4"].startswith("not valid JSON")
    assert named["a.jsonl:6"] == "no field 'text'" and named["a.jsonl:8"] == "field 'text' is int, not a string"
    assert named["a.jsonl:15"] == "not UTF-8" and "over the limit of 1.0 MiB" in named["a.jsonl:16"]
    assert [w for w, _ in m["bad"]["first"]][:5] == ["a.jsonl:4", "a.jsonl:6", "a.jsonl:8", "a.jsonl:15", "a.jsonl:16"]
    assert named["empty.jsonl"] == "an empty file" and named["blob.txt"] == "it holds NUL bytes (a binary file?)"
    assert m["documents"] == 10 + 1 + 1  # every good record kept, nothing dropped silently
    line = pipeline.summary_line(m, "OUT")
    assert "7 bad record(s) left out (a.jsonl:4: not valid JSON" in line and "1 empty record(s)" in line


def test_command_line_errors_are_one_line(tmp_path, tok):
    def prepare(*args):
        return subprocess.run([sys.executable, "-m", "moe_dist.cli", "prepare", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    res = prepare(str(tmp_path / "nope*.jsonl"), "-o", str(tmp_path / "out"), "--tokenizer", tok)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"moe-dist prepare: error: input '{tmp_path}/nope*.jsonl': no such file, "
                                               "directory or matching glob"]
    write_jsonl(tmp_path / "a.jsonl", paragraphs()[:30])
    res = prepare(str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "no.model"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    res = prepare(str(tmp_path / "a.jsonl"), "-o", str(tmp_path / "out"), "--tokenizer", tok, "--no-progress")
    assert res.returncode == 0 and res.stdout.startswith("prepare: 30 documents from 1 file(s)"), res.stderr


def test_interrupted_prepare_resumes_to_the_same_bytes(tmp_path, tok, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", paragraphs()[:300])
    write_jsonl(tmp_path / "b.jsonl", paragraphs()[300:])
    settings = dict(inputs=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tokenizer=tok, workers=2,
                    val_fraction=0.1, shard_mb=0.03, memory_mb=64, chunk_kb=8)
    whole = run_prepare(quiet(output=str(tmp_path / "whole"), **settings))
    assert len(whole["shards"]) >= 4

    closed = []
    original = pipeline._close

    def close_then_die(shard, end):
        original(shard, end)
        closed.append(shard.index)
        if len(closed) == 2:
            raise KeyboardInterrupt  # killed after two shards

    monkeypatch.setattr(pipeline, "_close", close_then_die)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run_prepare(quiet(output=str(out), **settings))
    names = sorted(os.listdir(out))
    assert "manifest.json" not in names and not [n for n in names if n.endswith(".tmp")]  # nothing half-written
    assert [n for n in names if n.startswith("shard-")] == ["shard-00000.json", "shard-00001.json"]
    monkeypatch.setattr(pipeline, "_close", original)
    lines = []
    again = run_prepare(quiet(output=str(out), **settings), log=lines.append)
    assert lines[0] == f"prepare: resuming {out} after 2 finished shard(s)"
    assert again["shards"] == whole["shards"]
    for sh in whole["shards"]:
        for split in ("train", "val"):
            for ext in (".bin", ".idx"):
                assert (out / (sh[split] + ext)).read_bytes() == (tmp_path / "whole" / (sh[split] + ext)).read_bytes()
    # other settings on the same output are refused, not mixed in, whether it is complete or not
    with pytest.raises(ValueError, match="holds a prepare of other inputs or settings"):
        run_prepare(quiet(output=str(out), **{**settings, "val_fraction": 0.2}))
    os.remove(out / "manifest.json")
    with pytest.raises(ValueError, match="holds a prepare of other inputs or settings"):
        run_prepare(quiet(output=str(out), **{**settings, "val_fraction": 0.2}))


def test_slurm_array_tasks_and_the_combining_step(tmp_path, tok):
    """launch/slurm/prepare.sbatch as each task of a 3-task array runs it (Slurm's variables set by
    hand): each writes its part, the last to finish combines them into one dataset."""
    texts = paragraphs()
    for i in range(5):
        write_jsonl(tmp_path / f"in{i}.jsonl", texts[i * 100:(i + 1) * 100])
    out = tmp_path / "out"
    env = {**os.environ, "SLURM_ARRAY_TASK_COUNT": "3", "PYTHON": sys.executable, "MOE_DIST_HOME": ROOT}
    for task in (2, 0, 1):
        res = subprocess.run(["bash", os.path.join(ROOT, "launch", "slurm", "prepare.sbatch"), str(out), "--tokenizer",
                              tok, "--val-fraction", "0.1", str(tmp_path / "in*.jsonl")],
                             env={**env, "SLURM_ARRAY_TASK_ID": str(task)}, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert (out / "manifest.json").exists() == (task == 1)
    m = json.load(open(out / "manifest.json"))
    assert m["parts"] == 3 and m["documents"] == 500 and m["source"]["files"] == 5
    assert [sh["train"].split("/")[0] for sh in m["shards"]] == ["part-00000", "part-00001", "part-00002"]
    whole = run_prepare(quiet(inputs=[str(tmp_path / "in*.jsonl")], output=str(tmp_path / "whole"), tokenizer=tok,
                              val_fraction=0.1, workers=1))
    from moe_dist.data import open_blend

    spread, one = open_blend(str(out))[0][0], open_blend(str(tmp_path / "whole"))[0][0]
    np.testing.assert_array_equal(spread.train.array(), one.train.array())  # the same tokens as one prepare
    assert m["splits"] == whole["splits"]
