"""What one finished run measured, read back from its run directory.

From ``summary.json``: validation perplexity (at the router's training-end k). From the
run's ``config.yaml``: parameters (total / active per token, at the k training ends with).
From ``metrics.jsonl`` (one row per logged step; after a resume the re-logged steps are
counted once): the median step time and tokens/s over the steps after the first, the
training time = steps x median step time (robust to a resume and to another run's
start-up), the validation perplexity over training, the routing fluctuation of the probe
set at each probe, and the load balance over the last quarter of the logged steps
(per-expert counts of each step's batch: coefficient of variation, max-load
ratio = max count / mean count, dead experts = experts that got no token in that step),
each averaged over the MoE layers. From ``eval_k.json``: validation perplexity per inference k.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Optional

from ..config import load_config
from ..model.params import count_params
from .spec import RunSpec

LOAD_KEYS = ("load_cv", "max_load_ratio", "dead_experts")
LOAD_TAIL = 0.25  # load balance: the last quarter of the logged steps


def read_json(path: str):
    """The JSON document at ``path``, or None when it is missing or not (yet) complete JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl rows by step (the last row of a step wins: a resumed run may log a step twice)."""
    by_step: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                by_step[int(row["step"])] = row
    except FileNotFoundError:
        return []
    return [by_step[s] for s in sorted(by_step)]


def _layer_mean(row: dict, key: str) -> Optional[float]:
    values = [v[key] for v in row.get("moe", {}).values() if isinstance(v, dict) and key in v]
    return sum(values) / len(values) if values else None


def load_balance(rows: list[dict]) -> dict[str, Optional[float]]:
    with_moe = [r for r in rows if r.get("moe")]
    tail = with_moe[int(len(with_moe) * (1 - LOAD_TAIL)):] if with_moe else []
    out = {}
    for key in LOAD_KEYS:
        values = [v for v in (_layer_mean(r, key) for r in tail) if v is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


def fluctuation(rows: list[dict]) -> list[dict]:
    """``[{step, top1, topk}]``: share of probe tokens whose top-1 expert / top-k set changed since
    the previous evaluation, averaged over the MoE layers."""
    out = []
    for r in rows:
        top1, topk = _layer_mean(r, "fluct_top1"), _layer_mean(r, "fluct_topk")
        if top1 is not None:
            out.append({"step": r["step"], "top1": top1, "topk": topk})
    return out


def collect_run(run: RunSpec, steps: int) -> dict:
    """The record of one run (``status``: done, incomplete or missing)."""
    d = run.run_dir
    summary = read_json(os.path.join(d, "summary.json"))
    rows = read_rows(os.path.join(d, "metrics.jsonl"))
    record = {"name": run.name, "router": run.router, "variant": run.variant, "seed": run.seed, "run_dir": d,
              "steps": steps}
    if summary is None or summary.get("steps", 0) < steps:
        record["status"] = "incomplete" if rows else "missing"
        record["last_step"] = rows[-1]["step"] if rows else 0
        return record
    timed = [r for r in rows if r["step"] > 1 and r.get("tokens_per_s")]  # step 1 includes warm-up
    tok_s = statistics.median(r["tokens_per_s"] for r in timed) if timed else None
    step_tokens = rows[-1]["tokens"] // rows[-1]["step"] if rows and rows[-1].get("tokens") else None
    step_s = step_tokens / tok_s if tok_s and step_tokens else None
    cpu = [r["cpu_s"] for r in timed if r.get("cpu_s") is not None]
    eval_k = read_json(os.path.join(d, "eval_k.json")) or []
    run_info = read_json(os.path.join(d, "run.json")) or {}
    # the config the run wrote (vocabulary resolved); active parameters at the k training ends with
    counts = count_params(load_config(os.path.join(d, "config.yaml")).model)
    record.update(
        status="done", val_ppl=summary["val_ppl"], val_loss=summary["val_loss"], unigram_ppl=summary["unigram_ppl"],
        train_loss=summary.get("train_loss"),
        parameters={key: counts[key] for key in ("total", "active")},
        tokens_per_s=tok_s, step_s=step_s, train_time_s=step_s * steps if step_s else None,
        cpu_step_s=statistics.median(cpu) if cpu else None,
        wall_s=summary.get("train_seconds"), threads=run_info.get("threads_per_process"),
        world_size=run_info.get("world_size"),
        val_curve=[{"step": r["step"], "ppl": r["val_ppl"]} for r in rows if "val_ppl" in r],
        fluctuation=fluctuation(rows), load=load_balance(rows),
        eval_k={str(r["k"]): r["val_ppl"] for r in eval_k if "k" in r and "val_ppl" in r},
    )
    return record
