"""Section ``device``: torch, CUDA, the GPU, the CPUs; the training dtype's matmul rate measured
(:func:`moe_dist.hardware.matmul_peak`) beside the datasheet's (:func:`moe_dist.hardware.datasheet_tflops`)."""
from __future__ import annotations

import os
import subprocess
from typing import Optional

import torch

from moe_dist.hardware import datasheet_tflops, matmul_peak

from .context import Context, check_device
from .settings import train_dtype


def cpu_has_fast_bf16() -> bool:
    """AVX2-only CPUs run bf16 matmuls many times slower than fp32: time bf16 there only with AVX-512."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


MATMUL_SECONDS = 1.0  # repeats of the timed matmul for this long; the best one counts


def matmul_tflops(device: str, n: int, dtype: torch.dtype) -> float:
    """TFLOP/s of an ``n x n x n`` matmul on ``device``: the best repeat (:func:`moe_dist.hardware.matmul_peak`,
    the rate the trainer's MFU takes on a CPU)."""
    return round(matmul_peak(dtype, None, n, MATMUL_SECONDS, device=torch.device(device)) / 1e12, 2)


def nvidia_smi() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def section_device(ctx: Context) -> dict:
    import platform

    check_device(ctx.device)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    figs = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_cores_usable": cores,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        figs.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 2),
                    compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    multiprocessors=p.multi_processor_count, nvidia_smi=nvidia_smi())
    figs["datasheet_bf16_tflops"] = datasheet_tflops(figs.get("gpu"))
    # the rate MFU is taken against: the training's dtype (bf16 on a GPU, fp32 on the CPU)
    dtype = torch.float32 if train_dtype(ctx.device) == "fp32" else torch.bfloat16
    n = ctx.sizes.matmul_n
    ctx.partial(**figs)
    figs.update(matmul_n=n, matmul_dtype=str(dtype).replace("torch.", ""), matmul_tflops=matmul_tflops(ctx.device, n, dtype))
    if ctx.device == "cpu" and cpu_has_fast_bf16():
        figs["matmul_bf16_tflops"] = matmul_tflops(ctx.device, n, torch.bfloat16)
    if figs["datasheet_bf16_tflops"]:
        figs["matmul_of_datasheet"] = round(figs["matmul_tflops"] / figs["datasheet_bf16_tflops"], 3)
    print(f"device: {figs.get('gpu', 'CPU ' + figs['cpu_capability'])}, torch {figs['torch']} (CUDA {figs['cuda']}); "
          f"{n}^3 {figs['matmul_dtype']} matmul {figs['matmul_tflops']} TFLOP/s (datasheet {figs['datasheet_bf16_tflops']})")
    return figs
