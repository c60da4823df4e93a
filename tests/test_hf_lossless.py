"""Imports and exports that lose nothing: a failed import / upcycle / export leaves its target
byte-identical, readers refuse an output whose completion record is missing, tensors the
config does not explain are refused, transformers' fused expert layout is read with its
logits, a model converted without its tokenizer is not evaluated or trained until one is named,
and an export keeps the source's token ids, context length and load-balancing coefficient."""
import hashlib
import json
import os

import pytest
import torch

from helpers.hf_cases import add_tokenizer_json, build_dense, build_moe, hf_classes, rel_err

pytest.importorskip("transformers")

from moe_dist.cli import main as cli  # noqa: E402
from moe_dist.errors import CheckpointError, HFFormatError  # noqa: E402
from moe_dist.hf.export import load_our_model  # noqa: E402
from moe_dist.hf.importer import import_hf  # noqa: E402
from moe_dist.moe import moe_layers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "tests", "data", "python-docs", "tutorial", "introduction.rst.txt")
TOL = 1e-5
FAMILIES = ["mixtral", "olmoe", "qwen2_moe"]
# a model's own token ids and context, and a load-balancing coefficient unlike our default
SOURCE_KEYS = dict(bos_token_id=5, eos_token_id=6, pad_token_id=7, max_position_embeddings=512,
                   router_aux_loss_coef=0.037)


def _quiet(_):
    pass


def _hashes(directory):
    """Every file under ``directory`` (relative path -> sha256)."""
    out = {}
    for base, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            out[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


def _source(tmp_path, name, family="olmoe", tokenizer=True, seed=0, **overrides):
    src = str(tmp_path / name)
    os.makedirs(src)
    if tokenizer:
        add_tokenizer_json(src, [open(TEXT, encoding="utf-8").read()[seed * 500:]], vocab_size=300)
    hf = build_moe(family, src, seed=seed, vocab_size=320, **overrides)
    return src, hf


def _add_ninth_expert(src, family="mixtral"):
    """Append one more expert to every MoE block of the saved checkpoint (the config still says 4)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    module, names = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                     "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}[family]
    for i in range(2):
        for n in names:
            tensors[f"model.layers.{i}.{module}.experts.4.{n}.weight"] = tensors[
                f"model.layers.{i}.{module}.experts.0.{n}.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def test_failed_import_leaves_a_complete_import_byte_identical(tmp_path, capsys, monkeypatch):
    good, _ = _source(tmp_path, "good")
    out = str(tmp_path / "out")
    assert cli(["import", "--hf", good, "--out", out]) == 0
    before = _hashes(out)
    assert "import.json" in before and "tokenizer.json" in before
    # another model (its own tokenizer) that fails half-way through writing: the disk fills up
    # after the tokenizer was copied and the first weight file written
    other, _ = _source(tmp_path, "other", seed=1)
    from moe_dist.weights import safetensors_io

    real_save, calls = safetensors_io.save_file, []

    def disk_full_on_second_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors_io, "save_file", disk_full_on_second_file)
    with pytest.raises(OSError, match="No space left"):
        import_hf(other, out, max_shard_bytes=20_000, log=_quiet)
    monkeypatch.undo()
    assert len(calls) == 2
    assert _hashes(out) == before
    assert "was left as it was (the partial output was removed)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["good", "other", "out"]  # no partial directory left beside it
    # a user error half-way (a ninth expert): one line that says the target is untouched, exit 2
    ninth, _ = _source(tmp_path, "ninth", family="mixtral", seed=2)
    _add_ninth_expert(ninth)
    capsys.readouterr()
    assert cli(["import", "--hf", ninth, "--out", out]) == 2
    _one_error_line(capsys, "moe-dist import: error: ", f"{out} was left as it was")
    assert _hashes(out) == before
    # into a directory that is not an import: refused before anything is written
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert cli(["import", "--hf", good, "--out", str(foreign)]) == 2
    _one_error_line(capsys, "exists and is not empty, and is not a `moe-dist import` output (no import.json)")
    assert os.listdir(foreign) == ["notes.txt"]
    # a complete import is replaced by a new one, whole
    assert cli(["import", "--hf", other, "--out", out]) == 0
    after = _hashes(out)
    assert after["tokenizer.json"] != before["tokenizer.json"] and after["model.safetensors"] != before["model.safetensors"]
    assert json.load(open(os.path.join(out, "import.json")))["source"] == os.path.abspath(other)


KILLED_IMPORT = """
import os, signal, sys
from moe_dist.weights import output_dir, safetensors_io
from moe_dist.hf.importer import import_hf

when, calls = sys.argv[3], []
real = safetensors_io.save_file if when == "writing" else os.rename


def killed(*args, **kwargs):  # the process dies here, as with kill -9: nothing of ours runs after
    calls.append(args)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)


if when == "writing":  # while the second weights file is written
    safetensors_io.save_file = killed
else:  # after the complete target was moved aside, before the new one is moved in
    output_dir.os.rename = killed
import_hf(sys.argv[1], sys.argv[2], max_shard_bytes=20_000, log=lambda _: None)
"""


@pytest.mark.parametrize("when", ["writing", "moving"])
def test_killed_import_leaves_the_target_and_the_next_one_tidies(when, tmp_path, capsys):
    import signal
    import subprocess
    import sys

    good, _ = _source(tmp_path, "good")
    other, _ = _source(tmp_path, "other", seed=1)
    out = str(tmp_path / "out")
    import_hf(good, out, log=_quiet)
    before = _hashes(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", KILLED_IMPORT, other, out, when], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith("out."))
    assert [n.split("-")[0] for n in left] == (["out.partial"] if when == "writing" else ["out.partial", "out.replaced"])
    if when == "writing":
        assert _hashes(out) == before
        from moe_dist.weights import SafetensorsCheckpoint

        with pytest.raises(CheckpointError, match=r"incomplete `moe-dist import` output"):  # the partial directory
            SafetensorsCheckpoint(str(tmp_path / left[0]))  # what every reader of weights opens
    else:
        assert not os.path.exists(out)  # killed between the two renames
    # the next import into the same target (here one that fails): the dead writer's leftovers go, the target is back
    ninth, _ = _source(tmp_path, "ninth", family="mixtral", seed=2)
    _add_ninth_expert(ninth)
    capsys.readouterr()
    with pytest.raises(HFFormatError, match="does not explain"):
        import_hf(ninth, out, log=_quiet)
    assert _hashes(out) == before
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out.")]
    assert "left by a write that did not finish" in capsys.readouterr().out


def test_readers_refuse_an_output_without_its_record(tmp_path, capsys):
    src, _ = _source(tmp_path, "src")
    out = str(tmp_path / "out")
    import_hf(src, out, log=_quiet)
    os.remove(os.path.join(out, "import.json"))  # what an interrupted import of an earlier version left
    capsys.readouterr()
    assert cli(["eval", "--checkpoint", out, f"data.corpus={os.path.dirname(TEXT)}"]) == 2
    _one_error_line(capsys, "incomplete `moe-dist import` output (import.json, written last, is missing)")
    assert cli(["export", "--checkpoint", out, "--format", "olmoe", "--out", str(tmp_path / "e")]) == 2
    _one_error_line(capsys, "incomplete `moe-dist import` output")
    assert cli(["train", "--config", os.path.join(out, "config.yaml"), f"run.dir={tmp_path / 'run'}",
                f"data.corpus={os.path.dirname(TEXT)}"]) == 2  # ckpt.init_from is that directory
    _one_error_line(capsys, "incomplete `moe-dist import` output")
    # running the import again replaces the incomplete output; an export is read back by import only when complete
    import_hf(src, out, log=_quiet)
    assert os.path.exists(os.path.join(out, "import.json"))
    back = str(tmp_path / "back")
    assert cli(["export", "--checkpoint", out, "--format", "olmoe", "--out", back]) == 0
    assert json.load(open(os.path.join(back, "export.json")))["format"] == "olmoe"
    os.remove(os.path.join(back, "export.json"))
    with pytest.raises(CheckpointError, match=r"incomplete `moe-dist export` output \(export.json"):
        import_hf(back, str(tmp_path / "again"), log=_quiet)


def test_failed_upcycle_and_export_leave_their_targets(tmp_path, capsys):
    dense, up = str(tmp_path / "dense"), str(tmp_path / "up")
    build_dense("llama", dense)
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2"]
    assert cli(["upcycle", "--dense", dense, "--out", up, *moe]) == 0
    before = _hashes(up)
    # the dense checkpoint gains a tensor its config does not explain: refused, the upcycle kept
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(dense, "model.safetensors"))
    weights["model.layers.3.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].clone()
    save_file(weights, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert cli(["upcycle", "--dense", dense, "--out", up, *moe]) == 2
    _one_error_line(capsys, "1 tensor(s) that config.json", "['model.layers.3.mlp.up_proj.weight']",
                    f"{up} was left as it was")
    assert _hashes(up) == before
    hf_out = str(tmp_path / "mixtral")
    assert cli(["export", "--checkpoint", up, "--format", "mixtral", "--out", hf_out]) == 0
    exported = _hashes(hf_out)
    dense_cfg, written = (json.load(open(os.path.join(d, "config.json"))) for d in (dense, hf_out))
    for key in ("bos_token_id", "eos_token_id", "max_position_embeddings"):  # kept from the dense source
        assert key in dense_cfg and written[key] == dense_cfg[key], key
    capsys.readouterr()
    assert cli(["export", "--checkpoint", up, "--format", "olmoe", "--out", hf_out]) == 2  # OLMoE needs q/k norms
    _one_error_line(capsys, "model.qk_norm='none' cannot be exported to OLMoE", f"{hf_out} was left as it was")
    assert _hashes(hf_out) == exported


def test_unexplained_tensors_are_refused(tmp_path, capsys):
    src, _ = _source(tmp_path, "mixtral", family="mixtral")
    _add_ninth_expert(src)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert cli(["import", "--hf", src, "--out", out]) == 2
    line = _one_error_line(capsys, "6 tensor(s) that config.json", "num_local_experts=4) does not explain",
                           f"{out} was not created")
    assert "'model.layers.0.block_sparse_moe.experts.4.w1.weight'" in line
    assert not os.path.exists(out) and sorted(os.listdir(tmp_path)) == ["mixtral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_expert_layout_gives_transformers_logits(family, tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2 ff, d], down_proj [E, d, ff], Mixtral's
    router under mlp), as save_pretrained(save_original_format=False) writes it."""
    from helpers.hf_cases import MOE_EXTRAS, MOE_TINY

    config_cls, model_cls = hf_classes(family)
    extra = dict(num_hidden_layers=3, mlp_only_layers=[1]) if family == "qwen2_moe" else {}
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**MOE_TINY, **MOE_EXTRAS[family], **extra})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith("gate.weight") else 0.05))
    src, out = str(tmp_path / "fused"), str(tmp_path / "ours")
    hf.save_pretrained(src, save_original_format=False)
    from safetensors import safe_open

    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    info = import_hf(src, out, log=_quiet)
    assert info["expert_layout"] == "fused"
    ours, _, _ = load_our_model(out)
    x = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(x), hf(x).logits) <= TOL
    assert moe_layers(ours)[0].last_routing.expert_ids.unique().numel() == 4  # routing decides the output


def test_fused_layout_of_another_shape_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    config_cls, model_cls = hf_classes("mixtral")
    from helpers.hf_cases import MOE_EXTRAS, MOE_TINY

    src = str(tmp_path / "fused")
    model_cls(config_cls(**{**MOE_TINY, **MOE_EXTRAS["mixtral"]})).save_pretrained(src, save_original_format=False)
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    for i in range(2):  # [E, hidden, 2 x intermediate]: the transposed fused layout some tools write
        name = f"model.layers.{i}.mlp.experts.gate_up_proj"
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape \[4, 32, 48\] "
                                            r"but config.json .* implies \[4, 48, 32\] \(transformers' fused layout"):
        import_hf(src, str(tmp_path / "out"), log=_quiet)


def test_no_tokenizer_no_eval_until_one_is_named(tmp_path, capsys):
    src, _ = _source(tmp_path, "bare", tokenizer=False)
    out = str(tmp_path / "out")
    assert cli(["import", "--hf", src, "--out", out]) == 0
    assert "`moe-dist eval` and `train` refuse this model until data.tokenizer names" in capsys.readouterr().out
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("introduction.rst.txt", "controlflow.rst.txt"):
        (corpus / name).write_text(open(os.path.join(os.path.dirname(TEXT), name), encoding="utf-8").read())
    data = [f"data.corpus={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2",
            "train.seq_len=32", "eval.max_sequences=4", "eval.batch=4", "run.progress=false",
            "model.moe.expert_kernel=loop"]
    assert cli(["eval", "--checkpoint", out, *data, "data.vocab_size=300"]) == 2
    _one_error_line(capsys, f"{out} was converted by `moe-dist import` from {src} without its tokenizer",
                    "data.tokenizer=PATH")
    assert not os.path.exists(tmp_path / "cache")  # refused before any tokenizer was trained
    assert cli(["train", "--config", os.path.join(out, "config.yaml"), *data, f"run.dir={tmp_path / 'run'}"]) == 2
    _one_error_line(capsys, "without its tokenizer")
    # the model's tokenizer named: evaluated
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = add_tokenizer_json(str(tok_dir), [open(TEXT, encoding="utf-8").read()], vocab_size=300)
    result = tmp_path / "eval.json"
    assert cli(["eval", "--checkpoint", out, *data, f"data.tokenizer={tok}", "--json", str(result)]) == 0
    assert json.load(open(result))["val_tokens"] > 0
    # named at import time: recorded in config.yaml, evaluation needs nothing more
    named = str(tmp_path / "named")
    assert cli(["import", "--hf", src, "--out", named, f"data.tokenizer={tok}"]) == 0
    assert json.load(open(os.path.join(named, "import.json")))["tokenizer"] == tok
    assert cli(["eval", "--checkpoint", named, *data]) == 0


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_export_keeps_the_source_values(family, tmp_path):
    src, hf = _source(tmp_path, family, family=family, **SOURCE_KEYS)
    out, back = str(tmp_path / "ours"), str(tmp_path / "back")
    info = import_hf(src, out, log=_quiet)
    assert info["source_config"] == SOURCE_KEYS
    assert info["changed"] == [{"key": "router_aux_loss_coef", "source": 0.037, "ours": 0.01,
                                "why": info["changed"][0]["why"]}]
    assert "`moe-dist export` writes the source's value back" in info["changed"][0]["why"]
    assert cli(["export", "--checkpoint", out, "--format", family, "--out", back]) == 0
    written = json.load(open(os.path.join(back, "config.json")))
    assert {k: written[k] for k in SOURCE_KEYS} == SOURCE_KEYS
    notes = json.load(open(os.path.join(back, "export.json")))
    assert notes["kept_from_source"] == SOURCE_KEYS and notes["source"] == os.path.abspath(out)
    assert any("router_aux_loss_coef=0.037 is the source's" in n for n in notes["notes"])
    reloaded = hf_classes(family)[1].from_pretrained(back).eval()
    assert (reloaded.config.bos_token_id, reloaded.config.eos_token_id, reloaded.config.pad_token_id) == (5, 6, 7)
    x = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(reloaded(x).logits, hf(x).logits) <= TOL
