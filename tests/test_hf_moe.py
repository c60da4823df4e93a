"""Hugging Face MoE checkpoints in and out: tiny random Mixtral, OLMoE and Qwen2-MoE models built by
transformers (no download) are imported with our logits equal to theirs, evaluated and trained
at 2 ranks with expert parallelism 2, exported back and reloaded by transformers with equal
logits; bad inputs are refused with a clear message; the OLMoE-1B-7B preset's counts."""
import json
import os

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.hf_cases import add_tokenizer_json, build_moe, hf_classes, rel_err

pytest.importorskip("transformers")

from moe_dist.cli import main as cli  # noqa: E402
from moe_dist.config import ConfigError, load_config, save_config  # noqa: E402
from moe_dist.hf import HFFormatError  # noqa: E402
from moe_dist.hf.export import export, load_our_model  # noqa: E402
from moe_dist.hf.importer import import_config, import_hf  # noqa: E402
from moe_dist.hf.moe_checkpoint import MoECheckpoint  # noqa: E402
from moe_dist.model import build_model, count_parameters  # noqa: E402
from moe_dist.moe import moe_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "data", "python-docs")
TOL = 1e-5
FAMILIES = ["mixtral", "olmoe", "qwen2_moe"]
# per family: build_moe options (Qwen2-MoE: a dense block in the middle via mlp_only_layers)
BUILD = {"mixtral": {}, "olmoe": {}, "qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1])}


def _tokens(vocab=96, shape=(3, 11), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _quiet(_):
    pass


@pytest.mark.parametrize("family", FAMILIES)
def test_import_gives_transformers_logits(family, tmp_path):
    src, out = str(tmp_path / family), str(tmp_path / "ours")
    hf = build_moe(family, src, max_shard_size="40KB", vocab_size=320, **BUILD[family])  # several shards + index
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    add_tokenizer_json(src, ["def f(x):\n    return x + 1\n" * 10], vocab_size=300)
    assert cli(["import", "--hf", src, "--out", out, "--max-shard-gib", "0.00003", "train.steps=7"]) == 0
    info = json.load(open(os.path.join(out, "import.json")))
    assert info["family"] == family and info["tokenizer_files"][0] == "tokenizer.json"
    assert len(info["weights"]) > 1  # our weights sharded too
    cfg = load_config(os.path.join(out, "config.yaml"))
    assert cfg.ckpt.init_from == os.path.abspath(out) and cfg.train.steps == 7
    assert cfg.data.tokenizer == os.path.join(os.path.abspath(out), "tokenizer.json")
    assert cfg.model.qk_norm == ("projection" if family == "olmoe" else "none")
    assert cfg.model.moe.router_options == {"normalize": family == "mixtral"}  # OLMoE, Qwen: norm_topk_prob false
    if family == "qwen2_moe":  # fine-grained experts, gated shared expert, q/k/v biases, block 1 dense
        m = cfg.model
        assert (m.moe.layers, m.moe.d_ff, m.d_ff, m.moe.shared_d_ff, m.moe.shared_gate, m.qkv_bias) == (
            [0, 2], 16, 24, 40, True, True)
        assert any("router_aux_loss_coef" in note for note in info["notes"])
    ours, _, _ = load_our_model(out)
    x = _tokens(vocab=320)
    with torch.no_grad():
        got, want = ours(x), hf(x).logits
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert count_parameters(ours)["total"] == sum(p.numel() for p in hf.parameters()) == info["total_params"]
    layer = moe_layers(ours)[0]
    assert layer.last_routing.expert_ids.unique().numel() == 4  # every expert is used: routing matters
    # the router alone: same experts and gates as transformers' (OLMoE: softmax probabilities, not renormalised)
    h = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    theirs = hf.model.layers[0].mlp.gate
    with torch.no_grad():
        _, their_gates, their_ids = theirs(h)
        routing = layer.router(h, layer.context)
    assert torch.equal(routing.expert_ids, their_ids)
    assert torch.allclose(routing.gates, their_gates.float(), rtol=1e-6, atol=1e-7)


def _train_and_eval(rank, world, root):
    from moe_dist.train.evaluation.saved import evaluate_run
    from moe_dist.train.loop.trainer import train

    common = ["run.plots=false", "run.tensorboard=false", "run.progress=false", "train.global_batch=4",
              "train.seq_len=32", "train.lr=0.003", "train.warmup_steps=1", f"data.corpus={CORPUS}",
              f"data.cache_dir={os.path.join(root, 'cache')}", "data.val_fraction=0.2", "eval.max_sequences=8",
              "eval.batch=4", "model.moe.expert_kernel=loop", "parallel.ep=2"]
    out = {}
    for family in FAMILIES:
        imported = os.path.join(root, f"ours_{family}")
        config = os.path.join(imported, "config.yaml")
        step0 = evaluate_run(load_config(config, common), imported, write_json=False)
        summary = train(load_config(config, common + ["train.steps=2", "ckpt.every=2",
                                                      f"run.dir={os.path.join(root, 'runs', family)}"]))
        out[family] = {"step0": step0["val_loss"], "summary": summary}
    return out


@pytest.mark.timeout(600)
def test_import_train_at_ep2_and_export_back(tmp_path):
    from moe_dist.train.evaluation.saved import evaluate_run

    root = str(tmp_path)
    texts = [open(os.path.join(CORPUS, "tutorial", "introduction.rst.txt"), encoding="utf-8").read()]
    for family in FAMILIES:
        src = os.path.join(root, family)
        os.makedirs(src)
        add_tokenizer_json(src, texts, vocab_size=300)
        build_moe(family, src, vocab_size=320, **BUILD[family])
        import_hf(src, os.path.join(root, f"ours_{family}"), log=_quiet)
    results = run_ranks(_train_and_eval, 2, args=(root,), timeout=600)
    for family in FAMILIES:
        r0, r1 = results[0][family], results[1][family]
        assert r0["summary"]["steps"] == 2 and r0["summary"]["train_loss"] == r1["summary"]["train_loss"]
        assert torch.isfinite(torch.tensor(r0["summary"]["train_loss"]))
        # the imported checkpoint evaluates alike on 1 process (all experts) and on 2 ranks at ep=2
        imported = os.path.join(root, f"ours_{family}")
        one = evaluate_run(load_config(os.path.join(imported, "config.yaml"),
                                       [f"data.corpus={CORPUS}", f"data.cache_dir={os.path.join(root, 'cache')}",
                                        "data.val_fraction=0.2", "train.seq_len=32", "eval.max_sequences=8",
                                        "eval.batch=4", "run.progress=false", "model.moe.expert_kernel=loop"]),
                           imported, write_json=False)
        assert abs(one["val_loss"] - r0["step0"]) <= 1e-5 * one["val_loss"], (family, one["val_loss"], r0["step0"])
        # the trained run (saved by 2 ranks at ep=2) exported back to its own format
        run, hf_out = os.path.join(root, "runs", family), os.path.join(root, f"back_{family}")
        assert cli(["export", "--checkpoint", run, "--format", family, "--out", hf_out]) == 0
        assert os.path.exists(os.path.join(hf_out, "tokenizer.json"))
        # the run started from the import (its ckpt.init_from): config.json keeps the source's values
        source, written = (json.load(open(os.path.join(d, "config.json"))) for d in (os.path.join(root, family), hf_out))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "router_aux_loss_coef"):
            assert written.get(key) == source.get(key), (family, key)
        assert json.load(open(os.path.join(hf_out, "export.json")))["source"] == imported
        ours, _, _ = load_our_model(run)
        hf = hf_classes(family)[1].from_pretrained(hf_out).eval()
        x = _tokens(vocab=320)
        with torch.no_grad():
            assert rel_err(hf(x).logits, ours(x)) <= TOL
        trained = moe_layers(ours)[0].experts.w1
        imported_model, _, _ = load_our_model(imported)
        assert not torch.equal(trained, moe_layers(imported_model)[0].experts.w1)  # the steps changed the experts


def _our_model_dir(tmp_path, overrides, perturb=False):
    """A seeded model of ours saved as a model directory (config.yaml + model.safetensors);
    ``perturb``: every tensor (biases included, zero at initialisation) gets noise."""
    from moe_dist.weights import save_model_weights

    cfg = load_config(None, ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=24",
                             "model.vocab_size=64", "model.n_layers=3", "model.moe.num_experts=4",
                             "model.moe.top_k=2", "model.tie_embeddings=false", "model.init_std=0.3", *overrides])
    model = build_model(cfg.model, cfg.model.vocab_size, seed=4)
    if perturb:
        with torch.no_grad():
            g = torch.Generator().manual_seed(5)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    d = str(tmp_path / "model")
    save_model_weights(model, d)
    save_config(cfg, os.path.join(d, "config.yaml"))
    return d, model.eval()


@pytest.mark.parametrize("normalize", [False, True])
def test_export_olmoe_with_dense_blocks(normalize, tmp_path):
    from transformers import OlmoeForCausalLM

    d, ours = _our_model_dir(tmp_path, ["model.qk_norm=projection", "model.moe.layers=every_other",
                                        f"model.moe.router_options={{normalize: {str(normalize).lower()}}}"])
    out = str(tmp_path / "olmoe")
    logs = []
    export(d, "olmoe", out, log=logs.append)
    assert json.load(open(os.path.join(out, "config.json")))["norm_topk_prob"] is normalize
    assert any("dense blocks [0, 2]" in line for line in logs)
    hf = OlmoeForCausalLM.from_pretrained(out).eval()
    x = _tokens(vocab=64)
    with torch.no_grad():
        assert rel_err(hf(x).logits, ours(x)) <= TOL


QWEN_OURS = ["model.moe.layers=every_other", "model.moe.d_ff=8", "model.moe.shared_d_ff=16", "model.qkv_bias=true"]


@pytest.mark.parametrize("gated", [True, False])
def test_export_qwen2_moe(gated, tmp_path):
    """Dense blocks, fine-grained experts, the shared expert (with our gate, or without: written with a
    zero gate and a doubled down projection), q/k/v biases; reloaded by transformers and imported back."""
    from transformers import Qwen2MoeForCausalLM

    d, ours = _our_model_dir(tmp_path, QWEN_OURS + [f"model.moe.shared_gate={str(gated).lower()}",
                                                    f"model.moe.router_options={{normalize: {str(gated).lower()}}}"],
                             perturb=True)
    out = str(tmp_path / "qwen")
    export(d, "qwen2_moe", out, log=_quiet)
    written = json.load(open(os.path.join(out, "config.json")))
    assert (written["mlp_only_layers"], written["norm_topk_prob"], written["moe_intermediate_size"],
            written["intermediate_size"], written["shared_expert_intermediate_size"]) == ([0, 2], gated, 8, 24, 16)
    hf = Qwen2MoeForCausalLM.from_pretrained(out).eval()
    x = _tokens(vocab=64)
    with torch.no_grad():
        want = ours(x)
        assert rel_err(hf(x).logits, want) <= TOL
    import_hf(out, str(tmp_path / "again"), log=_quiet)  # and back: the same function again
    again, cfg, _ = load_our_model(str(tmp_path / "again"))
    assert cfg.model.moe.layers == [1] and cfg.model.moe.shared_gate
    with torch.no_grad():
        assert rel_err(again(x), want) <= TOL


def test_qwen2_moe_refusals(tmp_path):
    d, _ = _our_model_dir(tmp_path, ["model.qkv_bias=true"])  # no shared expert
    with pytest.raises(HFFormatError, match=r"model.moe.shared_d_ff=null cannot be exported to Qwen2-MoE, whose MoE "
                                            r"blocks always have a shared expert; allowed: an integer >= 1"):
        export(d, "qwen2_moe", str(tmp_path / "q"), log=_quiet)
    d2, _ = _our_model_dir(tmp_path / "b", ["model.qk_norm=projection", "model.moe.shared_d_ff=16"])
    with pytest.raises(HFFormatError, match=r"model.moe.shared_d_ff cannot be exported to OLMoE \(no shared experts\)"):
        export(d2, "olmoe", str(tmp_path / "o"), log=_quiet)
    d3, _ = _our_model_dir(tmp_path / "c", ["model.moe.shared_d_ff=16", "model.qk_norm=projection"])
    with pytest.raises(HFFormatError, match=r"model.qk_norm='projection' cannot be exported to Qwen2-MoE"):
        export(d3, "qwen2_moe", str(tmp_path / "q"), log=_quiet)
    # import: a layer pattern that leaves no MoE block, a sparse step that is not a positive integer
    src = str(tmp_path / "src")
    build_moe("qwen2_moe", src)
    cfg_path = os.path.join(src, "config.json")
    original = json.load(open(cfg_path))
    json.dump({**original, "mlp_only_layers": [0, 1]}, open(cfg_path, "w"))
    with pytest.raises(HFFormatError, match=r"decoder_sparse_step=1 with mlp_only_layers=\[0, 1\] leaves no MoE block "
                                            r"among num_hidden_layers=2; allowed: at least one MoE block"):
        MoECheckpoint(src)
    json.dump({**original, "decoder_sparse_step": 0}, open(cfg_path, "w"))
    with pytest.raises(HFFormatError, match=r"decoder_sparse_step=0 is not supported; allowed: an integer >= 1"):
        MoECheckpoint(src)
    json.dump({**original, "decoder_sparse_step": 2}, open(cfg_path, "w"))  # block 1 MoE, block 0 dense: read as such
    assert MoECheckpoint(src).spec.model["moe"]["layers"] == [1]


def test_export_refuses_what_the_format_cannot_hold(tmp_path):
    d, _ = _our_model_dir(tmp_path, [])  # no q/k norm
    with pytest.raises(HFFormatError, match=r"model.qk_norm='none' cannot be exported to OLMoE, whose attention always "
                                            r"normalises the queries and keys; allowed: 'projection'"):
        export(d, "olmoe", str(tmp_path / "o"), log=_quiet)
    d2, _ = _our_model_dir(tmp_path / "b", ["model.qk_norm=projection"])
    with pytest.raises(HFFormatError, match=r"model.qk_norm='projection' cannot be exported to Mixtral"):
        export(d2, "mixtral", str(tmp_path / "m"), log=_quiet)
    d3, _ = _our_model_dir(tmp_path / "c", ["model.qk_norm=projection", "model.moe.router=xmoe",
                                             "parallel.dense=replicate"])
    with pytest.raises(HFFormatError, match=r"model.moe.router='xmoe' cannot be exported to OLMoE.*allowed routers"):
        export(d3, "olmoe", str(tmp_path / "o"), log=_quiet)
    assert cli(["export", "--checkpoint", d, "--format", "olmoe", "--out", str(tmp_path / "o")]) == 2
    d4, _ = _our_model_dir(tmp_path / "d", ["model.moe.router_options={normalize: false}"])
    # Mixtral always renormalises: refused with the reason and the way out
    with pytest.raises(HFFormatError, match=r"does not renormalise its gates.*allowed: normalize=true.*--format olmoe"):
        export(d4, "mixtral", str(tmp_path / "m"), log=_quiet)


def test_bad_inputs_are_refused_by_name(tmp_path, capsys):
    src = str(tmp_path / "olmoe")
    build_moe("olmoe", src, max_shard_size="40KB")
    cfg_path = os.path.join(src, "config.json")
    original = json.load(open(cfg_path))

    def with_config(**changes):
        json.dump({**original, **changes}, open(cfg_path, "w"))

    with_config(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
    with pytest.raises(HFFormatError, match=r"model_type='deepseek_v2' \(architectures=\['DeepseekV2ForCausalLM'\]\) is "
                                            r"not supported; allowed model_type: \[.*'mixtral', 'olmoe', 'qwen2_moe'\]"):
        MoECheckpoint(src)
    with_config(architectures=["OlmoeForSequenceClassification"])
    with pytest.raises(HFFormatError, match=r"architectures=\['OlmoeForSequenceClassification'\] is not supported; "
                                            r"`moe-dist import` reads model_type='olmoe' as 'OlmoeForCausalLM'"):
        MoECheckpoint(src)
    with_config(clip_qkv=8.0)
    with pytest.raises(HFFormatError, match=r"clip_qkv=8.0 is not supported \(clipping of the query, key and value "
                                            r"activations\); allowed: None"):
        MoECheckpoint(src)
    with_config(model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(HFFormatError, match=r"model_type='llama' cannot be read here; `moe-dist import` reads model_type "
                                            r"in \['mixtral', 'olmoe', 'qwen2_moe'\] \(a dense checkpoint is read by `moe-dist upcycle`\)"):
        MoECheckpoint(src)
    with_config(intermediate_size=32)  # the weights say 24
    with pytest.raises(HFFormatError, match=r"tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \[24, 32\] "
                                            r"but config.json \(.*intermediate_size=32.*\) implies \[32, 32\]"):
        import_hf(src, str(tmp_path / "o"), log=_quiet)
    capsys.readouterr()
    assert cli(["import", "--hf", src, "--out", str(tmp_path / "o")]) == 2  # the same error as one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-dist import: error: ") and "intermediate_size=32" in err[0]
    with_config()
    with pytest.raises(ConfigError, match=r"model.moe.num_experts: 8 differs from the checkpoint's 4 .*leave "
                                          r"model.moe.num_experts out or set it to 4"):
        import_config(MoECheckpoint(src).spec, ["model.moe.num_experts=8"])
    with pytest.raises(ConfigError, match=r"model.moe.router_options: \{'normalize': True\} differs from the checkpoint's"):
        import_config(MoECheckpoint(src).spec, ["model.moe.router_options={normalize: true}"])
    # a missing shard
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    os.remove(os.path.join(src, shards[-1]))
    with pytest.raises(HFFormatError, match=rf"shards named in model.safetensors.index.json are missing: \['{shards[-1]}'\]"):
        import_hf(src, str(tmp_path / "o"), log=_quiet)
    assert cli(["import", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2


def _name_twice(path, name):
    """Rewrite the safetensors file ``path`` so that its header names tensor ``name`` twice: first an
    entry of another shape, then the real one (the safetensors library keeps the last silently; a
    reader that keeps the first reads other values)."""
    raw = open(path, "rb").read()
    size = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + size].decode()
    decoy = json.dumps({name: {**json.loads(header)[name], "shape": [1]}})[1:-1]
    header = "{" + decoy + "," + header[1:]
    header += " " * (-len(header) % 8)
    open(path, "wb").write(len(header).to_bytes(8, "little") + header.encode() + raw[8 + size:])


def test_a_name_given_twice_in_a_header_or_index_is_refused(tmp_path, capsys):
    from safetensors import safe_open

    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    build_moe("mixtral", single)
    build_moe("mixtral", sharded, max_shard_size="40KB")
    weights = os.path.join(single, "model.safetensors")
    _name_twice(weights, "model.norm.weight")
    with safe_open(weights, framework="pt") as f:  # the library reads it: the duplicate must be caught by us
        assert f.get_slice("model.norm.weight").get_shape() == [32]
    index_path = os.path.join(sharded, "model.safetensors.index.json")
    index = json.load(open(index_path))
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    text = json.dumps(index)
    open(index_path, "w").write(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1))
    for src, words in ((single, f"{weights}: not a readable safetensors file (its header names tensor "
                                "'model.norm.weight' twice"),
                       (sharded, f"{index_path}: not a valid safetensors index (it names '{name}' twice in weight_map")):
        capsys.readouterr()
        out = str(tmp_path / f"out-{os.path.basename(src)}")
        assert cli(["import", "--hf", src, "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("moe-dist import: error: ") and words in err[0], err
        assert not os.path.exists(out)


def test_olmoe_preset_counts():
    from moe_dist.plan import plan

    preset = plan(os.path.join(ROOT, "configs", "olmoe-1b-7b.yaml"), 1, 8, 80)
    assert abs(preset["total_params"] / 6.92e9 - 1) <= 0.01 and abs(preset["active_params"] / 1.28e9 - 1) <= 0.01
    published = plan(os.path.join(ROOT, "configs", "hf", "olmoe-1b-7b.json"), 1, 8, 80)
    assert (published["total_params"], published["active_params"]) == (preset["total_params"], preset["active_params"])
    text = open(os.path.join(ROOT, "configs", "olmoe-1b-7b.yaml")).read()
    assert f"total {preset['total_params']:,}" in text and f"active per token {preset['active_params']:,}" in text
    assert f"ep: {preset['recommended']['ep']} " in text  # the preset uses the planner's layout
    script = open(os.path.join(ROOT, "launch", "slurm", "presets", "olmoe-1b-7b.sbatch")).read()
    assert "PRESET=olmoe-1b-7b" in script and "import --hf" in script
    # the preset's architecture is the published config's: import would accept it over that checkpoint
    from moe_dist.config.load import read_yaml
    from moe_dist.hf import hf_model_spec, read_hf_config

    spec = hf_model_spec(read_hf_config(os.path.join(ROOT, "configs", "hf", "olmoe-1b-7b.json")))
    assert import_config(spec, base=read_yaml(os.path.join(ROOT, "configs", "olmoe-1b-7b.yaml"))).model.qk_norm == "projection"


def test_qwen2_moe_plan_counts(tmp_path):
    """The planner reads a Qwen2-MoE config.json (Qwen1.5-MoE-A2.7B's sizes): 14.3B total, 2.7B active."""
    from moe_dist.plan import plan

    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "vocab_size": 151936, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu"}))
    counts = plan(str(path), 1, 8, 80)
    assert abs(counts["total_params"] / 14.3e9 - 1) <= 0.01 and abs(counts["active_params"] / 2.7e9 - 1) <= 0.01
