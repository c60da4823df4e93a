"""Checkpoint files on one process: the manifest and its checksums, refusals (damaged files,
missing tensors, another model, another router), pruning, the partial directory, async
saves, RNG states, the metadata unpickler, and the trainer's resume settings."""
import glob
import hashlib
import json
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

from moe_dist.config import ConfigError, load_config
from moe_dist.model import build_model
from moe_dist.train import checkpoint as ck
from moe_dist.train.checkpoint import (CheckpointError, Checkpointer, IncompleteCheckpoint, latest_checkpoint,
                                       load_checkpoint, step_dir)
from moe_dist.train.checkpoint import checkpointer as ck_save
from moe_dist.train.checkpoint.files import SafeFileSystemReader, read_manifest, sha256_file
from moe_dist.train.loop.optim import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def config(tmp, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "parallel.ep=1", "run.tensorboard=false", "run.plots=false", "run.progress=false", *extra])


def trained(cfg, seed=0, steps=1):
    """A model and an AdamW that has taken ``steps`` steps (so it has state)."""
    model = build_model(cfg.model, VOCAB, seed=seed)
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(directory):
    """path -> SHA-256 of every file under ``directory`` (but the run lock's note of who holds it)."""
    return {p: sha256_file(p) for p in sorted(glob.glob(os.path.join(directory, "**"), recursive=True))
            if os.path.isfile(p) and os.path.basename(p) != "run.lock"}


def same_state(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    path = Checkpointer(str(tmp_path / "run")).save(1, model, opt, meta={"note": 1}, config={"model": {"x": 1}},
                                                     rng_device=torch.device("cpu"))
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step_000001"]  # no partial directory left
    manifest = read_manifest(path)
    assert manifest["step"] == 1 and manifest["contents"] == ["model", "optimizer", "rng"]
    assert manifest["layout"] == {"world_size": 1, "ep": 1, "edp": 1, "dp": 1, "dense": "local", "expert_split": "none"}
    assert manifest["experts"] == {"blocks.0.ffn.experts": 4, "blocks.1.ffn.experts": 4}
    assert len(manifest["config_sha256"]) == 64 and len(manifest["model_config_sha256"]) == 64
    files = sorted(n for n in os.listdir(path) if n != "COMPLETE")
    assert sorted(manifest["files"]) == files and {".metadata", "meta.json"} <= set(files)
    for name, rec in manifest["files"].items():
        full = os.path.join(path, name)
        assert rec == {"bytes": os.path.getsize(full), "sha256": hashlib.sha256(open(full, "rb").read()).hexdigest()}
    assert json.load(open(os.path.join(path, "meta.json"))) == {"step": 1, "note": 1}
    keys = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    # optimizer state keyed by global expert like the weights, one entry per expert and state
    assert {f"optim.blocks.1.ffn.experts.w2.{s}.expert_{e}" for s in ("exp_avg", "exp_avg_sq") for e in range(4)} <= keys
    assert "optim.blocks.1.ffn.experts.w2.step" in keys and "rng.rank_00000.torch_cpu" in keys


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg, seed=0, steps=2)
    ckpt = Checkpointer(str(tmp_path / "run"))
    torch.manual_seed(123)
    np.random.seed(5)
    random.seed(7)
    path = ckpt.save(2, model, opt, rng_device=torch.device("cpu"))
    expected = (torch.rand(3), np.random.rand(2), random.random())
    other, other_opt = build_model(cfg.model, VOCAB, seed=1), None
    other_opt = build_optimizer(other, cfg.train)  # no state yet: created from the checkpoint
    meta, manifest = ckpt.load(path, other, other_opt, rng_device=torch.device("cpu"))
    assert meta["step"] == 2 and manifest["step"] == 2
    assert (torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()) == \
           (expected[0].tolist(), expected[1].tolist(), expected[2])
    assert same_state(model, other)
    mine = ck.optimizer_state_dict(model, opt)
    theirs = ck.optimizer_state_dict(other, other_opt)
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert theirs["optim.blocks.0.ffn.experts.w1.step"].device.type == "cpu"
    # and the next optimizer step is the same
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(9))
    for m, o in ((model, opt), (other, other_opt)):
        torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        o.step()
    assert same_state(model, other)


def test_damaged_files_are_refused_by_name(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    good = Checkpointer(str(tmp_path / "run")).save(1, model, opt)
    data = next(n for n in os.listdir(good) if n.endswith(".distcp"))

    def damaged(name, how):
        path = str(tmp_path / f"bad-{name}-{how}" / "checkpoints" / "step_000001")
        shutil.copytree(good, path)
        target = os.path.join(path, name)
        raw = bytearray(open(target, "rb").read())
        if how == "flip":
            raw[len(raw) // 2] ^= 0x10
        elif how == "truncate":
            raw = raw[: len(raw) - 100]
        open(target, "wb").write(bytes(raw))
        return path

    fresh = build_model(cfg.model, VOCAB, seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for name, how, words in ((data, "flip", "SHA-256"), (data, "truncate", "bytes"), (".metadata", "flip", "SHA-256"),
                             (".metadata", "truncate", "truncated"), ("meta.json", "flip", "SHA-256")):
        path = damaged(name, how)
        files_before = snapshot(os.path.dirname(path))
        with pytest.raises(CheckpointError, match=words) as err:
            load_checkpoint(fresh, path)
        assert os.path.join(path, name) in str(err.value) and "nothing was changed" in str(err.value)
        assert snapshot(os.path.dirname(path)) == files_before
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing loaded
    missing = damaged(data, "keep")
    os.remove(os.path.join(missing, data))
    with pytest.raises(CheckpointError, match=f"{data}: missing"):
        load_checkpoint(fresh, missing)
    no_marker = damaged("COMPLETE", "keep")
    os.remove(os.path.join(no_marker, "COMPLETE"))
    with pytest.raises(IncompleteCheckpoint, match="no COMPLETE marker"):
        load_checkpoint(fresh, no_marker)
    open(os.path.join(no_marker, "COMPLETE"), "w").write("ok\n")  # a marker without a manifest
    with pytest.raises(IncompleteCheckpoint, match="not a readable manifest"):
        load_checkpoint(fresh, no_marker)
    assert latest_checkpoint(os.path.dirname(os.path.dirname(no_marker))) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process
def test_other_shapes_and_missing_experts_are_refused(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    path = Checkpointer(str(tmp_path / "run")).save(1, model, opt)
    wider = build_model(config(tmp_path, "model.moe.d_ff=32").model, VOCAB)
    with pytest.raises(CheckpointError, match=r"other shapes: blocks.0.ffn.experts.w1.expert_0 \(checkpoint \[64, 64\], "
                                              r"model \[64, 32\]\)"):
        load_checkpoint(wider, path)
    more = build_model(config(tmp_path, "model.moe.num_experts=8", "model.moe.top_k=2").model, VOCAB)
    with pytest.raises(CheckpointError, match=r"missing model tensors .*expert_4"):
        load_checkpoint(more, path)
    other_router = build_model(config(tmp_path, "model.moe.router=xmoe").model, VOCAB)
    with pytest.raises(CheckpointError, match="tensors this model does not have"):
        load_checkpoint(other_router, path)

    # a writer that drops an expert never produces a complete checkpoint (and nothing older is pruned)
    real = ck_save.expert_keyed_state_dict  # what the checkpointer saves

    def lossy(m):
        sd = real(m)
        del sd["blocks.1.ffn.experts.w2.expert_3"]
        return sd

    ck_save.expert_keyed_state_dict = lossy
    try:
        with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\).*blocks.1.ffn.experts.w2.expert_3"):
            Checkpointer(str(tmp_path / "run"), keep=1).save(2, model, opt)
    finally:
        ck_save.expert_keyed_state_dict = real
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_000001", "step_000002.partial"]
    assert latest_checkpoint(str(tmp_path / "run")) == path

    # a checkpoint that lacks an expert (written by something else, with a valid manifest) is refused by name
    import torch.distributed.checkpoint as dcp
    from moe_dist.train.checkpoint.files import file_record, write_json_durably

    odd = str(tmp_path / "odd")
    sd = real(model)
    del sd["blocks.0.ffn.experts.w3.expert_2"]
    dcp.save(sd, checkpoint_id=odd, no_dist=True)
    write_json_durably(os.path.join(odd, "meta.json"), {"step": 1})
    write_json_durably(os.path.join(odd, "COMPLETE"), {"format": "moe_dist.checkpoint", "version": 1, "step": 1,
                                                        "contents": ["model"],
                                                        "files": {n: file_record(os.path.join(odd, n)) for n in os.listdir(odd)
                                                                  if n != "COMPLETE"}})
    with pytest.raises(CheckpointError, match=r"missing model tensors blocks.0.ffn.experts.w3.expert_2 \(1\)"):
        load_checkpoint(build_model(cfg.model, VOCAB), odd)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        Checkpointer(odd).load(odd, *trained(cfg))


def test_keep_prunes_only_complete_older_checkpoints(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    run = str(tmp_path / "run")
    ckpt = Checkpointer(run, keep=2)
    ckpt.save(1, model, opt)
    os.makedirs(os.path.join(run, "checkpoints", "step_000002.partial"))  # a crashed save of step 2
    os.makedirs(os.path.join(run, "checkpoints", "step_000009.partial"))  # an unfinished save of a later step
    notes = []
    assert latest_checkpoint(run, log=notes.append).endswith("step_000001")
    assert len(notes) == 2 and all("did not finish" in n for n in notes)
    for step in (3, 4, 5):
        ckpt.save(step, model, opt)
    names = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert names == ["step_000004", "step_000005", "step_000009.partial"]  # stale partial of step 2 removed too
    assert ckpt.save(5, model, opt).endswith("step_000005")  # saving a step again replaces it
    assert read_manifest(step_dir(run, 5))["step"] == 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP on one process
def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path):
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(str(tmp_path / "run"), async_save=True)
    path = ckpt.save(1, model, opt)
    with torch.no_grad():  # training goes on while the save is written
        for p in model.parameters():
            p.add_(1.0)
    assert ckpt.saving == 1
    ckpt.wait()
    assert ckpt.saving is None and read_manifest(path)["step"] == 1
    fresh = build_model(cfg.model, VOCAB, seed=3)
    load_checkpoint(fresh, path)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_metadata_unpickler_refuses_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    os.makedirs(tmp_path / "evil")
    with open(tmp_path / "evil" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        SafeFileSystemReader(str(tmp_path / "evil")).read_metadata()
    assert not os.path.exists(tmp_path / "pwned")


def test_metadata_unpickler_enum_members_as_python_3_11_2_pickles_them(tmp_path):
    """Debian bookworm's Python 3.11.2 (the Docker image's) pickles an enum member as getattr(cls, name):
    that form loads; getattr of anything but an enum member is refused."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = list(_MEM_FORMAT_ENCODING)[0]

    class AsGetattr:
        def __init__(self, obj, name):
            self.args = (obj, name)

        def __reduce__(self):
            return (getattr, self.args)

    for name, payload, ok in [("enum", AsGetattr(_MEM_FORMAT_ENCODING, member.name), True),
                              ("escape", AsGetattr(_MEM_FORMAT_ENCODING, "__init__"), False),
                              ("set", AsGetattr(set, "__init__"), False)]:
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / ".metadata", "wb") as f:
            pickle.dump(payload, f)
        if ok:
            from moe_dist.safe_dcp import _MetadataUnpickler

            with open(tmp_path / name / ".metadata", "rb") as f:
                assert _MetadataUnpickler(f).load() is member
        else:
            with pytest.raises(CheckpointError, match="refusing to unpickle"):
                SafeFileSystemReader(str(tmp_path / name)).read_metadata()


def test_trainer_resume_settings_and_refusals(tmp_path):
    from moe_dist.train.loop.trainer import Trainer, train

    run = str(tmp_path / "run")
    first = train(config(tmp_path, "train.steps=4", "ckpt.every=2"))
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_000002", "step_000004"]
    files = snapshot(run)

    # refusals: another router, another shape, a damaged file, a path that does not exist; nothing is changed
    bad = str(tmp_path / "bad" / "checkpoints" / "step_000004")
    shutil.copytree(step_dir(run, 4), bad)
    data = os.path.join(bad, next(n for n in os.listdir(bad) if n.endswith(".distcp")))
    raw = bytearray(open(data, "rb").read())
    raw[100] ^= 1
    open(data, "wb").write(bytes(raw))
    for extra, error, words in (
            (["model.moe.router=symphony"], CheckpointError, r"another model.*model.moe.router: checkpoint 'topk', "
                                                              r"config 'symphony'"),
            (["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1"], CheckpointError, r"model.d_model: checkpoint 64"),
            ([f"resume={bad}"], CheckpointError, data + ": SHA-256 differs"),
            ([f"resume={tmp_path}/nowhere"], ConfigError, "allowed: auto, none"),
    ):
        args = ["train.steps=4", "resume=auto", *extra]
        with pytest.raises(error, match=words):
            Trainer(config(tmp_path, *args))
        assert snapshot(run) == files, extra

    # resume=auto of a finished run: nothing left to train, same summary, metrics kept
    again = train(config(tmp_path, "train.steps=4", "resume=auto"))
    assert again["steps"] == 4 and again["val_loss"] == first["val_loss"] and again["train_loss"] is None
    assert [json.loads(r)["step"] for r in open(os.path.join(run, "metrics.jsonl"))] == [1, 2, 3, 4]

    # resume from an earlier checkpoint of the same run: later checkpoints (another timeline) are moved aside
    trainer = Trainer(config(tmp_path, "train.steps=4", f"resume={step_dir(run, 2)}"))
    try:
        assert trainer.step == 2 and trainer.sampler.consumed == 2 * 8
        assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["step_000002"]
        aside = glob.glob(os.path.join(run, "checkpoints.superseded-*", "step_000004"))
        assert len(aside) == 1
        assert [json.loads(r)["step"] for r in open(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    finally:
        trainer.close()

    # resume=none in a run directory with checkpoints: a fresh start, the old checkpoints are kept aside
    trainer = Trainer(config(tmp_path, "train.steps=4", "resume=none"))
    try:
        assert trainer.step == 0 and latest_checkpoint(run) is None
        assert os.path.getsize(os.path.join(run, "metrics.jsonl")) == 0  # the old rows are gone
        assert len(glob.glob(os.path.join(run, "checkpoints.superseded-*", "step_*"))) >= 2
    finally:
        trainer.close()


# ---- meta.json and the manifest are checked against their schema when read ----------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run of configs/test.yaml on one process, trained in process, with its checkpoint of step 2."""
    from moe_dist.train.loop.trainer import train

    tmp = tmp_path_factory.mktemp("schema")
    train(config(tmp, "train.steps=2"))
    return tmp


DELETE = object()  # edited(): remove the field


def edited(ckpt, name, field, value):
    """Set (or, with value=DELETE, remove) ``field`` (a dotted path) of the checkpoint's JSON file
    ``name``; meta.json's checksum in the manifest is recomputed (what a forger does)."""
    from helpers.checkpoint_payloads import reseal

    path = os.path.join(ckpt, name)
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    *parents, last = field.split(".")
    holder = obj
    for key in parents:
        holder = holder[key]
    if value is DELETE:
        del holder[last]
    else:
        holder[last] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    if name != "COMPLETE":
        reseal(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("resume, name, field, value, words", [
    ("path", "meta.json", "diagnostics.probe_prev", "x",
     "field diagnostics.probe_prev: got 'x' (a string); allowed: null or an object"),
    ("path", "meta.json", "counters.skipped_steps", [1],
     "field counters.skipped_steps: got [1] (a list); allowed: an integer >= 0"),
    ("path", "meta.json", "sampler", DELETE,
     "field sampler is missing; allowed: an object {consumed, seed, seq_len, n_windows, blend}"),
    ("path", "meta.json", "sampler.consumed", "16",
     "field sampler.consumed: got '16' (a string); allowed: an integer >= 0"),
    ("path", "COMPLETE", "layout", "local",
     "field layout: got 'local' (a string); allowed: an object {world_size"),
    ("auto", "meta.json", "diagnostics.probe_prev", "x",
     "field diagnostics.probe_prev: got 'x' (a string)"),
])
def test_resume_refuses_a_json_field_of_another_type_by_name(trained_run, tmp_path, resume, name, field, value, words):
    """A meta.json or manifest field the code reads, of another type (checksums recomputed): the
    resume stops with exit 2 and one line naming the field and what is allowed; nothing is moved."""
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(trained_run / "run", run)
    ckpt = step_dir(str(run), 2)
    edited(ckpt, name, field, value)
    files = snapshot(os.path.dirname(ckpt))
    proc = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", f"{ROOT}/configs/test.yaml",
                           "--nproc", "1", f"run.dir={run}", f"data.cache_dir={trained_run}/cache",
                           f"data.corpus={ROOT}/tests/data/python-docs", "parallel.ep=1", "run.tensorboard=false",
                           "run.plots=false", "run.progress=false", "train.steps=4",
                           f"resume={ckpt if resume == 'path' else 'auto'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("moe-dist train: error:"), proc.stderr[-3000:]
    assert words in errors[0] and os.path.join(ckpt, name) in errors[0], errors[0]
    assert snapshot(os.path.dirname(ckpt)) == files  # the checkpoint is kept as it was (not set aside)


def test_meta_json_fields_are_checked_after_the_checksums(tmp_path):
    """In process: a field of another type is refused by name; a meta.json edited without
    recomputing its checksum is reported as damaged first."""
    cfg = config(tmp_path)
    model, opt = trained(cfg)
    path = Checkpointer(str(tmp_path / "run")).save(1, model, opt, meta={"counters": {"recent_losses": [1.0, 2.0]}})
    load_checkpoint(build_model(cfg.model, VOCAB), path)  # as written: accepted
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump({"step": 1, "counters": {"recent_losses": [1.0, "nan"]}}, f)
    with pytest.raises(CheckpointError, match=r"is damaged and was not loaded .*meta.json: \d+ bytes, the manifest"):
        load_checkpoint(build_model(cfg.model, VOCAB), path)
    from helpers.checkpoint_payloads import reseal

    reseal(path)
    with pytest.raises(CheckpointError, match=r"meta.json: field counters.recent_losses\[1\]: got 'nan' \(a string\); "
                                              "allowed: a number; nothing was loaded"):
        load_checkpoint(build_model(cfg.model, VOCAB), path)
    edited(path, "COMPLETE", "files", {"meta.json": {"bytes": "12", "sha256": "0" * 64}})
    with pytest.raises(IncompleteCheckpoint, match=r'field files\["meta.json"\].bytes: got \'12\''):
        load_checkpoint(build_model(cfg.model, VOCAB), path)
