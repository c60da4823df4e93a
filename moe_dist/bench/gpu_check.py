"""The first look at a GPU: the layer and routers against the CPU, the main job in bf16, the layer
benchmark, memory against the dry run, host synchronisations per step.

    python -m moe_dist.bench.gpu_check --out DIR [--device cuda|cpu] [--sections a,b] [--budget-s 450]

Each section runs in a subprocess of its own with its own time limit and writes one JSON object;
a failed section is reported with its last lines and the others still run. ``DIR/gpu_check.json``
holds every section, ``DIR/gpu_check.log`` what they printed. ``--device cpu`` runs the same code
on the CPU with small sizes (its own test).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SECTIONS = ("device", "layer_parity", "train", "host_syncs", "memory_vs_dry_run", "layer_bench")
# seconds each section may take (on a GPU; --budget-s scales them down when it is smaller than their sum)
LIMITS = {"device": 40, "layer_parity": 60, "train": 110, "host_syncs": 50, "memory_vs_dry_run": 110, "layer_bench": 90}
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, SXM
CORPUS = "tests/data/python-docs"


def _small(device: str) -> bool:
    return device == "cpu"


def _train_args(out: str, device: str, big: bool, steps: int) -> list[str]:
    """The main job (``configs/tiny.yaml``, one process) or a 2-layer slice of the TinyLlama preset."""
    if big:
        base = ["--config", "configs/tinyllama-upcycle-8x2.yaml", "model.n_layers=2", "train.seq_len=2048",
                "train.global_batch=8", "train.grad_accum=1", "data.vocab_size=512"]
        if _small(device):
            base += ["model.d_model=256", "model.n_heads=8", "model.n_kv_heads=4", "model.d_ff=512",
                     "model.vocab_size=1024", "train.seq_len=64", "train.global_batch=2"]
    else:
        base = ["--config", "configs/tiny.yaml"]
        if _small(device):
            base += ["model.n_layers=2", "train.seq_len=64", "train.global_batch=4"]
    dtype = "bf16" if device != "cpu" else "fp32"
    return base + ["--nproc", "1", "parallel.ep=1", f"run.device={device}", f"train.dtype={dtype}",
                   f"train.steps={steps}", f"run.dir={out}", f"data.corpus={CORPUS}", "data.val_fraction=0.2", "eval.every=0",
                   "eval.max_sequences=8", "run.progress=false", "run.print_every=1000", "ckpt.every=0",
                   "run.tensorboard=false", "train.warmup_steps=2"]


def section_device(device: str) -> dict:
    import platform

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "cpus": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
        out["datasheet_bf16_tflops"] = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in p.name), None)
    n = 1024 if _small(device) else 8192
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(8):
        _sync(device)
        t = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t)
    best = sorted(times[3:])[len(times[3:]) // 2]
    out["matmul_tflops"] = round(2 * n ** 3 / best / 1e12, 1)
    out["matmul_dtype"] = str(dtype)
    return out


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def section_layer_parity(device: str) -> dict:
    """Every router's layer on ``device`` against the same layer on the CPU (fp32, TF32 off): output,
    aux loss, input and weight gradients; dropless and with a capacity factor."""
    import copy
    import dataclasses

    import torch

    from ..moe import MoEArgs, MoELayer, RouterInputs
    from .attention_inputs import synthetic_attention_inputs

    def _leaf(t, dev):
        return None if t is None else t.detach().to(dev).requires_grad_(t.requires_grad)
    from ..moe.routers import ROUTERS

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results, worst = {}, 0.0
    B, S, d = 2, 32, 64
    for name in sorted(ROUTERS):
        for cf in (None, 1.0):
            key = f"{name}{'' if cf is None else '_cf1'}"
            try:
                torch.manual_seed(0)
                layer = MoELayer(d, MoEArgs(d_ff=128, num_experts=8, top_k=2, router=name, capacity_factor=cf))
                other = copy.deepcopy(layer).to(device)
                x = torch.randn(B, S, d)
                need = layer.attention_needs
                attn = synthetic_attention_inputs(x, heads=4, form=need) if need else None
                outs = []
                for mod, dev in ((layer, "cpu"), (other, device)):
                    xi = x.to(dev).requires_grad_(True)
                    inputs = RouterInputs(batch_shape=(B, S), attention=None if attn is None else dataclasses.replace(
                        attn, **{f.name: _leaf(getattr(attn, f.name), dev) for f in dataclasses.fields(attn)}))
                    y = mod(xi, inputs)
                    loss = y.square().mean() + (mod.aux_loss if mod.aux_loss is not None else 0)
                    loss.backward()
                    grads = [p.grad.detach().cpu() for p in mod.parameters() if p.grad is not None]
                    outs.append((y.detach().cpu(), xi.grad.cpu(), grads))
                diff = max(float((a - b).abs().max() / (a.abs().max() + 1e-12))
                           for a, b in [(outs[0][0], outs[1][0]), (outs[0][1], outs[1][1]),
                                        *zip(outs[0][2], outs[1][2])])
                results[key] = {"max_rel_diff": diff, "ok": diff < 1e-4}
                worst = max(worst, diff)
            except Exception as e:  # one router's failure is reported; the others still run
                results[key] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    passed = sum(r["ok"] for r in results.values())
    return {"passed": passed, "failed": len(results) - passed, "worst_rel_diff": worst, "cases": results}


def _run_train(out: str, device: str, big: bool, steps: int) -> dict:
    cmd = [sys.executable, "-m", "moe_dist.cli", "train"] + _train_args(out, device, big, steps)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"train exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    steps_rows = [r for r in rows if "tokens_per_s" in r]
    tail = steps_rows[len(steps_rows) // 3:] or steps_rows  # after the warm-up
    tps = sorted(r["tokens_per_s"] for r in tail)[len(tail) // 2]
    summary = json.load(open(os.path.join(out, "summary.json")))
    return {"tokens_per_s": tps, "steps": len(steps_rows), "final_loss": steps_rows[-1]["loss"],
            "cuda_peak_allocated_gib": summary.get("cuda_peak_allocated_gib"),
            "cuda_peak_reserved_gib": summary.get("cuda_peak_reserved_gib"), "command": " ".join(cmd[2:])}


def _model_flops_per_token(config: str, overrides: list[str]) -> float:
    """Training FLOPs of one token (3 x the forward's), as the planner counts them."""
    from ..model.params import block_shape, count_params
    from ..plan.planner import load_plan_input
    from ..plan.timing import flops_per_token

    inp = load_plan_input(config, overrides)
    counts = count_params(inp.model, inp.moe_blocks)
    s = block_shape(inp.model)
    f = flops_per_token(counts, s.d_model, inp.model.vocab_size, inp.seq_len, inp.model.n_layers, s.top_k)
    return 3 * (f["expert"] * (1 if inp.moe_blocks else 0) * len(inp.moe_blocks) + f["other"])


def section_train(device: str, out: str) -> dict:
    res = {}
    for big in (False, True):
        name = "tinyllama_2layer" if big else "main_job"
        run_dir = os.path.join(out, f"train-{name}")
        r = _run_train(run_dir, device, big, 12 if _small(device) else 40)
        args = _train_args(run_dir, device, big, 1)
        flops = _model_flops_per_token(args[1], [a for a in args[2:] if "=" in a and not a.startswith("--")])
        r["model_tflops"] = round(flops * r["tokens_per_s"] / 1e12, 3)
        r["mfu_vs_planner_400"] = round(r["model_tflops"] / 400.0, 4)
        res[name] = r
    return res


def section_host_syncs(device: str, out: str) -> dict:
    """CUDA runtime synchronisations and device-to-host copies per training step (profiler), for
    the main job's model in one process."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..config import load_config
    from ..train.trainer import Trainer

    args = _train_args(os.path.join(out, "host-syncs"), device, False, 6)
    cfg = load_config(args[1], [a for a in args[2:] if "=" in a and not a.startswith("--")] + ["run.threads=4"])
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    steps = 3
    with profile(activities=acts) as prof:
        for _ in range(steps):
            trainer.train_step()
        _sync(device)
    counts: dict[str, int] = {}
    for e in prof.events():
        n = e.name
        if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
                 "aten::_local_scalar_dense", "aten::item") or "DtoH" in n:
            counts[n] = counts.get(n, 0) + 1
    layers = len(trainer.moe)
    return {"per_step": {k: v / steps for k, v in sorted(counts.items())}, "moe_layers": layers,
            "micro_batches": cfg.train.grad_accum,
            "expected_reads": f"{layers * cfg.train.grad_accum} dispatch reads + 1 loss read + 1 gradient norm"}


def section_memory_vs_dry_run(device: str, out: str) -> dict:
    from ..plan.dry_run import dry_run

    args = _train_args(os.path.join(out, "memory"), device, True, 3)
    overrides = [a for a in args[2:] if "=" in a and not a.startswith("--")]
    real = _run_train(os.path.join(out, "memory"), device, True, 3)
    keep = [o for o in overrides if not o.startswith(("run.", "data.", "eval.", "ckpt."))]
    predicted = dry_run(args[1], keep, nodes=1, gpus_per_node=1)
    real_gib = real["cuda_peak_allocated_gib"]
    pred_gib = predicted["peak_bytes"] / 2**30
    return {"real_peak_allocated_gib": real_gib, "dry_run_peak_gib": round(pred_gib, 3),
            "ratio_real_over_dry_run": round(real_gib / pred_gib, 3) if real_gib else None,
            "dry_run_categories_gib": {k: round(v / 2**30, 3) for k, v in predicted["categories_bytes"].items()}}


def section_layer_bench(device: str, out: str) -> dict:
    tokens = "4096" if _small(device) else "16384,65536"
    dtypes = "fp32" if device == "cpu" else "bf16"
    cmd = [sys.executable, "-m", "moe_dist.bench.layer", "--device", device, "--dtypes", dtypes, "--ep", "1",
           "--impls", "moe_dist,floor", "--tokens", tokens, "--expert-kernel", "auto,loop,bmm,grouped_mm",
           "--repeats", "5", "--warmup", "2", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"layer bench exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    rows = []
    for line in done.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return {"rows": rows, "command": " ".join(cmd[2:])}


def run_section(name: str, device: str, out: str) -> dict:
    fn = globals()[f"section_{name}"]
    return fn(device) if name in ("device", "layer_parity") else fn(device, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one section in this process
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.one:
        res = run_section(a.one, a.device, a.out)
        with open(os.path.join(a.out, f"{a.one}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    names = [s for s in a.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        print(f"--sections: {','.join(unknown)}; allowed: {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    scale = min(1.0, a.budget_s / sum(LIMITS[s] for s in names))
    report, log = {}, open(os.path.join(a.out, "gpu_check.log"), "a")
    for name in names:
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "moe_dist.bench.gpu_check", "--out", a.out, "--device", a.device, "--one", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS[name] * scale)
            log.write(f"== {name}\n{done.stdout}{done.stderr}\n")
            ok = done.returncode == 0
            entry = ({"status": "ok", **json.load(open(os.path.join(a.out, f"{name}.json")))} if ok else
                     {"status": "failed", "error": (done.stdout + done.stderr)[-2000:]})
        except subprocess.TimeoutExpired as e:
            entry = {"status": "failed", "error": f"timed out after {e.timeout:.0f} s"}
        entry["seconds"] = round(time.perf_counter() - t, 1)
        report[name] = entry
        print(f"{name}: {entry['status']} in {entry['seconds']} s", flush=True)
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
