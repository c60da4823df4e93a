"""A run directory, a checkpoint or an input that a crash cut short or someone else prepared: strict,
bounded, non-blocking reads (links, FIFOs, devices, cut files, huge values, deep nesting), writes that
replace a planted link instead of following it, names that stay inside their directory, and tensors
named twice across shards. Each case: one line naming the file and what is wrong, nothing written or
deleted outside the run directory, nothing hung, resume=auto going on from the newest whole checkpoint."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from moe_dist.errors import CheckpointError, ConfigError, DamagedCheckpoint, HFFormatError, InputError, UserError
from moe_dist.safe_io import (UnreadableFile, UnsafePath, confined, open_append, open_lock_file, own_directory,
                              parse_json, read_json, read_json_lines, write_atomically)
from moe_dist.train.checkpoint import Checkpointer, IncompleteCheckpoint, load_checkpoint, step_dir
from moe_dist.train.checkpoint.files import prune, read_manifest, scan, sha256_file
from moe_dist.train.checkpoint.resume import resolve_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "test.yaml")


@pytest.fixture(autouse=True)
def no_hang():
    """Every case here ends within 60 s or fails (a blocking read would otherwise hang the suite)."""
    def hung(*_):
        raise TimeoutError("hung: a read blocked")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def overrides(tmp, *extra):
    return [f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
            "parallel.ep=1", "run.tensorboard=false", "run.plots=false", "run.progress=false", *extra]


def config(tmp, *extra):
    from moe_dist.config import load_config

    return load_config(CONFIG, overrides(tmp, *extra))


def cli(*args, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moe_dist.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def one_line(proc, command):
    """The command's single error line (exit 2, no traceback)."""
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"moe-dist {command}: error:"), proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """configs/test.yaml trained in process on one rank for 4 steps, checkpoints at steps 2 and 4."""
    from moe_dist.train.loop.trainer import train

    tmp = tmp_path_factory.mktemp("trained")
    train(config(tmp, "train.steps=4", "ckpt.every=2", "ckpt.keep=0", "eval.every=0"))
    return tmp


def copy_run(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run"


def reseal(ckpt):
    from helpers.checkpoint_payloads import reseal as do

    do(str(ckpt))


# ---- strict JSON ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("[" * 100_000, "nested deeper than 64 levels"),
    ("[" * 70 + "]" * 70, "nested deeper than 64 levels"),
    ("1" * 5000, "an integer of 5000 digits"),
    ('{"step": 1, "step": 2}', 'key "step" appears twice'),
    ("[NaN]", "NaN is not a JSON number"),
    ('{"x": Infinity}', "Infinity is not a JSON number"),
    ("[1e400]", "beyond a double's range"),
    ('{"pending": ', "not valid JSON"),
])
def test_strict_json_refuses_with_one_line(text, words):
    with pytest.raises(UnreadableFile) as info:
        parse_json(text, "some.json")
    assert str(info.value).startswith("some.json: ") and words in str(info.value) and "\n" not in str(info.value)


def test_reads_take_regular_files_only_and_never_block(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "big.json").write_text("[" + "1," * 600 + "1]")
    start = time.monotonic()
    for path, words in ((fifo, "is a FIFO (named pipe), not a regular file"),
                        ("/dev/zero", "is a character device, not a regular file"),
                        (tmp_path, "is a directory, not a regular file"),
                        (tmp_path / "missing.json", "does not exist"),
                        (tmp_path / "big.json", "more than the 1 KiB such a file may hold")):
        with pytest.raises(UnreadableFile, match=re.escape(words)):
            read_json(str(path), limit=1024)
    assert time.monotonic() - start < 5
    (tmp_path / "bad.txt").write_bytes(b"line one\nline \xff two\n")
    with pytest.raises(UnreadableFile, match=r"not UTF-8 text: byte 0xff at offset 14 \(line 2\)"):
        read_json(str(tmp_path / "bad.txt"))


def test_json_lines_keep_whole_rows_and_name_the_cut_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n\n{"step": 3, "lo')
    rows, bad = read_json_lines(str(path), 1 << 20)
    assert rows == [{"step": 1}, {"step": 2}] and [(n, line) for n, line, _why in bad] == [(4, '{"step": 3, "lo')]


# ---- writes never follow a link ------------------------------------------------------------------------------
def test_writes_replace_a_planted_link_and_refuse_linked_directories(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "eval.json")
    write_atomically(str(run / "eval.json"), "{}\n")
    assert outside.read_text() == "precious" and not os.path.islink(run / "eval.json")
    assert (run / "eval.json").read_text() == "{}\n" and [p.name for p in run.iterdir()] == ["eval.json"]
    for name, opener in (("metrics.jsonl", lambda p: open_append(p)),
                         ("run.lock", lambda p: open_lock_file(p, os.O_RDWR | os.O_CREAT))):
        os.symlink(outside, run / name)
        with pytest.raises(UnsafePath, match=f"{name} is a symbolic link to"):
            opener(str(run / name))
    os.mkfifo(run / "read.lock")
    with pytest.raises(UnsafePath, match="is a FIFO"):
        open_lock_file(str(run / "read.lock"), os.O_RDWR | os.O_CREAT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, run / "plots")
    with pytest.raises(UnsafePath, match="plots is a symbolic link to .* must not be a link"):
        own_directory(str(run), "plots")
    assert outside.read_text() == "precious" and not os.listdir(elsewhere)


def test_pruning_never_deletes_through_a_linked_checkpoints_directory(tmp_path):
    cfg = config(tmp_path)
    from moe_dist.model import build_model

    model = build_model(cfg.model, 512)
    other = tmp_path / "other"
    for step in (1, 2):
        Checkpointer(str(other)).save(step, model, meta={})
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(other / "checkpoints", run / "checkpoints")
    with pytest.raises(CheckpointError, match="checkpoints is a symbolic link to .*must not be a link"):
        prune(str(run), keep=1)
    with pytest.raises(CheckpointError, match="must not be a link"):
        Checkpointer(str(run)).save(3, model, meta={})
    assert sorted(os.listdir(other / "checkpoints")) == ["step_000001", "step_000002"]
    # a link named like a checkpoint inside the run's own directory is never one, never pruned through
    os.unlink(run / "checkpoints")
    (run / "checkpoints").mkdir()
    os.symlink(other / "checkpoints" / "step_000001", run / "checkpoints" / "step_000001")
    Checkpointer(str(run)).save(3, model, meta={})
    Checkpointer(str(run)).save(4, model, meta={})
    logged = []
    removed = prune(str(run), keep=1, log=logged.append)
    assert removed == [step_dir(str(run), 3)] and logged == [f"checkpoint: removed {step_dir(str(run), 3)} (ckpt.keep=1)"]
    assert os.path.isdir(other / "checkpoints" / "step_000001" / "COMPLETE") is False
    assert os.path.isfile(other / "checkpoints" / "step_000001" / "COMPLETE")
    assert "not a checkpoint directory of this run" in dict((p, w) for _s, p, w in scan(str(run))[1])[
        step_dir(str(run), 1)]


# ---- a crafted COMPLETE or meta.json -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "nested", "huge-int", "escape", "escape-dot"])
def test_a_crafted_manifest_is_an_incomplete_checkpoint_and_resume_auto_takes_the_one_before(trained, tmp_path,
                                                                                          kind):
    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    marker = os.path.join(ckpt, "COMPLETE")
    manifest = json.load(open(marker))
    os.remove(marker)
    if kind == "fifo":
        os.mkfifo(marker)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", marker)
    elif kind == "nested":
        open(marker, "w").write("[" * 100_000)
    elif kind == "huge-int":
        open(marker, "w").write(json.dumps({**manifest, "step": 0}).replace('"step": 0', '"step": ' + "9" * 5000))
    else:
        name = "../../../../etc/passwd" if kind == "escape" else ".."
        passwd = "/etc/passwd" if kind == "escape" else ckpt
        record = ({"bytes": os.path.getsize(passwd), "sha256": sha256_file(passwd)} if kind == "escape"
                  else {"bytes": 0, "sha256": "0" * 64})
        json.dump({**manifest, "files": {**manifest["files"], name: record}}, open(marker, "w"))
    start = time.monotonic()
    with pytest.raises(IncompleteCheckpoint) as info:
        read_manifest(ckpt)
    assert str(info.value).startswith(f"{ckpt} is not a complete checkpoint") and "\n" not in str(info.value)
    paths, notes, error = resolve_resume("auto", str(run))
    assert error is None and paths == [step_dir(str(run), 2)], (paths, notes)
    assert any(ckpt in note and "skipped" in note for note in notes), notes
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("field, value, words", [
    ("counters.recent_grad_norms", "[" + ",".join(["1" + "0" * 400] * 8) + "]", "an integer of 401 digits"),
    ("sampler.consumed", "1" + "0" * 30, "an integer of 31 digits"),
    ("counters.recent_losses", "[1.0, NaN]", "NaN is not a JSON number"),
    ("counters.recent_losses", "[1.0, Infinity]", "Infinity is not a JSON number"),
    ("step", None, 'key "step" appears twice'),
    ("config", "[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
])
def test_meta_json_values_beyond_their_range_are_refused_by_name(trained, tmp_path, field, value, words):
    """Written as text (what json.dump of Python's 10**400 or float('nan') gives): the reader refuses the
    file as damaged, in one line naming it; resume=auto then takes the checkpoint before."""
    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    path = os.path.join(ckpt, "meta.json")
    text = open(path).read()
    meta = json.loads(text)
    if value is None:
        text = text.replace("{", '{"step": 4, ', 1)
    else:
        head, _, key = field.rpartition(".")
        holder = meta
        for part in head.split(".") if head else []:
            holder = holder[part]
        holder[key] = "@@"
        text = json.dumps(meta).replace('"@@"', value)
    open(path, "w").write(text)
    reseal(ckpt)
    from moe_dist.model import build_model

    with pytest.raises(DamagedCheckpoint) as info:
        load_checkpoint(build_model(config(tmp_path).model, 512), ckpt)
    assert f"{path}: not readable" in str(info.value) and words in str(info.value), str(info.value)


def test_meta_json_counts_of_the_right_type_out_of_range_are_refused(trained, tmp_path):
    from helpers.checkpoint_payloads import reseal as do_reseal
    from moe_dist.model import build_model

    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(path))
    meta["sampler"]["consumed"] = 10 ** 29
    json.dump(meta, open(path, "w"))
    do_reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"meta.json: field sampler.consumed: got 1000.* allowed: an integer >= 0 "
                                              r"and <= 9007199254740992; nothing was loaded"):
        load_checkpoint(build_model(config(tmp_path).model, 512), ckpt)


def test_dcp_metadata_of_allowed_classes_but_another_form_is_refused(trained, tmp_path):
    import pickle

    from moe_dist.safe_dcp import SafeFileSystemReader

    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    md = SafeFileSystemReader(ckpt).read_metadata()
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key].properties = None
    md.storage_meta = None
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(DamagedCheckpoint, match=f"declares entry '{key}' with properties NoneType"):
        SafeFileSystemReader(ckpt).read_metadata()


# ---- a crash cut a file of the run directory ------------------------------------------------------------------
def test_resume_auto_sets_aside_a_cut_metrics_row_and_divergence_record_and_goes_on(trained, tmp_path, capsys):
    from moe_dist.train.loop.trainer import train

    run = copy_run(trained, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.1')  # a crash mid-row
    (run / "divergence.json").write_text('{"pending": ')
    capsys.readouterr()
    train(config(tmp_path, "train.steps=6", "ckpt.every=2", "resume=auto", "eval.every=0"))
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert open(run / "metrics.jsonl.damaged").read() == '{"step": 5, "loss": 4.1\n'
    assert (run / "divergence.json.damaged").read_text() == '{"pending": '
    said = [line for line in out.splitlines() if "metrics.jsonl" in line or "divergence.json" in line]
    assert len(said) == 2, out
    assert "1 line(s) not a whole metrics row (line(s) 5: not valid JSON" in said[0] + said[1], said
    assert "divergence.json: not valid JSON" in said[0] + said[1], said


# ---- the commands, on planted links and FIFOs ---------------------------------------------------------------------
@pytest.mark.slow
def test_train_refuses_a_linked_plots_directory_and_eval_replaces_a_linked_eval_json(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "eval.json").write_text("precious")
    shutil.rmtree(run / "plots", ignore_errors=True)
    os.symlink(outside, run / "plots")
    proc = cli("train", "--config", CONFIG, *overrides(tmp_path, "train.steps=5", "resume=auto"))
    assert "plots is a symbolic link to" in one_line(proc, "train")
    os.unlink(run / "plots")
    os.symlink(outside / "eval.json", run / "eval.json")
    proc = cli("eval", "--run-dir", str(run), "eval.max_sequences=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (outside / "eval.json").read_text() == "precious" and not os.path.islink(run / "eval.json")
    assert json.load(open(run / "eval.json"))["val_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["train resume=auto", "eval --run-dir", "eval --checkpoint", "convert", "export"])
def test_every_reader_skips_or_refuses_a_fifo_manifest_without_hanging(trained, tmp_path, reader):
    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    os.remove(os.path.join(ckpt, "COMPLETE"))
    os.mkfifo(os.path.join(ckpt, "COMPLETE"))
    out = str(tmp_path / "out")
    args = {"train resume=auto": ["train", "--config", CONFIG, *overrides(tmp_path, "train.steps=5", "resume=auto",
                                                                          "eval.every=0")],
            "eval --run-dir": ["eval", "--run-dir", str(run), "eval.max_sequences=4"],
            "eval --checkpoint": ["eval", "--run-dir", str(run), "--checkpoint", ckpt, "eval.max_sequences=4"],
            "convert": ["convert", "--checkpoint", ckpt, "--out", out],
            "export": ["export", "--checkpoint", ckpt, "--out", out]}[reader]
    proc = cli(*args, timeout=120)
    if reader in ("train resume=auto", "eval --run-dir"):  # the newest whole checkpoint, step 2, is taken
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "step_000002" in proc.stdout + proc.stderr
    else:
        assert "is a FIFO (named pipe)" in one_line(proc, args[0])
        assert not os.path.exists(out)


@pytest.mark.slow
def test_convert_refuses_a_meta_config_beyond_bounds_or_unlike_the_tensors_before_allocating(trained, tmp_path):
    from helpers.checkpoint_payloads import reseal as do_reseal

    run = copy_run(trained, tmp_path)
    ckpt = step_dir(str(run), 4)
    path = os.path.join(ckpt, "meta.json")
    original = json.load(open(path))
    for d_model, words in ((10 ** 20, "model.d_model: 100000000000000000000"), (512, "does not match the model")):
        meta = json.loads(json.dumps(original))
        meta["config"]["model"]["d_model"] = d_model
        json.dump(meta, open(path, "w"))
        do_reseal(ckpt)
        proc = cli("convert", "--checkpoint", ckpt, "--out", str(tmp_path / "out"))
        assert words in one_line(proc, "convert")
        assert not os.path.exists(tmp_path / "out")


# ---- paths a checkpoint or an index names -------------------------------------------------------------------------
def test_listed_names_stay_inside_their_directory(tmp_path):
    assert confined(str(tmp_path), "model-00001-of-00002.safetensors", "x") == str(tmp_path / "model-00001-of-00002.safetensors")
    for name in ("../x/model.safetensors", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(UnsafePath, match="a path outside"):
            confined(str(tmp_path), name, "the index")


def _hf_dir(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(d / "part-1.safetensors"))
    save_file({"b": torch.full((2,), 7.0)}, str(d / "part-2.safetensors"))
    return d


def test_an_index_naming_a_shard_outside_or_a_tensor_in_two_shards_is_refused(tmp_path):
    from moe_dist.weights.safetensors_io import INDEX, SafetensorsCheckpoint

    d = _hf_dir(tmp_path)
    with pytest.raises(HFFormatError, match=r"tensor 'b' is in both part-1.safetensors and part-2.safetensors"):
        SafetensorsCheckpoint(str(d), require_complete=False)
    (tmp_path / "x").mkdir()
    shutil.copy(d / "part-1.safetensors", tmp_path / "x" / "model.safetensors")
    for shard in ("../x/model.safetensors", str(tmp_path / "x" / "model.safetensors")):
        (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"a": shard}}))
        with pytest.raises(HFFormatError, match="a path outside"):
            SafetensorsCheckpoint(str(d), require_complete=False)
    os.remove(d / INDEX)
    os.mkfifo(d / INDEX)
    with pytest.raises(HFFormatError, match="is a FIFO"):
        SafetensorsCheckpoint(str(d), require_complete=False)


# ---- inputs read whole or opened blocking -------------------------------------------------------------------------
def test_inputs_that_are_not_regular_files_or_not_utf8_get_one_line(tmp_path):
    from moe_dist.config import load_config
    from moe_dist.data.corpus import read_documents
    from moe_dist.data.tokenizer import Tokenizer

    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for path, words in (("/dev/zero", "is a character device"), (fifo, "is a FIFO")):
        with pytest.raises(InputError, match=f"data.tokenizer={path!r}: {words}"):
            Tokenizer.load(path)
    with pytest.raises(ConfigError, match="--config: file .*fifo' is a FIFO"):
        load_config(fifo)
    with pytest.raises(InputError, match=r"data.corpus='/dev/zero' is a character device"):
        list(read_documents("/dev/zero"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n{"text": "bad \xff byte"}\n')
    with pytest.raises(InputError, match=r"c.jsonl:2: not UTF-8 text \(byte 0xff at column 15\)"):
        list(read_documents(str(corpus)))
    assert all(isinstance(e, UserError) for e in (InputError("x"), ConfigError("x")))


def test_metrics_rows_of_non_finite_steps_are_whole_rows(tmp_path):
    """Python's json writes a skipped step's NaN loss as NaN: such a row is whole, kept on resume."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": float("nan"), "grad_norm": float("inf")}) + "\n")
    rows, bad = read_json_lines(str(path), 1 << 20)
    assert not bad and rows[0]["step"] == 1 and rows[0]["grad_norm"] == float("inf")
