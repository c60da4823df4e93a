"""What the check runs where: the repository's paths, the sections and their planned shares of the
budget, the sizes on a GPU, on the CPU and on the CPU in --quick, the training overrides."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MAIN_CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")

BIG_CONFIG = os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml")

CORPUS = os.path.join(ROOT, "tests", "data", "python-docs")

DEVICE_TESTS = ["tests/test_device_layer.py"]  # the test files that take MOE_DIST_TEST_DEVICE

SECTIONS = ("device", "tests", "train", "memory_vs_dry_run", "host_syncs", "layer_bench")

# seconds each section is planned to take on one GPU; the budget is shared in these proportions
PLANNED_S = {"device": 30, "tests": 90, "train": 120, "memory_vs_dry_run": 50, "host_syncs": 45, "layer_bench": 90}

MIN_SECTION_S = 5  # a section given less than this is skipped, not started

INJECT_ENV = "MOE_DIST_GPU_CHECK_INJECT"  # test hook: "section=fail,other=hang"

WORK_ENTRIES = ("results", "train", "host_syncs", "layer_bench", "tests")  # what a run rewrites in --work

BIG_NAME = "tinyllama_2L"

BIG_RUN_S = {"cuda": 45.0, "cpu": 20.0}  # start the TinyLlama slice only with this much time left


# ---- sizes: a GPU, the CPU, the CPU in --quick ------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    matmul_n: int
    main_overrides: tuple  # on top of configs/tiny.yaml
    main_steps: int
    big_overrides: Optional[tuple]  # on top of the TinyLlama slice; None: no big run
    big_steps: int
    skip_steps: int  # first steps left out of tokens/s (warm-up)
    sync_warmup: int
    sync_steps: int
    bench_args: tuple


# the TinyLlama preset cut to 2 blocks (block 1 an MoE block), a few sequences of 2048 tokens per
# step, the committed corpus with a small tokenizer (model.vocab_size stays the preset's 32000)
BIG_SLICE = ("model.n_layers=2", "model.moe.layers=every_other", "train.seq_len=2048", "train.global_batch=8",
             "train.grad_accum=1", "data.vocab_size=512", "eval.max_sequences=8", "eval.batch=8")

CPU_SMALL_MODEL = ("model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256",
                   "model.vocab_size=1024", "train.seq_len=64", "train.global_batch=2", "eval.max_sequences=2",
                   "eval.batch=2")

CPU_MAIN = ("model.n_layers=2", "train.seq_len=64", "train.global_batch=4", "data.vocab_size=512",
            "eval.max_sequences=4", "eval.batch=4")


def sizes_for(device: str, quick: bool) -> Sizes:
    if device == "cpu":
        return Sizes(matmul_n=512 if quick else 1024, main_overrides=CPU_MAIN, main_steps=4 if quick else 8,
                     big_overrides=None if quick else BIG_SLICE + CPU_SMALL_MODEL, big_steps=4, skip_steps=1,
                     sync_warmup=1, sync_steps=2,
                     bench_args=("--tokens", "512" if quick else "1024", "--d-model", "128", "--d-ff", "256",
                                 "--repeats", "2" if quick else "3", "--warmup", "1"))
    return Sizes(matmul_n=8192, main_overrides=("eval.max_sequences=24", "eval.batch=12"),
                 main_steps=12 if quick else 40, big_overrides=BIG_SLICE, big_steps=6 if quick else 15,
                 skip_steps=3, sync_warmup=2, sync_steps=3,
                 bench_args=("--tokens", "16384" if quick else "16384,65536", "--repeats", "3" if quick else "5",
                             "--warmup", "2"))


def train_dtype(device: str) -> str:
    """bf16 on a GPU; fp32 on the CPU (bf16 matmuls are slow on CPUs without AVX-512 bf16 / AMX)."""
    return "fp32" if device == "cpu" else "bf16"


def common_overrides(device: str, work: str) -> list[str]:
    """One process, the committed corpus, nothing saved, plotted or evaluated along the way."""
    return ["parallel.ep=1", f"run.device={device}", f"train.dtype={train_dtype(device)}", f"data.corpus={CORPUS}",
            f"data.cache_dir={os.path.join(work, 'data_cache')}", "data.val_fraction=0.2", "train.warmup_steps=2",
            "eval.every=0", "eval.probe_every=0", "ckpt.every=0", "ckpt.save_final=false", "run.plots=false",
            "run.tensorboard=false", "run.progress=false", "run.print_every=5"]
