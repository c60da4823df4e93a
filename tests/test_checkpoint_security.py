"""Loading a checkpoint never runs code.

A pickled object whose unpickling creates a marker file is planted into every kind of entry a
checkpoint holds (a tensor's record, an entry declared as bytes, the DCP metadata, meta.json,
the manifest; for expert and dense weights, the router's and the optimizer's state, the RNG
states), with the manifest's checksums recomputed so that every integrity check passes. A
negative control shows the planted file is live: DCP's own reader runs it. Then every reader
of the project refuses it in one line (exit 2 for the commands) and the marker never appears:
the checkpointer in process, ``train resume=PATH`` and ``resume=auto`` (2 ranks, ep=2, and the
DeepSpeed engine), ``eval --checkpoint`` and ``--run-dir``, ``convert``, ``export``; and the
readers of model directories (``ckpt.init_from``, ``import``, ``upcycle``) with pickled or
disguised weight files. The metadata unpickler admits exactly the classes DCP's metadata consists of:
every data class DCP defines is decided, and classes its modules merely import are refused.
"""
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from helpers import checkpoint_payloads as planted
from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.train.checkpoint import CheckpointError, Checkpointer, load_checkpoint
from moe_dist.train.checkpoint.files import MARKER, META, UnsafeCheckpoint
from moe_dist.train.loop.optim import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "test.yaml")
VOCAB = 512
KINDS = ("expert weight", "dense weight", "router state", "optimizer state", "rng state")


def config(tmp, *extra):
    return load_config(CONFIG, [f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache",
                                f"data.corpus={ROOT}/tests/data/python-docs", "parallel.ep=1",
                                "run.tensorboard=false", "run.plots=false", "run.progress=false", *extra])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint with model, AdamW state and RNG states, written by the checkpointer in process."""
    tmp = tmp_path_factory.mktemp("saved")
    cfg = config(tmp)
    model = build_model(cfg.model, VOCAB, seed=0)
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    path = Checkpointer(str(tmp / "run")).save(1, model, opt, rng_device=torch.device("cpu"))
    return cfg, path


def fresh(cfg):
    model = build_model(cfg.model, VOCAB, seed=1)
    return model, build_optimizer(model, cfg.train)


def copy_of(path, tmp_path):
    dest = tmp_path / "run" / "checkpoints" / os.path.basename(path)
    shutil.copytree(path, dest)
    return str(dest)


def test_a_planted_bytes_entry_runs_in_dcps_own_reader(saved, tmp_path):
    """Negative control: the planted checkpoint is live (the stock reader unpickles the payload)."""
    cfg, path = saved
    ckpt, marker = copy_of(path, tmp_path), str(tmp_path / "ran")
    key = planted.entry_keys(ckpt)["rng state"]
    planted.plant_bytes_entry(ckpt, key, marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({key: torch.get_rng_state()}, storage_reader=FileSystemReader(ckpt), no_dist=True)
    assert os.path.exists(marker)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["bytes entry", "tensor record"])
def test_every_entry_kind_is_refused_unread(saved, tmp_path, kind, how):
    cfg, path = saved
    ckpt, marker = copy_of(path, tmp_path), str(tmp_path / "ran")
    key = planted.entry_keys(ckpt)[kind]
    (planted.plant_bytes_entry if how == "bytes entry" else planted.plant_tensor_record)(ckpt, key, marker)
    model, opt = fresh(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsafeCheckpoint) as info:
        Checkpointer(str(tmp_path / "run")).load(ckpt, model, opt, rng_device=torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and key in message, message
    assert not os.path.exists(marker)
    if how == "bytes entry":  # refused from the metadata alone: nothing at all was read
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the weights-only reader (convert, export, eval): refused from the metadata, or when it reads the entry
    if how == "bytes entry" or kind not in ("optimizer state", "rng state"):
        with pytest.raises(UnsafeCheckpoint):
            load_checkpoint(fresh(cfg)[0], ckpt)
    else:  # it never reads optimizer or RNG entries
        load_checkpoint(fresh(cfg)[0], ckpt)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("where", [".metadata", META, MARKER])
def test_metadata_meta_json_and_manifest_payloads_are_refused(saved, tmp_path, where):
    cfg, path = saved
    ckpt, marker = copy_of(path, tmp_path), str(tmp_path / "ran")
    if where == ".metadata":
        planted.plant_metadata(ckpt, marker)
    else:
        planted.plant_file(ckpt, where, marker)
    model, opt = fresh(cfg)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(str(tmp_path / "run")).load(ckpt, model, opt, rng_device=torch.device("cpu"))
    assert "\n" not in str(info.value)
    if where == ".metadata":
        assert isinstance(info.value, UnsafeCheckpoint) and "refusing to unpickle" in str(info.value)
    assert not os.path.exists(marker)


def test_storage_records_outside_the_checkpoint_are_refused(saved, tmp_path):
    cfg, path = saved
    ckpt = copy_of(path, tmp_path)
    outside = tmp_path / "outside.distcp"
    shutil.copy(os.path.join(ckpt, sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]), outside)
    metadata = planted.read_metadata(ckpt)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../outside.distcp"
    planted.write_metadata(ckpt, metadata)
    planted.reseal(ckpt)
    with pytest.raises(UnsafeCheckpoint, match="not one of the checkpoint's own data files"):
        Checkpointer(str(tmp_path / "run")).load(ckpt, *fresh(cfg))


def test_rng_entries_of_another_shape_are_refused(saved, tmp_path):
    """RNG entries get the same shape and dtype check as the model's and the optimizer's (the entry's
    stored chunk made to fit its new size: a chunk beyond its tensor is refused earlier, as not DCP's form)."""
    import dataclasses

    cfg, path = saved
    ckpt = copy_of(path, tmp_path)
    metadata = planted.read_metadata(ckpt)
    key = planted.entry_keys(ckpt)["rng state"]
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size([7])
    planted.write_metadata(ckpt, metadata)
    planted.reseal(ckpt)
    with pytest.raises(CheckpointError, match=r"a chunk .* that is not a block of its \[7\] tensor"):
        Checkpointer(str(tmp_path / "run")).load(ckpt, *fresh(cfg), rng_device=torch.device("cpu"))
    entry.chunks = [dataclasses.replace(chunk, sizes=torch.Size([7])) for chunk in entry.chunks]
    planted.write_metadata(ckpt, metadata)
    planted.reseal(ckpt)
    with pytest.raises(CheckpointError, match="another shape or dtype"):
        Checkpointer(str(tmp_path / "run")).load(ckpt, *fresh(cfg), rng_device=torch.device("cpu"))


# ---- the metadata unpickler's allowlist -----------------------------------------------------------------------
DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_PLANNER = "torch.distributed.checkpoint.planner"
DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
# DCP's data classes that a .metadata file never holds. With safe_dcp.METADATA_CLASSES they must cover every
# class of DCP's metadata module and every dataclass and enum of its planner and filesystem modules, so a class
# torch adds there fails the test below until it is put in one list or the other.
NOT_IN_METADATA = {
    # a load's plan: made by the reader from the metadata while it loads, never saved
    (DCP_PLANNER, "LoadPlan"), (DCP_PLANNER, "ReadItem"), (DCP_PLANNER, "LoadItemType"),
    # a field of WriteItem that torch never fills (a bytes entry's WriteItem carries no write data)
    (DCP_PLANNER, "BytesIOWriteData"),
    # the file-name prefix the writer gives each rank's plan, after the plans were recorded in the metadata
    (DCP_FILESYSTEM, "_StoragePrefix"),
    # the writer's setting of the data files' format (torch.save or safetensors records), not saved
    (DCP_FILESYSTEM, "SerializationFormat"),
}


def dcp_data_classes():
    """(module, name) of every class defined in DCP's metadata module, and of every dataclass and enum defined
    in its planner and filesystem modules (their other classes are planners, readers and writers: code)."""
    import dataclasses
    import enum
    import importlib
    import inspect

    found = set()
    for module, every_class in ((DCP_METADATA, True), (DCP_PLANNER, False), (DCP_FILESYSTEM, False)):
        for name, obj in vars(importlib.import_module(module)).items():
            if inspect.isclass(obj) and obj.__module__ == module and (
                    every_class or dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                found.add((module, name))
    return found


def test_the_metadata_allowlist_decides_every_data_class_of_dcp():
    import importlib

    from moe_dist.safe_dcp import METADATA_CLASSES

    classes = dcp_data_classes()
    assert (DCP_METADATA, "TensorStorageMetadata") in classes and (DCP_FILESYSTEM, "_StorageInfo") in classes
    undecided = sorted(classes - METADATA_CLASSES - NOT_IN_METADATA)
    assert not undecided, (f"torch defines {undecided}: add each to moe_dist.safe_dcp.METADATA_CLASSES if a "
                           ".metadata file can hold it, else to NOT_IN_METADATA in this test, with the reason")
    assert not METADATA_CLASSES & NOT_IN_METADATA
    assert NOT_IN_METADATA <= classes  # no stale entry here
    for module, name in sorted(METADATA_CLASSES):  # no misspelt name (it would refuse real checkpoints)
        try:
            home = importlib.import_module(module)
        except ImportError:  # pathlib._local: Python 3.13 and later
            continue
        assert getattr(home, name, None) is not None, f"{module}.{name}"


def test_the_metadata_of_every_kind_of_entry_is_read(tmp_path):
    """Raw DCP saves of tensors of every dtype and layout, non-tensor (bytes) entries and nested containers:
    their metadata unpickles with the allowlist."""
    import collections
    import pathlib

    from moe_dist.safe_dcp import SafeFileSystemReader

    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8,
              torch.uint8, torch.int64, torch.bool, torch.complex64]
    state = {f"t.{d}".replace("torch.", ""): torch.zeros(2, 3).to(d) for d in dtypes}
    state.update({"transposed": torch.arange(6).view(2, 3).t(), "scalar": torch.tensor(1.5), "empty": torch.empty(0, 3),
                  "channels_last": torch.zeros(1, 2, 3, 3).to(memory_format=torch.channels_last),
                  "int": 3, "str": "x", "none": None, "bytes": b"raw", "list": [1, "a", torch.ones(2)],
                  "nested": {"a": {"b": [1, {"c": torch.zeros(1)}]}}, "od": collections.OrderedDict(a=1)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "str"), no_dist=True)  # StorageMeta.checkpoint_id: a str
        dcp.save(state, storage_writer=dcp.FileSystemWriter(pathlib.Path(tmp_path / "path")), no_dist=True)  # a Path
    for directory in ("str", "path"):
        metadata = SafeFileSystemReader(str(tmp_path / directory), allow_objects=True).read_metadata()
        assert {"t.bfloat16", "bytes", "nested.a.b.1.c"} <= set(metadata.state_dict_metadata), directory


# classes that DCP's modules merely import (they run code when called), each as a DCP module spells it and as
# its own module does
IMPORTED_BY_DCP = [
    ("torch.distributed.checkpoint._async_process_executor", "TCPStore"),
    ("torch.distributed", "TCPStore"),
    ("torch.distributed.checkpoint._async_thread_executor", "ThreadPoolExecutor"),
    ("concurrent.futures", "ThreadPoolExecutor"),
    ("torch.distributed.checkpoint.utils", "Stats"),
    ("pstats", "Stats"),
    ("torch.distributed.checkpoint._experimental.checkpoint_process", "Connection"),
    (DCP_METADATA, "Enum"),
    (DCP_FILESYSTEM, "Path"),
]


@pytest.mark.parametrize("module, name", IMPORTED_BY_DCP, ids=[f"{m}.{n}" for m, n in IMPORTED_BY_DCP])
def test_classes_dcp_modules_import_are_refused(tmp_path, module, name):
    import importlib
    import pickle

    from moe_dist.safe_dcp import SafeFileSystemReader

    try:
        home = importlib.import_module(module)
    except ImportError:
        home = None
    if getattr(home, name, None) is None:
        pytest.skip(f"this torch has no {module}.{name}")
    data = f"c{module}\n{name}\n.".encode()  # a pickle of the global module.name
    found = pickle.loads(data)  # control: the name is there, a class, and a plain unpickler hands it out
    assert isinstance(found, type), found
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpoint) as info:
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert f"refers to {module}.{name}, which a checkpoint's metadata never holds; refusing to unpickle it" in str(
        info.value)


# ---- the commands, on a real training run --------------------------------------------------------------------
def cli(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "moe_dist.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_overrides(run_dir, cache, *extra):
    return [f"run.dir={run_dir}", f"data.cache_dir={cache}", f"data.corpus={ROOT}/tests/data/python-docs",
            "run.tensorboard=false", "run.plots=false", "run.progress=false", "eval.max_sequences=8", *extra]


def one_line_refusal(proc, command, marker):
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"moe-dist {command}: error:"), proc.stderr[-3000:]
    assert not os.path.exists(marker)
    return errors[0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-rank, ep=2 training run of configs/test.yaml with one checkpoint (step 2)."""
    tmp = tmp_path_factory.mktemp("trained")
    run_dir, cache = tmp / "run", tmp / "cache"
    proc = cli("train", "--config", CONFIG, "--nproc", "2", *run_overrides(run_dir, cache, "train.steps=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, cache


def planted_run(trained_run, tmp_path):
    """A copy of the trained run whose checkpoint has the payload in its RNG entry (the reported attack)."""
    run_dir, cache = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    ckpt = str(copy / "checkpoints" / "step_000002")
    marker = str(tmp_path / "ran")
    planted.plant_bytes_entry(ckpt, planted.entry_keys(ckpt)["rng state"], marker)
    return copy, cache, ckpt, marker


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["path", "auto"])
def test_train_resume_refuses_a_planted_checkpoint(trained_run, tmp_path, resume):
    run_dir, cache, ckpt, marker = planted_run(trained_run, tmp_path)
    choice = ckpt if resume == "path" else "auto"
    proc = cli("train", "--config", CONFIG, "--nproc", "2",
               *run_overrides(run_dir, cache, "train.steps=4", f"resume={choice}"))
    line = one_line_refusal(proc, "train", marker)
    assert "rng.rank_00000.torch_cpu" in line and "nothing was loaded" in line
    assert os.path.isdir(ckpt)  # kept where it was, not set aside or deleted


@pytest.mark.slow
def test_the_deepspeed_engine_refuses_a_planted_checkpoint(tmp_path):
    """train.engine=deepspeed writes and reads the same checkpoint format through the same reader."""
    from moe_dist.train.engines.deepspeed import deepspeed_available

    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(f"deepspeed is not importable: {why}")
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    ds = ("train.engine=deepspeed", "deepspeed.zero_stage=1")
    proc = cli("train", "--config", CONFIG, "--nproc", "2", *run_overrides(run_dir, cache, "train.steps=2", *ds))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt, marker = str(run_dir / "checkpoints" / "step_000002"), str(tmp_path / "ran")
    planted.plant_bytes_entry(ckpt, planted.entry_keys(ckpt)["optimizer state"], marker)
    proc = cli("train", "--config", CONFIG, "--nproc", "2",
               *run_overrides(run_dir, cache, "train.steps=4", "resume=auto", *ds))
    assert "exp_avg_sq" in one_line_refusal(proc, "train", marker)


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["eval --checkpoint", "eval --run-dir", "convert", "export"])
def test_other_commands_refuse_a_planted_checkpoint(trained_run, tmp_path, reader):
    run_dir, cache, ckpt, marker = planted_run(trained_run, tmp_path)
    out = str(tmp_path / "out")
    args = {"eval --checkpoint": ["eval", "--run-dir", str(run_dir), "--checkpoint", ckpt, "parallel.ep=1"],
            "eval --run-dir": ["eval", "--run-dir", str(run_dir), "parallel.ep=1"],
            "convert": ["convert", "--checkpoint", ckpt, "--out", out],
            "export": ["export", "--checkpoint", ckpt, "--out", out]}[reader]
    proc = cli(*args)
    line = one_line_refusal(proc, args[0], marker)
    assert "BytesStorageMetadata" in line
    assert not os.path.exists(out) or not os.listdir(out)


@pytest.mark.slow
def test_model_directory_readers_refuse_pickles(trained_run, tmp_path):
    """``ckpt.init_from``, ``import`` and ``upcycle`` read safetensors only: a real Hugging Face directory
    whose weights are a pickled ``pytorch_model.bin``, or a pickle named ``model.safetensors``, is
    refused in one line."""
    from helpers.hf_cases import build_dense, build_moe

    _run_dir, cache = trained_run
    marker = str(tmp_path / "ran")
    cases = []
    for name, weights in (("bin", "pytorch_model.bin"), ("disguised", "model.safetensors")):
        dense, moe = tmp_path / f"dense-{name}", tmp_path / f"moe-{name}"
        build_dense("llama", str(dense))
        build_moe("mixtral", str(moe))
        for d in (dense, moe):
            for f in os.listdir(d):
                if f.endswith(".safetensors") or f.endswith(".json") and "index" in f:
                    os.remove(d / f)
            with open(d / weights, "wb") as f:
                f.write(planted.payload_bytes(marker))
        cases += [("upcycle", ["--dense", str(dense)]), ("import", ["--hf", str(moe)])]
        proc = cli("train", "--config", CONFIG, *run_overrides(tmp_path / f"init-{name}", cache, "parallel.ep=1",
                                                              "train.steps=1", f"ckpt.init_from={moe}"))
        one_line_refusal(proc, "train", marker)
    for command, source in cases:
        out = tmp_path / f"out-{command}-{len(os.listdir(tmp_path))}"
        proc = cli(command, *source, "--out", str(out))
        one_line_refusal(proc, command, marker)
        assert not os.path.exists(out)
