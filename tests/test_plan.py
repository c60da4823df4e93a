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
    from helpers.hf_cases import TINY, FAMILY_EXTRAS, hf_classes

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
    # experts are FSDP-sharded over their edp replicas: a GPU holds 1/32 of every expert weight whatever ep,
    # but a larger ep gathers fewer experts (E / ep) for the running MoE layer
    assert len({m["weights"] for m in mem}) == 1 and all(l["experts_sharded_over_edp"] for l in layouts.values())
    assert all(a["fsdp_gather"] > b["fsdp_gather"] for a, b in zip(mem, mem[1:]))
    assert all(m["activations_checkpointed"] < m["activations"] for m in mem)
    a2a = [layouts[ep]["all_to_all"]["bytes_per_gpu_per_step"] for ep in (1, 2, 4, 8)]
    assert a2a[0] == 0 and a2a[1] < a2a[2] < a2a[3]  # a larger ep sends a larger share of tokens away
    # ZeRO stages only shrink memory
    for l in p["layouts"]:
        totals = [l["zero_stages_gib"][f"zero{s}"]["total"] for s in range(4)]
        assert totals == sorted(totals, reverse=True)
    # hand check of one all-to-all figure: 32 layers x 4 passes x 4096 tokens x 2 copies x 4096 x 2 bytes x 7/8
    assert layouts[8]["all_to_all"]["bytes_per_gpu_per_step"] == int(32 * 4 * 4096 * 2 * 4096 * 2 * 7 / 8)
    # fewer local experts than replicas at every ep: each replica holds 1/edp of every local expert (split inside
    # them), so every GPU holds 1/32 of the model, and 32 x 80 GiB train Mixtral
    counts = p["params"]
    even = (counts["dense_params"] + counts["experts"]) / 32 * 4 / 2**30
    assert all(m["weights"] == pytest.approx(even, abs=1e-3) for m in mem)
    assert all(l["expert_split"] == "within" for l in layouts.values()) and p["recommended"] is not None
    # split on the expert dimension (parallel.expert_shard=experts) the first replica holds one whole expert per
    # layer (the dry run measures the same): 32 x 80 GiB do not train Mixtral, and more nodes do not help
    whole = plan(os.path.join(HF, "mixtral-8x7b.json"), 4, 8, 80, ["parallel.expert_shard=experts"])
    busiest = (counts["dense_params"] / 32 + 32 * counts["per_expert"]) * 4 / 2**30
    assert all(l["memory_gib"]["weights"] == pytest.approx(busiest, abs=1e-3) for l in whole["layouts"])
    assert all(l["expert_split"] == "experts (padded)" for l in whole["layouts"])
    assert whole["recommended"] is None
    assert "holds 1 whole (parallel.expert_shard splits them on the expert dimension)" in whole["reason"]
    # 4 GiB GPUs: what FSDP2 gathers and the activations do not shrink with more GPUs, and the reason says so
    tiny_gpus = plan(os.path.join(HF, "mixtral-8x7b.json"), 4, 8, 4)
    assert tiny_gpus["recommended"] is None and "more nodes do not help" in tiny_gpus["reason"]
    assert "what FSDP2 gathers" in tiny_gpus["reason"]
    # replicated dense weights do not shrink either; DeepSpeed ZeRO-2 or parallel.dense=fsdp would fit
    replicated = plan(os.path.join(ROOT, "configs", "phi3-mini-upcycle-4x2.yaml"), 1, 8, 40, ["parallel.dense=replicate"])
    assert replicated["recommended"] is None and "parallel.dense=replicate replicates" in replicated["reason"]
    assert "train.engine=deepspeed deepspeed.zero_stage=" in replicated["reason"]


def test_recommendation_fits_and_fallbacks():
    preset = os.path.join(ROOT, "configs", "phi3-mini-upcycle-4x2.yaml")
    roomy = plan(preset, 1, 8, 80)
    r = roomy["recommended"]
    assert r and not r["activation_checkpointing"] and r["memory_gib"]["total"] <= roomy["cluster"]["usable_gib"]
    tight = plan(preset, 1, 8, 31)  # each of ep=4's 2 replicas holds half of its one local expert per layer
    assert tight["recommended"]["activation_checkpointing"]
    assert tight["recommended"]["memory_gib"]["total_with_activation_checkpointing"] <= tight["cluster"]["usable_gib"]
    # the preset's 4 micro-batches keep unsharded gradients for the step (parallel.grad_sync=step): where those do
    # not fit, reduce-scattering after every micro-batch (parallel.grad_sync=microbatch) is recommended
    sharded = plan(preset, 1, 8, 30)
    assert sharded["recommended"]["grad_sync"] == "microbatch" and "parallel.grad_sync=microbatch" in sharded["reason"]
    assert sharded["recommended"]["memory_gib"]["grads"] < tight["recommended"]["memory_gib"]["grads"] / 3
    small = plan(preset, 1, 8, 18)
    assert small["recommended"] is None and "nodes of 8 GPUs would fit" in small["reason"]
    n = int(small["reason"].split(" nodes of 8 GPUs would fit")[0].rsplit("; ", 1)[1])
    assert plan(preset, n, 8, 18)["recommended"] is not None and plan(preset, n - 1, 8, 18)["recommended"] is None


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
    bad.write_text(json.dumps({"model_type": "deepseek_v2", "hidden_size": 8}))
    assert cli(["plan", "--config", str(bad), "--nodes", "1", "--gpus-per-node", "1", "--gpu-mem-gib", "8"]) == 2
    assert "model_type='deepseek_v2'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--nodes"):
        plan(os.path.join(HF, "mixtral-8x7b.json"), 0, 8, 80)


def _layouts(overrides, world, gpu_mem_gib=1000):
    p = plan(os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml"), 1, world, gpu_mem_gib,
             ["model.n_layers=4", "train.global_batch=8", "train.grad_accum=1", "train.seq_len=64"] + overrides)
    return p["params"], {l["ep"]: l for l in p["layouts"]}


def test_fsdp_shards_experts_over_their_replicas():
    counts, four = _layouts(["train.dtype=fp32"], 4)
    dense, experts = counts["dense_params"], counts["experts"]  # 2 MoE layers x 8 experts
    # ep=2, edp=2: each rank holds 4 experts per layer, FSDP2 splits them over the 2 replicas; dense over all 4
    mem = four[2]["memory_gib"]
    assert four[2]["experts_sharded_over_edp"] and not four[4]["experts_sharded_over_edp"]  # edp = 1: whole
    for key, per_param in (("weights", 4), ("grads", 4), ("optimizer", 8)):
        assert mem[key] == pytest.approx((dense / 4 + experts / 2 / 2) * per_param / 2**30, abs=1e-3)
    # the expert state per rank is the same at ep=1, 2 and 4 (1/4 of it either way) ...
    assert four[1]["memory_gib"]["weights"] == four[2]["memory_gib"]["weights"] == four[4]["memory_gib"]["weights"]
    # ... but two layers' experts units (the running one, the prefetched one) are gathered whole (E / ep
    # experts each, fp32) beside two blocks and the root unit (the final norm), or, at the start of
    # backward, the output head's own unit with its gradient beside one block and one experts unit
    per_layer, block, head = experts / 2, counts["largest_dense_block"], counts["lm_head"]

    def gathered(experts_unit: float) -> float:
        return (2048 + max(2 * block + 2 * experts_unit, 2 * head + block + experts_unit)) * 4 / 2**30

    assert four[4]["memory_gib"]["fsdp_gather"] == pytest.approx(gathered(0), abs=2e-3)  # no experts unit at edp = 1
    assert four[2]["memory_gib"]["fsdp_gather"] == pytest.approx(gathered(per_layer / 2), abs=2e-3)
    assert four[1]["memory_gib"]["fsdp_gather"] == pytest.approx(gathered(per_layer), abs=2e-3)
    # an uneven split is padded: 4 experts per layer at ep=2 over 3 replicas gather as 3 x ceil(4 / 3) = 6
    _, six = _layouts(["train.dtype=fp32", "train.global_batch=6"], 6)
    assert six[2]["memory_gib"]["fsdp_gather"] == pytest.approx(gathered(per_layer * 6 / 8), abs=2e-3)
    # replicated dense weights: no FSDP2, experts whole on their ranks
    _, rep = _layouts(["train.dtype=fp32", "parallel.dense=replicate"], 4)
    assert rep[2]["memory_gib"]["weights"] == pytest.approx((dense + experts / 2) * 4 / 2**30, abs=1e-3)
    assert rep[2]["memory_gib"]["fsdp_gather"] == 0 and not rep[2]["experts_sharded_over_edp"]


def test_bf16_gathers_half_the_bytes_and_accumulation_keeps_unsharded_grads():
    _, fp32 = _layouts(["train.dtype=fp32"], 4)
    _, bf16 = _layouts(["train.dtype=bf16"], 4)
    for ep in (1, 2, 4):
        assert bf16[ep]["memory_gib"]["fsdp_gather"] == pytest.approx(fp32[ep]["memory_gib"]["fsdp_gather"] / 2, abs=1e-3)
        assert bf16[ep]["memory_gib"]["weights"] == fp32[ep]["memory_gib"]["weights"]  # fp32 masters either way
    # bf16 with replicated weights: autocast keeps a bf16 copy of every weight for backward
    counts, rep = _layouts(["train.dtype=bf16", "parallel.dense=replicate"], 4)
    assert rep[4]["memory_gib"]["autocast_copies"] == pytest.approx(
        (counts["dense_params"] + counts["experts"] / 4) * 2 / 2**30, abs=1e-3)
    # grad_accum > 1: FSDP2 keeps unsharded gradients between micro-batches (4 bytes x everything the rank gathers)
    counts, accum = _layouts(["train.dtype=fp32", "train.grad_accum=2"], 4)
    assert accum[2]["memory_gib"]["grads"] == pytest.approx(
        (counts["dense_params"] + counts["experts"] / 2) * 4 / 2**30, abs=1e-3)
    assert accum[2]["memory_gib"]["weights"] == fp32[2]["memory_gib"]["weights"]


def test_weight_and_gradient_traffic():
    from moe_dist.plan.memory import grad_sync_bytes

    dense, experts = 1000, 600
    # FSDP2, 4 ranks, ep=2 (edp=2), fp32, one micro-batch: gather (fwd + bwd) and reduce-scatter, ring shares
    assert grad_sync_bytes(dense, experts, 4, 2, "fsdp", 1) == pytest.approx(dense * 3 / 4 * 12 + experts * 1 / 2 * 12)
    # bf16 gathers 2-byte copies; gradients are reduced in fp32; accumulation repeats the gathers only
    assert grad_sync_bytes(dense, experts, 4, 2, "fsdp", 3, "bf16") == pytest.approx(
        dense * 3 / 4 * (3 * 2 * 2 + 4) + experts * 1 / 2 * (3 * 2 * 2 + 4))
    # edp = 1: experts are not synchronised at all; replicated: all-reduces (2 ring passes of fp32)
    assert grad_sync_bytes(dense, experts, 4, 4, "fsdp", 1) == pytest.approx(dense * 3 / 4 * 12)
    assert grad_sync_bytes(dense, experts, 4, 2, "replicate", 1) == pytest.approx(dense * 3 / 4 * 8 + experts * 1 / 2 * 8)


def test_gradient_reduction_transient():
    from moe_dist.plan.memory import Units, fsdp_reduce_peak_bytes

    units = Units(root=100, block=10, experts=60, output_head=50, edges_split=False)  # head in the root unit
    # fp32: the experts unit's reduction (flat fp32 buffer + its fp32 grads or gloo's copy of the buffer) next to
    # root + 2 blocks + the prefetched experts unit gathered and the head's gradient waiting, which is above the
    # root's own reduction (100 x 8)
    for backend in ("nccl", "gloo"):
        assert fsdp_reduce_peak_bytes(units, 2, "fp32", backend, False) == (100 + 2 * 10 + 60) * 4 + 50 * 4 + 60 * 8
    # bf16: 2-byte grads and gathers; gloo's 4-byte copy of the buffer outweighs the bf16 grads it replaces
    assert fsdp_reduce_peak_bytes(units, 2, "bf16", "nccl", False) == (100 + 2 * 10 + 60) * 2 + 50 * 2 + 60 * 6
    assert fsdp_reduce_peak_bytes(units, 2, "bf16", "gloo", False) == (100 + 2 * 10 + 60) * 2 + 50 * 2 + 60 * 8
    # grad_accum > 1: the unsharded grads are the state's gradients already, only the buffers are extra
    assert fsdp_reduce_peak_bytes(units, 2, "fp32", "nccl", True) == (100 + 2 * 10 + 60) * 4 + 50 * 4 + 60 * 4
    assert fsdp_reduce_peak_bytes(units, 2, "fp32", "gloo", True) == (100 + 2 * 10 + 60) * 4 + 50 * 4 + 60 * 8
    # a large root: its reduction at the end of backward is the peak
    big_root = Units(root=1000, block=10, experts=60, output_head=500, edges_split=False)
    assert fsdp_reduce_peak_bytes(big_root, 2, "fp32", "gloo", False) == 1000 * 8
    assert fsdp_reduce_peak_bytes(big_root, 1, "fp32", "gloo", False) == 0  # one process: no FSDP2
    _, nccl = _layouts(["train.dtype=bf16"], 4)
    _, gloo = _layouts(["train.dtype=bf16", "parallel.backend=gloo"], 4)
    assert all(gloo[ep]["memory_gib"]["fsdp_reduce"] > nccl[ep]["memory_gib"]["fsdp_reduce"] for ep in (1, 2, 4))
