"""Config schema, YAML + overrides, and every error path's message (key and what is allowed)."""
import dataclasses
import os

import pytest
import yaml

from moe_dist.cli import main as cli_main
from moe_dist.config import (Config, ConfigError, apply_overrides, config_from_dict, describe_schema, dump_config,
                             load_config, parse_override)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISSUE_KEYS = ["model.moe.router", "model.moe.num_experts", "model.moe.top_k", "model.moe.capacity_factor",
              "model.moe.layers", "parallel.ep", "train.steps", "train.global_batch", "train.seq_len", "train.seed",
              "run.dir"]


def test_shipped_configs_load():
    tiny = load_config(os.path.join(ROOT, "configs/tiny.yaml"))
    assert (tiny.model.moe.num_experts, tiny.model.moe.top_k, tiny.parallel.ep) == (8, 2, 2)
    assert tiny.model.moe.capacity_factor is None
    test = load_config(os.path.join(ROOT, "configs/test.yaml"))
    assert test.data.corpus == "tests/data/python-docs"


def test_issue_keys_exist():
    keys = {row[0] for row in describe_schema()}
    assert set(ISSUE_KEYS) <= keys
    assert all(help_text for _, _, _, help_text in describe_schema())


def test_overrides_are_typed_yaml():
    cfg = load_config(None, ["train.steps=7", "model.moe.layers=[0, 2]", "train.lr=1e-3",
                             "model.moe.capacity_factor=1.25", "model.moe.capacity_factor=null", "run.plots=false",
                             "model.moe.router_options={noisy: true}", "model.moe.layers=every_other"])
    assert cfg.train.steps == 7 and cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.moe.capacity_factor is None and cfg.run.plots is False
    assert cfg.model.moe.router_options == {"noisy": True} and cfg.model.moe.layers == "every_other"
    assert cfg.model.moe.layer_indices(6) == [1, 3, 5]
    assert load_config(None, ["model.moe.layers=[2, 0]"]).model.moe.layer_indices(4) == [0, 2]
    assert load_config(None, ["model.n_layers=3"]).model.moe.layer_indices(3) == [0, 1, 2]
    assert parse_override("a.b=") == ("a.b", "")


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\n  lr: 2e-3\nmodel:\n  moe:\n    top_k: 1\n")
    cfg = load_config(str(path), ["train.steps=9"])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.moe.top_k) == (9, 2e-3, 1)


def test_dump_round_trip():
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), ["model.moe.layers=[1, 3]"])
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


ERRORS = [
    # (overrides, substrings that must all appear in the message)
    (["model.moe.topk=2"], ["model.moe.topk", "unknown config key", "did you mean 'model.moe.top_k'", "allowed keys"]),
    (["trian.steps=2"], ["trian", "unknown config key", "did you mean 'train'"]),
    (["model.moe.router=nope"], ["model.moe.router", "'nope'", "allowed", "topk"]),
    (["model.moe.router_options={bogus: 1}"], ["model.moe.router_options", "bogus", "allowed", "normalize"]),
    (["model.moe.router_options=3"], ["model.moe.router_options", "allowed: a mapping"]),
    (["model.moe.top_k=9"], ["model.moe.top_k", "9", "model.moe.num_experts=8"]),
    (["model.moe.num_experts=0"], ["model.moe.num_experts", "allowed: >= 1"]),
    (["model.moe.capacity_factor=0"], ["model.moe.capacity_factor", "allowed: > 0"]),
    (["model.moe.capacity_factor=lots"], ["model.moe.capacity_factor", "'lots'", "a number or null"]),
    (["model.moe.layers=all"], ["model.moe.layers", "'all'", "'every', 'every_other'", "a list of integers"]),
    (["model.moe.layers=[7]"], ["model.moe.layers", "[7]", "allowed: 0..3"]),
    (["model.moe.layers=[]"], ["model.moe.layers", "empty list"]),
    (["model.moe.layers=[1, 1]"], ["model.moe.layers", "repeated"]),
    (["model.moe.layers=[1, x]"], ["model.moe.layers", "'x'"]),
    (["model.moe.drop_policy=random"], ["model.moe.drop_policy", "'random'", "'position', 'probs'"]),
    (["parallel.ep=3"], ["parallel.ep", "3", "model.moe.num_experts=8"]),
    (["parallel.dense=zero3"], ["parallel.dense", "'fsdp', 'replicate'"]),
    (["parallel.backend=mpi"], ["parallel.backend", "'auto', 'gloo', 'nccl'"]),
    (["train.steps=abc"], ["train.steps", "'abc'", "an integer"]),
    (["train.steps=2.5"], ["train.steps", "2.5", "an integer"]),
    (["train.steps=true"], ["train.steps", "True", "an integer"]),
    (["train.steps=0"], ["train.steps", "allowed: >= 1"]),
    (["train.global_batch=0"], ["train.global_batch", "allowed: >= 1"]),
    (["train.seq_len=1"], ["train.seq_len", "allowed: >= 2"]),
    (["train.seed=-1"], ["train.seed", "allowed: >= 0"]),
    (["train.grad_accum=3"], ["train.grad_accum", "train.global_batch=16"]),
    (["train.dtype=fp16"], ["train.dtype", "'fp32', 'bf16'"]),
    (["train.lr=0"], ["train.lr", "allowed: > 0"]),
    (["train.min_lr_ratio=2"], ["train.min_lr_ratio", "allowed: <= 1"]),
    (["train.lr=.inf"], ["train.lr", "a number"]),
    (["run.dir="], ["run.dir", "non-empty"]),
    (["run.dir=[a]"], ["run.dir", "a string"]),
    (["run.tensorboard=1"], ["run.tensorboard", "true or false"]),
    (["run.progress=maybe"], ["run.progress", "'maybe'", "allowed: one of 'auto' or true or false"]),
    (["model.n_heads=7"], ["model.n_heads", "model.d_model=256"]),
    (["model.d_model=24", "model.n_heads=8"], ["model.n_heads", "must be even"]),
    (["model.n_kv_heads=3"], ["model.n_kv_heads", "model.n_heads=8"]),
    (["model=3"], ["model", "allowed: a mapping"]),
    (["train.steps.max=3"], ["train.steps", "allowed: an integer"]),
    (["train.steps=3", "train.steps.max=3"], ["train.steps", "not a section"]),
    (["data.vocab_size=100"], ["data.vocab_size", "allowed: >= 300"]),
    (["data.val_fraction=0.9"], ["data.val_fraction", "allowed: <= 0.5"]),
    (["data.format=csv"], ["data.format", "'auto', 'text', 'jsonl'"]),
    (["eval.batch=0"], ["eval.batch", "allowed: >= 1"]),
    (["ckpt.every=-5"], ["ckpt.every", "allowed: >= 0"]),
    (["train.steps"], ["train.steps", "expected KEY=VALUE"]),
    (["=3"], ["empty key"]),
    (["train.steps=[1"], ["train.steps", "cannot parse"]),
]


@pytest.mark.parametrize("overrides,expected", ERRORS, ids=[" ".join(o) for o, _ in ERRORS])
def test_config_errors_name_key_and_allowed(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for text in expected:
        assert text in str(info.value), f"{text!r} not in {str(info.value)!r}"


def test_world_dependent_checks():
    cfg = load_config(None, ["parallel.ep=4", "train.global_batch=16", "train.grad_accum=4", "eval.batch=8"])
    cfg.check_world(4)
    with pytest.raises(ConfigError, match=r"parallel.ep: 4 must divide the world size 6"):
        cfg.check_world(6)
    with pytest.raises(ConfigError, match=r"train.global_batch: .* 4 sequences per forward .* \(8\)"):
        cfg.check_world(8)
    cfg = load_config(None, ["eval.batch=2"])
    with pytest.raises(ConfigError, match=r"eval.batch: 2 must be at least the number of data-parallel ranks \(4\)"):
        cfg.check_world(4)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--config: file .*missing.yaml.* does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections"):
        load_config(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        load_config(str(broken))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert isinstance(load_config(str(empty)), Config)


def test_apply_overrides_creates_sections():
    raw = apply_overrides({}, ["model.moe.top_k=1", "train.steps=3"])
    assert raw == {"model": {"moe": {"top_k": 1}}, "train": {"steps": 3}}


def test_cli_reports_config_errors(capsys):
    assert cli_main(["train", "--config", os.path.join(ROOT, "configs/test.yaml"), "model.moe.top_k=0"]) == 2
    err = capsys.readouterr().err
    assert "moe-dist train: error: model.moe.top_k" in err and "allowed: >= 1" in err
    assert cli_main(["train", "--config", os.path.join(ROOT, "configs/test.yaml"), "--print-config",
                     "train.steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 3 and printed["model"]["moe"]["num_experts"] == 4
    assert cli_main(["train", "--list-keys"]) == 0
    assert "model.moe.capacity_factor" in capsys.readouterr().out
    assert cli_main(["eval", "--run-dir", "/nonexistent/run"]) == 2
    assert "has no config.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [("train.lr=1e39", "train.lr"), ("model.init_std=1e39", "model.init_std"),
                                           ("model.rope_theta=-4e38", "model.rope_theta"),
                                           ("train.spike_factor=1e300", "train.spike_factor")])
def test_floats_that_overflow_bf16_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(ROOT, "configs/test.yaml"), [override])
    assert str(e.value).startswith(f"{key}: ") and "overflows float32/bfloat16" in str(e.value)
    assert load_config(os.path.join(ROOT, "configs/test.yaml"), ["train.lr=3e38"]).train.lr == 3e38  # fits
