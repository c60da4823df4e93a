"""The cluster planner: parameter counts against published figures, against instantiated
models (ours and transformers'), memory and traffic that move the right way, the layout it
recommends, and the command line."""
import json
import os

import pytest
import torch

from moe_dist.cli import main as cli
from moe_dist.config import ConfigError, load_config
from moe_dist.model import build_model, count_parameters
from moe_dist.plan import count_params, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "configs", "hf")


def _b(n: int) -> float:
    return round(n / 1e9, 1)


def test_published_counts():
    mixtral = plan(os.path.join(HF, "mixtral-8x7b.json"), 1, 8, 80)
    assert (_b(mixtral["total_params"]), _b(mixtral["active_params"])) == (46.7, 12.9)
    phi3 = plan(os.path.join(HF, "phi-3-mini-4k.json"), 1, 8, 80)
    assert _b(phi3["total_params"]) == 3.8 and phi3["total_params"] == phi3["active_params"]
    assert phi3["model"]["moe_layers"] == []  # a dense config stays dense
    assert _b(plan(os.path.join(HF, "qwen2.5-1.5b.json"), 1, 8, 80)["total_params"]) == 1.5
    assert _b(plan(os.path.join(HF, "tinyllama-1.1b.json"), 1, 8, 80)["total_params"]) == 1.1


def test_presets_state_the_planner_counts():
    # Phi-3-mini with 4 experts in every other block: the paper's 7.4B model
    phi3 = plan(os.path.join(ROOT, "configs", "phi3-mini-upcycle-4x2.yaml"), 1, 8, 80)
    assert _b(phi3["total_params"]) == 7.4
    tiny = plan(os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml"), 1, 8, 80)
    assert 3.5e9 < tiny["total_params"] < 4.5e9
    # the upcycle plan of a dense Hugging Face config equals the preset's
    from_hf = plan(os.path.join(HF, "phi-3-mini-4k.json"), 1, 8, 80,
                   ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.layers=every_other"])
    assert from_hf["total_params"] == phi3["total_params"] and from_hf["active_params"] == phi3["active_params"]
    for preset, result in (("phi3-mini-upcycle-4x2", phi3), ("tinyllama-upcycle-8x2", tiny)):
        text = open(os.path.join(ROOT, "configs", f"{preset}.yaml")).read()
        assert f"total {result['total_params']:,}" in text and f"active per token {result['active_params']:,}" in text
        assert f"ep: {result['recommended']['ep']} " in text  # the preset uses the planner's layout
        script = os.path.join(ROOT, "launch", "slurm", "presets", f"{preset}.sbatch")
        assert f"PRESET={preset}" in open(script).read()


@pytest.mark.parametrize("overrides", [
    [],
    ["model.tie_embeddings=false", "model.moe.layers=every_other", "model.qkv_bias=true"],
    ["model.moe.layers=[0, 2]", "model.moe.d_ff=40", "model.moe.activation=gelu", "model.moe.router=xmoe", "model.n_layers=3"],
    ["model.moe.router=hyper", "model.moe.num_experts=6", "model.moe.top_k=1"],
    ["model.moe.router=symphony"],
])
def test_counts_equal_an_instantiated_model(overrides):
    cfg = load_config(None, ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
                             "model.vocab_size=100"] + overrides)
    counts = count_params(cfg.model)
    built = count_parameters(build_model(cfg.model, 100))
    assert (counts["total"], counts["active"]) == (built["total"], built["active"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mixtral"])
def test_counts_equal_transformers_models(family, tmp_path):
    pytest.importorskip("transformers")
    from hf_cases import TINY, FAMILY_EXTRAS, hf_classes

    config_cls, model_cls = hf_classes(family)
    extras = FAMILY_EXTRAS.get(family, {"num_local_experts": 4, "num_experts_per_tok": 2})
    hf_cfg = config_cls(**{**TINY, **extras})
    hf_cfg.save_pretrained(str(tmp_path))
    model = model_cls(hf_cfg)
    want = sum(p.numel() for p in model.parameters())  # tied weights once
    got = plan(str(tmp_path / "config.json"), 1, 1, 16)
    assert got["total_params"] == want


def test_memory_and_traffic_move_the_right_way():
    p = plan(os.path.join(HF, "mixtral-8x7b.json"), 4, 8, 80)
    layouts = {l["ep"]: l for l in p["layouts"]}
    assert sorted(layouts) == [1, 2, 4, 8]
    mem = [layouts[ep]["memory_gib"] for ep in (1, 2, 4, 8)]
    assert all(a["weights"] > b["weights"] for a, b in zip(mem, mem[1:]))  # more ep, fewer experts per GPU
    assert all(m["activations_checkpointed"] < m["activations"] for m in mem)
    a2a = [layouts[ep]["all_to_all"]["bytes_per_gpu_per_step"] for ep in (1, 2, 4, 8)]
    assert a2a[0] == 0 and a2a[1] < a2a[2] < a2a[3]  # a larger ep sends a larger share of tokens away
    # ZeRO stages only shrink memory
    for l in p["layouts"]:
        totals = [l["zero_stages_gib"][f"zero{s}"]["total"] for s in range(4)]
        assert totals == sorted(totals, reverse=True)
    # hand check of one all-to-all figure: 32 layers x 4 passes x 4096 tokens x 2 copies x 4096 x 2 bytes x 7/8
    assert layouts[8]["all_to_all"]["bytes_per_gpu_per_step"] == int(32 * 4 * 4096 * 2 * 4096 * 2 * 7 / 8)
    # the same with 16 GPUs and 8 x 7B experts: nothing fits moe_dist's engine, and the reason says why
    assert p["recommended"] is None and "more nodes do not help" in p["reason"] and "train.engine=deepspeed deepspeed.zero_stage=" in p["reason"]


def test_recommendation_fits_and_fallbacks():
    preset = os.path.join(ROOT, "configs", "phi3-mini-upcycle-4x2.yaml")
    roomy = plan(preset, 1, 8, 80)
    r = roomy["recommended"]
    assert r and not r["activation_checkpointing"] and r["memory_gib"]["total"] <= roomy["cluster"]["usable_gib"]
    tight = plan(preset, 1, 8, 40)
    assert tight["recommended"]["activation_checkpointing"]
    assert tight["recommended"]["memory_gib"]["total_with_activation_checkpointing"] <= tight["cluster"]["usable_gib"]
    small = plan(preset, 1, 8, 28)
    assert small["recommended"] is None and "nodes of 8 GPUs would fit" in small["reason"]
    n = int(small["reason"].split(" nodes of 8 GPUs would fit")[0].rsplit("; ", 1)[1])
    assert plan(preset, n, 8, 28)["recommended"] is not None and plan(preset, n - 1, 8, 28)["recommended"] is None


def test_plan_command(tmp_path, capsys):
    assert cli(["plan", "--config", os.path.join(HF, "mixtral-8x7b.json"), "--nodes", "2", "--gpus-per-node", "8",
                "--gpu-mem-gib", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert out["total_params"] == 46_702_792_704 and out["active_params"] == 12_879_925_248
    assert cli(["plan", "--config", os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml"), "--nodes", "1",
                "--gpus-per-node", "8", "--gpu-mem-gib", "80"]) == 0
    text = capsys.readouterr().out
    assert "3.76B total" in text and "recommended: ep=" in text
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 8}))
    assert cli(["plan", "--config", str(bad), "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem-gib", "8"]) == 2
    assert "model_type='qwen2_moe'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--nodes"):
        plan(os.path.join(HF, "mixtral-8x7b.json"), 0, 8, 80)
