"""Hugging Face interop: dense checkpoints read and upcycled with the dense function kept,
export to Mixtral format loaded back by transformers, and clear errors on bad input."""
import json
import math
import os

import pytest
import torch

from helpers.hf_cases import add_sentencepiece, build_dense, hf_classes, rel_err

pytest.importorskip("transformers")

from moe_dist.cli import main as cli  # noqa: E402
from moe_dist.config import ConfigError, load_config  # noqa: E402
from moe_dist.hf import DenseCheckpoint, HFFormatError  # noqa: E402
from moe_dist.hf.export import export, load_our_model  # noqa: E402
from moe_dist.model import count_parameters  # noqa: E402
from moe_dist.upcycle import load_model_weights, upcycle, upcycle_config, upcycle_model  # noqa: E402
from moe_dist.moe import moe_layers

TOL = 1e-5
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]
ROUTER_SETUPS = {  # router setups whose gates are renormalised over the top-k
    "topk": ["model.moe.router=topk"],
    "xmoe": ["model.moe.router=xmoe"],
    "symphony": ["model.moe.router=symphony", "model.moe.router_options={init: identity, normalize: true}"],
}


def _tokens(vocab=96, shape=(2, 13), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mistral"])
def test_upcycled_logits_equal_dense_transformers_logits(family, tmp_path):
    dense_dir = str(tmp_path / family)
    hf = build_dense(family, dense_dir)
    x = _tokens()
    with torch.no_grad():
        want = hf(x).logits
    ckpt = DenseCheckpoint(dense_dir)
    assert ckpt.family == family
    for (router, setup), layers in zip(ROUTER_SETUPS.items(), ["every", "every_other", "[0, 2]"]):
        cfg = upcycle_config(ckpt.spec, MOE + setup + [f"model.moe.layers={layers}"])
        model = upcycle_model(ckpt, cfg).eval()
        assert len(moe_layers(model)) == {"every": 3, "every_other": 1, "[0, 2]": 2}[layers]
        with torch.no_grad():
            got = model(x)
        assert rel_err(got, want) < TOL, (family, router, rel_err(got, want))


def test_upcycle_command_writes_a_loadable_model(tmp_path):
    dense_dir, out = str(tmp_path / "llama"), str(tmp_path / "up")
    hf = build_dense("llama", dense_dir)
    texts = ["def f(x):\n    return x + 1\n" * 20, "The quick brown fox jumps over the lazy dog.\n" * 20]
    add_sentencepiece(dense_dir, texts, vocab_size=90)
    assert cli(["upcycle", "--dense", dense_dir, "--out", out, *MOE, "model.moe.layers=every_other",
                "model.moe.router=noisy_topk", "train.steps=3"]) == 0
    for name in ("config.yaml", "model.safetensors", "tokenizer.model", "upcycle.json"):
        assert os.path.exists(os.path.join(out, name)), name
    cfg = load_config(os.path.join(out, "config.yaml"))
    assert cfg.ckpt.init_from == os.path.abspath(out) and cfg.data.tokenizer == os.path.join(os.path.abspath(out), "tokenizer.model")
    assert cfg.train.steps == 3 and cfg.model.moe.router == "noisy_topk" and cfg.model.moe.layer_indices(3) == [1]
    model, cfg2, _ = load_our_model(out)
    with torch.no_grad():
        assert rel_err(model(_tokens()), hf(_tokens()).logits) < TOL  # noisy top-k has no noise in eval
    info = json.load(open(os.path.join(out, "upcycle.json")))
    counts = count_parameters(model)
    assert (info["total_params"], info["active_params"]) == (counts["total"], counts["active"])
    assert info["preserves_function"] is True and info["tokenizer_entries"] <= 96


def test_a_converted_directory_moved_elsewhere_still_trains(tmp_path):
    """The config an upcycle writes names its weights and tokenizer relative to its own directory
    (``${config_dir}``), so the directory copied, moved or mounted at another path (a container) trains
    as it is; a run directory's config.yaml does the same for run.dir. No absolute path of the old place
    is left in either."""
    import shutil

    dense_dir, out, moved = str(tmp_path / "llama"), str(tmp_path / "up"), str(tmp_path / "mnt" / "model")
    build_dense("llama", dense_dir)
    add_sentencepiece(dense_dir, ["def f(x):\n    return x + 1\n" * 20, "The quick brown fox.\n" * 20], vocab_size=90)
    assert cli(["upcycle", "--dense", dense_dir, "--out", out, *MOE]) == 0
    text = open(os.path.join(out, "config.yaml")).read()
    assert "init_from: ${config_dir}\n" in text and "tokenizer: ${config_dir}/tokenizer.model\n" in text, text
    assert os.path.abspath(out) not in text
    shutil.move(out, moved)
    cfg = load_config(os.path.join(moved, "config.yaml"))
    assert cfg.ckpt.init_from == moved and cfg.data.tokenizer == os.path.join(moved, "tokenizer.model")
    run = str(tmp_path / "run")
    corpus = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "python-docs")
    assert cli(["train", "--config", os.path.join(moved, "config.yaml"), f"run.dir={run}", "train.steps=1",
                "train.global_batch=2", "train.seq_len=16", "eval.every=0", "eval.max_sequences=2", "eval.batch=2",
                "ckpt.every=0", "run.plots=false", "run.tensorboard=false", "run.progress=false",
                f"data.corpus={corpus}", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    written = open(os.path.join(run, "config.yaml")).read()
    assert "dir: ${config_dir}\n" in written and run not in written, written
    assert "init_from: " + moved in written  # outside the run directory: kept absolute
    assert load_config(os.path.join(run, "config.yaml")).run.dir == run


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    dense_dir = str(tmp_path / "phi3")
    hf = build_dense("phi3", dense_dir, max_shard_size="20KB")
    index = json.load(open(os.path.join(dense_dir, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    out = str(tmp_path / "up")
    upcycle(dense_dir, out, MOE + ["model.moe.layers=every"], max_shard_bytes=30_000, log=lambda _: None)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # our weights sharded too
    model, _, _ = load_our_model(out)
    with torch.no_grad():
        assert rel_err(model(_tokens()), hf(_tokens()).logits) < TOL
    os.remove(os.path.join(dense_dir, shards[1]))
    with pytest.raises(HFFormatError, match=rf"shards named in model.safetensors.index.json are missing: \['{shards[1]}'\]"):
        DenseCheckpoint(dense_dir)


def test_expert_parallel_slice_loads_its_rows(tmp_path):
    dense_dir, out = str(tmp_path / "llama"), str(tmp_path / "up")
    build_dense("llama", dense_dir)
    upcycle(dense_dir, out, MOE + ["model.moe.layers=every"], noise_std=0.1, log=lambda _: None)
    full, cfg, _ = load_our_model(out)
    from moe_dist.model import build_model
    from moe_dist.parallel.expert_parallel import _slice_experts

    part = build_model(cfg.model, cfg.model.vocab_size, seed=5)
    for layer in moe_layers(part):
        _slice_experts(layer.experts, 2, 2)  # what rank 1 of ep=2 keeps
    load_model_weights(part, out)
    for a, b in zip(moe_layers(full), moe_layers(part)):
        assert torch.equal(a.experts.w1[2:4], b.experts.w1) and torch.equal(a.experts.w2[2:4], b.experts.w2)
        assert not torch.equal(a.experts.w1[0], a.experts.w1[1])  # noise makes the copies differ


@pytest.mark.parametrize("family,tied", [("llama", True), ("phi3", False)])
def test_export_to_mixtral_round_trip(family, tied, tmp_path):
    from transformers import MixtralForCausalLM

    dense_dir, up, out = str(tmp_path / "dense"), str(tmp_path / "up"), str(tmp_path / "mixtral")
    build_dense(family, dense_dir, tie_word_embeddings=tied)
    # noise makes the experts differ, so the routing decides the output
    upcycle(dense_dir, up, MOE + ["model.moe.layers=every_other", "model.moe.router_options={init_std: 0.5}"],
            noise_std=0.05, dtype="fp32", log=lambda _: None)
    ours, cfg, _ = load_our_model(up)
    assert cli(["export", "--checkpoint", up, "--format", "mixtral", "--out", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "mixtral" and config["tie_word_embeddings"] is tied
    hf = MixtralForCausalLM.from_pretrained(out).eval()
    assert sum(p.numel() for p in hf.parameters()) > count_parameters(ours)["total"]  # dense blocks as E copies
    x = _tokens()
    with torch.no_grad():
        got, want = hf(x).logits, ours(x)
    assert rel_err(got, want) < TOL
    with torch.no_grad():  # the experts are really used differently per token: not a dense model in disguise
        layer = moe_layers(ours)[0]
        ours(x)
        assert layer.last_routing.expert_ids[:, 0].unique().numel() > 1


def test_bad_inputs_give_clear_errors(tmp_path):
    d = str(tmp_path / "llama")
    build_dense("llama", d)
    cfg_path = os.path.join(d, "config.json")
    original = json.load(open(cfg_path))

    def with_config(**changes):
        json.dump({**original, **changes}, open(cfg_path, "w"))

    with_config(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFFormatError, match=r"model_type='gpt2'.*not supported; allowed model_type: \['llama', 'mistral', 'qwen2', 'phi3', 'mixtral', 'olmoe', 'qwen2_moe'\]"):
        DenseCheckpoint(d)
    with_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0})
    with pytest.raises(HFFormatError, match=r"rope_parameters.rope_type='yarn' is not supported; allowed: \['default', 'linear', 'llama3', 'longrope'\]"):
        DenseCheckpoint(d)
    with_config(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0})
    with pytest.raises(HFFormatError, match=r"rope_parameters of type 'llama3' lacks \['low_freq_factor'"):
        DenseCheckpoint(d)
    with_config(intermediate_size=64)  # the weights say 48
    with pytest.raises(HFFormatError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[48, 32\] but config.json \(.*intermediate_size=64.*\) implies \[64, 32\]"):
        DenseCheckpoint(d).ffn(0)
    assert cli(["upcycle", "--dense", d, "--out", str(tmp_path / "o")]) == 2  # the same error, as a one-line exit 2
    with_config()
    with pytest.raises(ConfigError, match=r"model.d_model: 64 differs from the checkpoint's hidden_size = 32"):
        upcycle_config(DenseCheckpoint(d).spec, ["model.d_model=64"])
    with pytest.raises(ConfigError, match=r"model.moe.d_ff: 16 differs from the dense FFN's intermediate_size=48"):
        upcycle_config(DenseCheckpoint(d).spec, ["model.moe.d_ff=16"])
    # a missing tensor
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(d, "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, os.path.join(d, "model.safetensors"))
    with pytest.raises(HFFormatError, match=r"tensor 'model.layers.1.self_attn.k_proj.weight' is missing"):
        DenseCheckpoint(d).attention(1)
    # pickled weights only
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save(weights, os.path.join(d, "pytorch_model.bin"))
    with pytest.raises(HFFormatError, match=r"only pickled weights .*pytorch_model.bin.* not loaded"):
        DenseCheckpoint(d)
    with pytest.raises(HFFormatError, match="no config.json"):
        DenseCheckpoint(str(tmp_path))


def test_export_refuses_what_mixtral_cannot_express(tmp_path):
    q, up = str(tmp_path / "qwen2"), str(tmp_path / "up")
    build_dense("qwen2", q)
    upcycle(q, up, MOE, log=lambda _: None)
    with pytest.raises(HFFormatError, match=r"model.qkv_bias=true cannot be exported to Mixtral"):
        export(up, "mixtral", str(tmp_path / "m"), log=lambda _: None)
    ll, up2 = str(tmp_path / "llama"), str(tmp_path / "up2")
    build_dense("llama", ll)
    upcycle(ll, up2, MOE + ["model.moe.router=xmoe"], log=lambda _: None)
    with pytest.raises(HFFormatError, match=r"model.moe.router='xmoe' cannot be exported to Mixtral.*allowed routers: \[.*'noisy_topk', 'topk'\]"):
        export(up2, "mixtral", str(tmp_path / "m"), log=lambda _: None)
    up3 = str(tmp_path / "up3")
    upcycle(ll, up3, MOE + ["model.moe.router_groups=2", "model.moe.max_groups_per_token=1"], log=lambda _: None)
    with pytest.raises(HFFormatError, match=r"model.moe.max_groups_per_token=1 cannot be exported to Mixtral.*allowed: null"):
        export(up3, "mixtral", str(tmp_path / "m"), log=lambda _: None)
    assert cli(["export", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m")]) == 2


def test_upcycle_warns_when_the_function_is_not_preserved(tmp_path):
    d = str(tmp_path / "llama")
    build_dense("llama", d)
    logs = []
    info = upcycle(d, str(tmp_path / "up"), MOE + ["model.moe.router=symphony"], log=logs.append)  # zero graph init
    assert info["preserves_function"] is False
    assert any("does not give back the dense FFN" in line and "init=identity" in line for line in logs)


def test_tokenizer_json_checkpoint_trains_with_its_own_ids(tmp_path):
    from helpers.hf_cases import add_tokenizer_json
    from tokenizers import Tokenizer as HFTokenizer

    from moe_dist.data import Tokenizer

    d, up = str(tmp_path / "qwen2"), str(tmp_path / "up")
    build_dense("qwen2", d, vocab_size=320)
    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog.\n"] * 10
    path = add_tokenizer_json(d, texts, vocab_size=300)
    upcycle(d, up, MOE, log=lambda _: None)
    cfg = load_config(os.path.join(up, "config.yaml"))
    assert cfg.data.tokenizer == os.path.join(os.path.abspath(up), "tokenizer.json")
    ours, theirs = Tokenizer.load(cfg.data.tokenizer), HFTokenizer.from_file(path)
    text = "def g(y):\n    return y * 2  # the fox\n"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id == theirs.token_to_id("<|endoftext|>") and ours.vocab_size == theirs.get_vocab_size()
    Tokenizer(ours.proto)  # the data cache stores these bytes and reads them back


def test_llama3_rope_scaling_preserved_and_exported(tmp_path):
    from transformers import MixtralForCausalLM

    # head_dim 8 has wavelengths ~6, ~170, ~4400, ~1e5: kept, on the ramp, divided, divided
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    d, up, out = str(tmp_path / "llama3"), str(tmp_path / "up"), str(tmp_path / "mixtral")
    hf = build_dense("llama", d, rope_parameters=rope, max_position_embeddings=4096)
    ckpt = DenseCheckpoint(d)
    assert ckpt.spec.model["rope_scaling"] == {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    x = _tokens(shape=(1, 300))  # long enough for the low frequencies to matter
    with torch.no_grad():
        want = hf(x).logits
        plain = upcycle_model(ckpt, upcycle_config(ckpt.spec, MOE + ["model.moe.layers=every"])).eval()
        assert rel_err(plain(x), want) < TOL
    upcycle(d, up, MOE + ["model.moe.layers=every_other"], noise_std=0.05, dtype="fp32", log=lambda _: None)
    export(up, "mixtral", out, log=lambda _: None)
    ours, cfg, _ = load_our_model(up)
    mixtral = MixtralForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_err(mixtral(x).logits, ours(x)) < TOL
        cfg.model.rope_scaling = None  # the scaling really changes the function
        assert rel_err(upcycle_model(ckpt, cfg).eval()(x), want) > 1e-3


def test_phi3_longrope_preserved_and_exported(tmp_path):
    from transformers import MixtralForCausalLM

    # Phi-3-128k / Phi-3.5 style: per-frequency divisors, short set up to the original context, long set beyond it
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 2.1, 3.0],
            "long_factor": [1.1, 2.5, 6.0, 11.0], "original_max_position_embeddings": 64}
    d, up, out = str(tmp_path / "phi3"), str(tmp_path / "up"), str(tmp_path / "mixtral")
    hf = build_dense("phi3", d, rope_parameters=rope, max_position_embeddings=256, original_max_position_embeddings=64)
    ckpt = DenseCheckpoint(d)
    scaling = ckpt.spec.model["rope_scaling"]
    assert scaling["type"] == "longrope" and abs(scaling["attention_factor"] - (1 + math.log(4) / math.log(64)) ** 0.5) < 1e-12
    model = upcycle_model(ckpt, upcycle_config(ckpt.spec, MOE + ["model.moe.layers=every"])).eval()
    upcycle(d, up, MOE + ["model.moe.layers=every_other"], noise_std=0.05, dtype="fp32", log=lambda _: None)
    export(up, "mixtral", out, log=lambda _: None)
    ours, _, _ = load_our_model(up)
    mixtral = MixtralForCausalLM.from_pretrained(out).eval()
    for length in (40, 100):  # within the original context, and beyond it
        x = _tokens(shape=(1, length))
        with torch.no_grad():
            assert rel_err(model(x), hf(x).logits) < TOL, length
            assert rel_err(mixtral(x).logits, ours(x)) < TOL, length
