"""End to end: a tiny dense Llama checkpoint (with its own sentencepiece tokenizer) is upcycled
once per registered router, and a tiny Qwen2 with a tokenizer.json once; each MoE is
fine-tuned for 20 steps on 2 gloo ranks with expert parallelism 2, saving every 10 steps; a
second run resumes from step 10 at expert parallelism 1 and ends where the first did; a
trained run exports to Mixtral format with transformers reproducing its logits."""
import os

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.hf_cases import add_sentencepiece, add_tokenizer_json, build_dense, rel_err

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "data", "python-docs")
STEPS = 20
# per router: options that keep the dense function at step 0 where the router allows it, and
# small hypernetworks; the attention router reads only the probabilities here
ROUTERS = {
    # xmoe's scalar temperature parameter is refused by FSDP2's fully_shard: its dense weights are replicated
    "topk": [], "noisy_topk": [], "xmoe": ["parallel.dense=replicate"], "sinkhorn": [], "ssr": ["model.moe.router_options={p: 0.5}"],
    "similarity": [], "attention": ["model.moe.router_options={likelihood: false}"],
    "symphony": ["model.moe.router_options={init: identity, normalize: true}"],
    "hyper": ["model.moe.router_options={embed_dim: 8, hyper_dim: 16}"],
    "smoe_dropout": ["model.moe.router_options={k_max: 4, k_schedule_steps: 10}"], "ac": [],
}


def _train_each(rank, world, root):
    from moe_dist.config import load_config
    from moe_dist.train.loop.trainer import train

    out = {}
    for router in [*ROUTERS, "qwen2"]:
        common = ["run.plots=false", "run.tensorboard=false", "run.print_every=100", f"train.steps={STEPS}",
                  "train.global_batch=4", "train.seq_len=32", "train.lr=0.003", "train.warmup_steps=2",
                  f"data.corpus={CORPUS}", f"data.cache_dir={os.path.join(root, 'cache')}", "data.val_fraction=0.2",
                  "eval.max_sequences=8", "eval.batch=4", "model.moe.expert_kernel=loop", f"ckpt.every={STEPS // 2}"]
        config = os.path.join(root, f"up_{router}", "config.yaml")
        run_dir = os.path.join(root, "runs", router)
        summary = train(load_config(config, common + [f"run.dir={run_dir}", "parallel.ep=2"]))
        # resume from the half-way checkpoint at another expert-parallel size (experts replicated)
        half = os.path.join(run_dir, "checkpoints", f"step_{STEPS // 2:06d}")
        resumed = train(load_config(config, common + [f"run.dir={run_dir}_resumed", "parallel.ep=1", f"resume={half}"]))
        out[router] = {"summary": summary, "resumed": resumed}
    return out


@pytest.mark.slow
def test_upcycle_then_train_each_router_expert_parallel(tmp_path):
    from moe_dist.upcycle import upcycle

    root = str(tmp_path)
    dense = os.path.join(root, "dense")
    texts = [open(os.path.join(CORPUS, "tutorial", name), encoding="utf-8").read()
             for name in ("introduction.rst.txt", "controlflow.rst.txt")]
    os.makedirs(dense)
    add_sentencepiece(dense, texts, vocab_size=300)
    build_dense("llama", dense, vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    for router, options in ROUTERS.items():
        info = upcycle(dense, os.path.join(root, f"up_{router}"),
                       ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.layers=every",
                        f"model.moe.router={router}", *options], log=lambda _: None)
        assert info["preserves_function"] in (True, None), router
        assert info["tokenizer_files"][0] == "tokenizer.model"
    # a Qwen2 checkpoint whose tokenizer is a tokenizer.json (no sentencepiece model)
    qwen = os.path.join(root, "dense_qwen2")
    os.makedirs(qwen)
    add_tokenizer_json(qwen, texts, vocab_size=300)
    build_dense("qwen2", qwen, vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    upcycle(qwen, os.path.join(root, "up_qwen2"), ["model.moe.num_experts=4", "model.moe.layers=every_other"],
            log=lambda _: None)

    results = run_ranks(_train_each, 2, args=(root,), timeout=600)
    for router in [*ROUTERS, "qwen2"]:
        s0, s1 = results[0][router]["summary"], results[1][router]["summary"]
        assert s0["steps"] == STEPS and s0["train_loss"] == s1["train_loss"], router
        assert torch.isfinite(torch.tensor(s0["train_loss"])), router
        assert os.path.exists(os.path.join(root, "runs", router, "checkpoints", f"step_{STEPS:06d}", "COMPLETE"))
        # steps 11..20 after the resume (ep=1) reproduce the uninterrupted run (ep=2) up to reduction order
        resumed = results[0][router]["resumed"]
        assert resumed["steps"] == STEPS, router
        for key in ("train_loss", "val_loss"):
            assert abs(resumed[key] - s0[key]) <= 1e-4 * abs(s0[key]), (router, key, resumed[key], s0[key])

    # the trained, expert-parallel-saved topk model exported to Mixtral format
    from moe_dist.cli import main as cli
    from moe_dist.hf.export import load_our_model
    from transformers import MixtralForCausalLM

    run = os.path.join(root, "runs", "topk")
    assert cli(["export", "--checkpoint", run, "--format", "mixtral", "--out", os.path.join(root, "mixtral")]) == 0
    assert os.path.exists(os.path.join(root, "mixtral", "tokenizer.model"))
    ours, _, _ = load_our_model(run)
    hf = MixtralForCausalLM.from_pretrained(os.path.join(root, "mixtral")).eval()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(hf(x).logits, ours(x)) < 1e-5
