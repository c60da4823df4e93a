"""Bad data is noticed (issue 18): files that are not text are left out and named, a corpus
smaller than a few steps is flagged, a broken JSON line is reported with its line and column."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from moe_dist.data.corpus import not_text, read_documents
from moe_dist.train.setup.data import small_corpus_note

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "data", "python-docs")


def test_not_text():
    assert not_text("plain text, naïve ∑ 😀\n".encode()) is None
    assert not_text(b"abc\0def") == "it holds NUL bytes (a binary file?)"
    assert not_text(bytes(range(128, 256)) * 4) == "100% of it is not valid UTF-8"
    assert not_text(b"a" * 1000 + b"\xff") is None  # a stray bad byte in real text: kept
    assert not_text("\ufffd".encode() * 50) is None  # replacement characters that are really in the file


def test_binary_files_are_left_out_and_named(tmp_path):
    shutil.copy(os.path.join(CORPUS, "faq", "index.rst.txt"), tmp_path / "good.txt")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 8)
    skipped = []
    docs = list(read_documents(str(tmp_path), skipped=skipped))
    assert [d.name for d in docs] == ["good.txt"]
    assert skipped == [("image.txt", "it holds NUL bytes (a binary file?)")]


@pytest.mark.parametrize("line, why", [
    ('{"text": "tab\there"}', "Invalid control character at line 2, column 14 (character 14 of the line)"),
    ('{"text": "open', "Unterminated string starting at line 2, column 10 (character 10 of the line)"),
    ('{"text": }', "Expecting value at line 2, column 10 (character 10 of the line)"),
])
def test_json_lines_error_has_line_and_column(tmp_path, line, why):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n' + line)  # the last line without its newline (a control character)
    with pytest.raises(ValueError) as info:
        list(read_documents(str(bad)))
    assert str(info.value) == (f"{bad}:2: not valid JSON: {why}; data.format='jsonl' expects one JSON object per line")


def test_small_corpus_note():
    assert small_corpus_note(100_000, 8, 64, 10) == ""
    note = small_corpus_note(900, 8, 64, 10)
    assert note.startswith("warning: data: the training split has 900 tokens, 1.8 step(s) of train.global_batch x "
                           "train.seq_len = 512 tokens: every step sees the same text again (5.7 epochs over "
                           "train.steps=10)")


@pytest.mark.slow
def test_two_rank_run_warns_about_binary_files_and_a_small_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, name in enumerate(sorted(os.listdir(os.path.join(CORPUS, "tutorial")))[:6]):
        text = open(os.path.join(CORPUS, "tutorial", name), encoding="utf-8").read()[:400]
        (corpus / f"doc{i}.txt").write_text(text)
    (corpus / "blob.txt").write_bytes(bytes(range(256)) * 16)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", "--nproc", "2",
                          f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", f"data.corpus={corpus}",
                          "data.val_fraction=0.5", "train.steps=2", "run.progress=false", "run.plots=false",
                          "run.tensorboard=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("warning: data: left out 1 bad file(s) or record(s) of data.corpus (blob.txt: it holds NUL bytes "
            "(a binary file?))") in res.stdout
    assert res.stdout.count("warning: data: the training split has ") == 1  # rank 0 only
    manifest = json.load(open(next((tmp_path / "cache").glob("*/manifest.json"))))
    assert manifest["bad"] == {"count": 1, "first": [["blob.txt", "it holds NUL bytes (a binary file?)"]]}
