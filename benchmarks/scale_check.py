"""Real-size check: a TinyLlama-1.1B-shaped dense model upcycled to 3.76B parameters
(configs/tinyllama-upcycle-8x2.yaml), evaluated by 1 process and by 2 ranks at ep=2.

    .venv/bin/python -m benchmarks.scale_check [--work DIR] [--keep]

Steps (each skipped when its output exists in --work, default runs/scale-check):
  1. a dense checkpoint with TinyLlama-1.1B's shapes (configs/hf/tinyllama-1.1b.json), random
     weights made by transformers' LlamaForCausalLM (nothing downloaded), saved as bf16
     safetensors; the reference logits of that bf16 model computed in fp32;
  2. `moe-dist upcycle` with the preset (11 MoE blocks x 8 experts, top-2);
  3. `moe-dist eval --checkpoint UPCYCLED` by 1 process (ep=1) and by 2 ranks (ep=2), fp32;
  4. the upcycled model's logits (1 process) against the dense reference (function preservation).

Passes when each of the 2 ranks peaks at <= 0.6x the single process's resident memory, the
two perplexities agree to 1e-5 (relative) and the logits to 1e-4 (relative norm). Needs
about 16 GiB of memory, 12 GB of disk and 5-15 minutes on 2 cores; prints the figures
(with the CPU's capability) and writes them to WORK/scale_check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (benchmarks/ is at its top)
PRESET = os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml")
HF_CONFIG = os.path.join(ROOT, "configs", "hf", "tinyllama-1.1b.json")
# small data: the committed corpus slice and a small tokenizer (model.vocab_size stays 32000)
DATA = ["data.corpus=" + os.path.join(ROOT, "tests", "data", "python-docs"), "data.vocab_size=512", "data.val_fraction=0.2"]
EVAL = ["train.dtype=fp32", "train.seq_len=128", "eval.max_sequences=4", "eval.batch=2", "run.progress=false"]
PROBE_TOKENS = 64


def _moe_dist(*args: str, log: str) -> None:
    cmd = [os.path.join(os.path.dirname(sys.executable), "moe-dist"), *args]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"  ({time.perf_counter() - t0:.0f} s, log {log})", flush=True)
    if code:
        sys.exit(f"scale check: command failed with exit code {code}; see {log}")


def _tokenizer_into(dense: str) -> None:
    """A checkpoint carries its tokenizer (eval refuses one without): a small one trained on the
    corpus slice (its ids stay below the model's 32000), which upcycle copies along."""
    from moe_dist.data.tokenizer import train_tokenizer

    corpus = os.path.join(ROOT, "tests", "data", "python-docs")
    texts = []
    for base, _, files in os.walk(corpus):
        for name in sorted(files):
            with open(os.path.join(base, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    with open(os.path.join(dense, "tokenizer.model"), "wb") as f:
        f.write(train_tokenizer(texts, 512).proto)


def make_dense(work: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = os.path.join(work, "dense")
    ref = os.path.join(work, "dense_logits.pt")
    if os.path.exists(ref) and os.path.isdir(dense):
        return dense
    with open(HF_CONFIG, encoding="utf-8") as f:
        raw = json.load(f)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dense, safe_serialization=True)
    _tokenizer_into(dense)
    print(f"dense TinyLlama-shaped model: {sum(p.numel() for p in model.parameters()):,} parameters, bf16, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    del model  # the reference reads the saved bf16 weights back in fp32: converting the model in memory would
    # also round its rotary inv_freq buffer to bf16 (a 3e-3 logits error in the reference itself)
    model = LlamaForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    tokens = torch.randint(0, config.vocab_size, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, ref + ".tmp")
    os.replace(ref + ".tmp", ref)
    return dense


def upcycled_logits(upcycled: str, tokens):
    """Our upcycled model, built on meta and filled from the safetensors directory (1 process)."""
    import torch

    from moe_dist.config import load_config
    from moe_dist.model import build_model
    from moe_dist.model.init import materialize
    from moe_dist.weights import load_model_weights

    cfg = load_config(os.path.join(upcycled, "config.yaml"), [])
    model = materialize(build_model(cfg.model, cfg.model.vocab_size, device="meta"), "cpu")
    load_model_weights(model, upcycled)
    with torch.no_grad():
        return model.eval()(tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "runs", "scale-check"))
    parser.add_argument("--keep", action="store_true", help="keep the dense and upcycled weights (about 10 GB)")
    args = parser.parse_args()
    import torch

    os.makedirs(args.work, exist_ok=True)
    dense = make_dense(args.work)
    upcycled = os.path.join(args.work, "upcycled")
    if not os.path.exists(os.path.join(upcycled, "upcycle.json")):
        _moe_dist("upcycle", "--dense", dense, "--out", upcycled, "--config", PRESET, *DATA,
                  log=os.path.join(args.work, "upcycle.log"))
    results = {}
    for name, launch in (("1 process", ["parallel.ep=1"]), ("2 ranks, ep=2", ["--nproc", "2", "parallel.ep=2"])):
        out = os.path.join(args.work, f"eval_{len(results) + 1}.json")
        _moe_dist("eval", "--checkpoint", upcycled, "--json", out, *launch, *DATA, *EVAL,
                  log=out.replace(".json", ".log"))
        with open(out, encoding="utf-8") as f:
            results[name] = json.load(f)
    ref = torch.load(os.path.join(args.work, "dense_logits.pt"))
    t0 = time.perf_counter()
    ours = upcycled_logits(upcycled, ref["tokens"])
    logits_diff = float((ours - ref["logits"]).norm() / ref["logits"].norm())
    one, two = results["1 process"], results["2 ranks, ep=2"]
    ratio = max(two["peak_rss_gib"]) / one["peak_rss_gib"][0]
    ppl_diff = abs(two["val_ppl"] - one["val_ppl"]) / one["val_ppl"]
    summary = {
        "cpu": f"{platform.processor() or platform.machine()}, torch capability {torch.backends.cpu.get_cpu_capability()}",
        "parameters": json.load(open(os.path.join(upcycled, "upcycle.json"), encoding="utf-8"))["total_params"],
        "peak_rss_gib": {k: v["peak_rss_gib"] for k, v in results.items()},
        "rank_over_single_peak": round(ratio, 3), "val_ppl": {k: v["val_ppl"] for k, v in results.items()},
        "val_ppl_relative_difference": ppl_diff, "logits_relative_difference": logits_diff,
        "logits_seconds": round(time.perf_counter() - t0, 1),
    }
    checks = {"each of 2 ranks <= 0.6x one process's peak memory": ratio <= 0.6,
              "perplexities agree (relative <= 1e-5)": ppl_diff <= 1e-5,
              "upcycled logits equal the dense model's (relative <= 1e-4)": logits_diff <= 1e-4}
    summary["checks"] = checks
    with open(os.path.join(args.work, "scale_check.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))
    if not args.keep:
        for d in (dense, upcycled):
            shutil.rmtree(d, ignore_errors=True)
    failed = [k for k, ok in checks.items() if not ok]
    print("scale check: " + ("passed" if not failed else "FAILED: " + "; ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
