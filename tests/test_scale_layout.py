"""Scale-true construction: the model is built on the meta device and each rank allocates and
fills only what it holds (its expert slice, its FSDP2 shard of every dense weight, its edp
share of its experts), from seeded generators or from a checkpoint's rows, and the pieces
put together are exactly the single-process model. Experts are sharded over their
expert-data-parallel replicas: 4 ranks at ep=2 hold half the expert optimizer state that 2
ranks at ep=2 hold."""
import os

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.model_pieces import local_numel, pieces
from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.model.init import is_meta
from moe_dist.train.checkpoint import expert_keyed_state_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def cfg_for(tmp, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", "model.vocab_size=512",
        "model.moe.router=symphony", *extra])


def _build_and_fill(rank, world, tmp, ep, weights):
    from moe_dist.distributed.bootstrap import init_distributed
    from moe_dist.model.init import materialize
    from moe_dist.parallel import expert_parameters
    from moe_dist.train.setup.model import build_meta_model, weights_filler
    from moe_dist.parallel.parallelize import parallelize

    cfg = cfg_for(tmp, f"parallel.ep={ep}")
    rt = init_distributed(ep, cfg.model.moe.num_experts, backend="gloo")
    model = build_meta_model(cfg, VOCAB)
    seen = {}

    def fill(m):  # what materialize allocated before anything was filled
        seen["meta_before_fill"] = is_meta(m)
        weights_filler(cfg, weights)(m)

    parallelize(model, rt, cfg.parallel, fill=fill)
    assert not is_meta(model) and not seen["meta_before_fill"]
    experts = expert_parameters(model)
    return {"pieces": pieces(model), "expert_numel": local_numel(experts),
            "total_numel": local_numel(model.parameters())}


@pytest.mark.parametrize("world,ep,source", [(2, 2, "seed"), (4, 2, "seed"), (4, 2, "weights")])
def test_each_rank_fills_only_its_part_and_the_parts_make_the_whole_model(tmp_path, world, ep, source):
    from moe_dist.weights import save_model_weights

    cfg = cfg_for(tmp_path)
    whole = build_model(cfg.model, VOCAB, seed=cfg.train.seed)
    weights = None
    if source == "weights":  # another seed's model on disk: loading must override the seeded init
        weights = str(tmp_path / "weights")
        whole = build_model(cfg.model, VOCAB, seed=123)
        save_model_weights(whole, weights)
    ref = expert_keyed_state_dict(whole)
    ref_numel = sum(p.numel() for p in whole.parameters())
    ref_expert = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
    results = run_ranks(_build_and_fill, world, args=(str(tmp_path), ep, weights), timeout=240)
    merged = {}
    for res in results:
        for key, t in res["pieces"].items():
            if key in merged:  # held by several ranks (replicated): the same values everywhere
                assert torch.equal(merged[key], t), key
            merged[key] = t
    assert set(merged) == set(ref)
    for key in ref:
        assert torch.equal(merged[key], ref[key]), key
    for res in results:  # no rank holds the whole model: experts split ep x edp ways, dense weights world ways
        assert res["expert_numel"] == ref_expert // world, (res["expert_numel"], ref_expert, world)
        assert res["total_numel"] < ref_numel * 0.6


def _optimizer_state(rank, world, tmp, ep):
    from moe_dist.parallel import expert_parameters
    from moe_dist.train.loop.trainer import Trainer

    trainer = Trainer(cfg_for(tmp, f"parallel.ep={ep}", "train.steps=1", f"run.dir={tmp}/run-{world}"))
    try:
        row = trainer.train_step()
        experts = set(expert_parameters(trainer.model))
        state = [v for p, s in trainer.engine.optimizer.state.items() if p in experts for v in s.values() if v.dim() > 0]
        return {"expert_state_numel": local_numel(state), "loss": row["loss"], "grad_norm": row["grad_norm"]}
    finally:
        trainer.close()


def test_four_ranks_at_ep2_hold_half_the_expert_optimizer_state_of_two(tmp_path):
    two = run_ranks(_optimizer_state, 2, args=(str(tmp_path), 2), timeout=240)
    four = run_ranks(_optimizer_state, 4, args=(str(tmp_path), 2), timeout=240)
    for r in four:
        assert r["expert_state_numel"] * 2 == two[0]["expert_state_numel"], (r, two[0])
    # and the step is the same: loss and global gradient norm (every expert counted once)
    assert abs(four[0]["loss"] - two[0]["loss"]) <= 1e-5 * abs(two[0]["loss"])
    assert abs(four[0]["grad_norm"] - two[0]["grad_norm"]) <= 1e-4 * two[0]["grad_norm"]


def _gathered_bytes(rank, world, tmp, dtype):
    import torch.distributed as dist

    from moe_dist.train.loop.trainer import Trainer

    trainer = Trainer(cfg_for(tmp, "parallel.ep=2", f"train.dtype={dtype}", "train.bf16_on_slow_cpu=bf16", "train.steps=2",
                              f"run.dir={tmp}/run-{world}-{dtype}"))
    counted = {"bytes": 0, "calls": 0}
    # FSDP2's gather: dist.all_gather_single in torch 2.13, all_gather_into_tensor before
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(output, *args, **kwargs):
            counted["bytes"] += output.numel() * output.element_size()
            counted["calls"] += 1
            return real[name](output, *args, **kwargs)
        return call

    try:
        losses = [trainer.train_step()["loss"]]
        for n in names:
            setattr(dist, n, counting(n))
        try:
            losses.append(trainer.train_step()["loss"])
        finally:
            for n in names:
                setattr(dist, n, real[n])
        masters = {p.dtype for p in trainer.model.parameters()}
        return {**counted, "losses": losses, "masters": sorted(str(d) for d in masters)}
    finally:
        trainer.close()


def test_bf16_gathers_half_the_bytes_keeps_fp32_masters_and_the_layout_invariance(tmp_path):
    """bf16 under FSDP2 at 2 ranks (ep=2) and 4 ranks (ep=2, experts sharded over edp=2) against one process."""
    fp32 = run_ranks(_gathered_bytes, 2, args=(str(tmp_path), "fp32"), timeout=240)[0]
    bf16 = run_ranks(_gathered_bytes, 2, args=(str(tmp_path), "bf16"), timeout=240)[0]
    assert fp32["calls"] > 0 and bf16["calls"] > 0  # bf16 has one call more: the routers are one fp32 unit
    ratio = bf16["bytes"] / fp32["bytes"]
    print(f"all-gathered per step: fp32 {fp32['bytes']} B, bf16 {bf16['bytes']} B ({ratio:.3f}x; routers stay fp32)")
    assert 0.45 <= ratio <= 0.55, ratio
    assert bf16["masters"] == ["torch.float32"]  # master weights (and so the optimizer state) stay fp32
    from moe_dist.train.loop.trainer import Trainer  # one process, autocast over fp32 weights

    one = Trainer(cfg_for(tmp_path, "parallel.ep=1", "train.dtype=bf16", "train.bf16_on_slow_cpu=bf16", "train.steps=2",
                          f"run.dir={tmp_path}/one"))
    try:
        ref = [one.train_step()["loss"] for _ in range(2)]
    finally:
        one.close()
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(ref), rtol=1e-2, atol=0)
    four = run_ranks(_gathered_bytes, 4, args=(str(tmp_path), "bf16"), timeout=240)[0]  # ep=2, experts over edp=2
    torch.testing.assert_close(torch.tensor(four["losses"]), torch.tensor(ref), rtol=1e-2, atol=0)


def test_eval_of_an_upcycled_model_directory_at_any_layout(tmp_path):
    """`moe-dist eval --checkpoint DIR` reads an upcycled model directory (no run directory):
    1 process and 2 ranks at ep=2 (each reading its rows) give the same perplexity."""
    pytest.importorskip("transformers")
    import json

    from helpers.hf_cases import add_sentencepiece, build_dense
    from moe_dist.cli import main
    from moe_dist.upcycle import upcycle

    corpus = os.path.join(ROOT, "tests", "data", "python-docs")
    dense, up = str(tmp_path / "dense"), str(tmp_path / "up")
    os.makedirs(dense)
    texts = [open(os.path.join(corpus, "tutorial", "introduction.rst.txt"), encoding="utf-8").read()]
    add_sentencepiece(dense, texts, vocab_size=300)
    build_dense("llama", dense, vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    upcycle(dense, up, ["model.moe.num_experts=4", "model.moe.layers=every", "model.moe.router_options={normalize: true}"],
            log=lambda _: None)
    common = [f"data.corpus={corpus}", f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.2",
              "train.seq_len=32", "eval.max_sequences=8", "eval.batch=4", "run.progress=false"]
    assert main(["eval", "--checkpoint", up, "--json", str(tmp_path / "one.json"), "parallel.ep=1", *common]) == 0
    assert main(["eval", "--checkpoint", up, "--json", str(tmp_path / "two.json"), "--nproc", "2",
                 "parallel.ep=2", *common]) == 0
    one, two = (json.load(open(tmp_path / f"{n}.json", encoding="utf-8")) for n in ("one", "two"))
    assert (one["world_size"], two["world_size"], two["ep"]) == (1, 2, 2)
    assert len(two["peak_rss_gib"]) == 2 and all(g > 0 for g in two["peak_rss_gib"])
    assert abs(one["val_ppl"] - two["val_ppl"]) <= 1e-5 * one["val_ppl"], (one, two)
    assert not os.path.exists(os.path.join(up, "eval.json"))  # the model directory is only read
    # a training checkpoint without its run directory is refused with the reason
    assert main(["eval", "--checkpoint", str(tmp_path / "nowhere")]) == 2


def test_a_module_without_an_initialisation_recipe_is_refused(tmp_path):
    from moe_dist.model.init import init_weights, materialize

    cfg = cfg_for(tmp_path)
    model = build_model(cfg.model, VOCAB, device="meta")
    assert is_meta(model)
    with torch.device("meta"):
        model.blocks[0].extra = torch.nn.Conv1d(4, 4, 3)
    materialize(model, "cpu")
    assert model.lm_head.weight is model.embed.weight or not cfg.model.tie_embeddings  # ties survive to_empty
    with pytest.raises(RuntimeError, match=r"blocks\.0\.extra \(Conv1d\)"):
        init_weights(model, 0)
