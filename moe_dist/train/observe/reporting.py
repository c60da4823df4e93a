"""What a training run tells its user, on rank 0: its log lines (through the progress bar when one
shows), run.json at the start, the per-step progress, and at the end summary.json, the plots and
the end-of-run summary (validation against the unigram baseline, routing, W&B).

The per-step rows themselves are :mod:`moe_dist.train.observe.row` (metrics.jsonl, TensorBoard and
W&B: :mod:`moe_dist.train.observe.metrics`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
import time
from typing import Optional

import torch

from ...config import Config
from ...data import PreparedData
from ...diagnostics import RoutingDiagnostics, format_routing_summary, routing_summary
from ...distributed.bootstrap import Runtime
from ...hardware import cuda_memory_gib
from ...moe.dispatch.hierarchical import dispatch_note
from ...safe_io import write_json_atomically
from ..evaluation.validation import format_report
from ..setup.data import small_corpus_note
from ..setup.runtime import gather_peak_rss_gib, thread_choice
from .metrics import read_metrics
from .step_time import describe_time


@dataclasses.dataclass
class RunTotals:
    """This run's running figures (one process's clock): tokens seen since step 0, the steps this
    run trained and their all-to-all bytes, for the step rows and summary.json."""

    tokens: int  # a resumed run counts from its checkpoint's step
    started: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0
    a2a_bytes: list = dataclasses.field(default_factory=lambda: [0, 0])  # [intra, inter] summed over the steps
    wall: Optional[float] = None  # seconds from start to end, once :meth:`end` is called

    def add(self, row: dict, step_tokens: int) -> None:
        self.tokens += step_tokens
        self.a2a_bytes[0] += row["a2a_intra_bytes"]
        self.a2a_bytes[1] += row["a2a_inter_bytes"]
        self.steps += 1

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def end(self) -> float:
        self.wall = self.elapsed()
        return self.wall


class RunReport:
    """Rank 0's account of a run (other ranks' calls do nothing, except the collective
    :meth:`summary`)."""

    def __init__(self, cfg: Config, rt: Runtime, run_dir: str):
        self.cfg, self.rt, self.run_dir = cfg, rt, run_dir
        self.is_main = rt.is_main
        self._bar = None

    def log(self, msg: str) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def write_run_info(self, dense_layout: str, params: dict, data: PreparedData) -> None:
        """run.json: where and how the run trains (rank 0)."""
        info = {
            "world_size": self.rt.world_size, "ep": self.rt.groups.ep_size, "dense": dense_layout,
            "launcher": self.rt.launch.launcher, "backend": self.rt.backend, "device": str(self.rt.device),
            "threads_per_process": torch.get_num_threads(), "parameters": params,
            "data": {"directory": data.directory, "source": data.manifest["source"],
                     "tokenizer_sha256": data.manifest["tokenizer"]["sha256"],
                     "token_count": data.manifest["token_count"]},
            "torch": torch.__version__, "python": platform.python_version(),
        }
        write_json_atomically(os.path.join(self.run_dir, "run.json"), info, indent=2)

    def describe_start(self, params: dict, moe_layers: int, dense_layout: str, data: PreparedData) -> None:
        """The model, the parallel layout and the data the loop is about to train with, and the
        warnings about them."""
        cfg, rt = self.cfg, self.rt
        moe = cfg.model.moe
        self.log(f"model: {params['total'] / 1e6:.2f}M parameters ({params['active'] / 1e6:.2f}M active per "
                 f"token), {moe_layers} MoE layers x {moe.num_experts} experts, top-{moe.top_k}, "
                 f"router {moe.router}")
        over = f" over {rt.socket_interface}" if rt.socket_interface else ""  # this host's interface
        dispatch = dispatch_note(rt.groups)  # parallel.dispatch: hierarchical (or why it fell back)
        self.log(f"parallel: {rt.world_size} process(es) [{rt.launch.launcher}, {rt.backend or 'no backend'}{over}, "
                 f"{rt.device}, {torch.get_num_threads()} thread(s) each from "
                 f"{thread_choice(cfg.run.threads, rt.launch.local_world_size)[1]}], ep={rt.groups.ep_size}"
                 f"{' (parallel.ep=auto)' if cfg.parallel.ep == 'auto' else ''}, "
                 f"{dispatch + ', ' if dispatch else ''}"
                 f"dense={dense_layout}; data: "
                 f"{data.train_tokens:,} train tokens, {cfg.train.global_batch}x{cfg.train.seq_len} tokens per step")
        node_limit = moe.node_limit_warning(rt.groups.ep_nodes)
        if node_limit:
            self.log(node_limit)
        small = small_corpus_note(data.train_tokens, cfg.train.global_batch, cfg.train.seq_len, cfg.train.steps)
        if small:
            self.log(small)

    @contextlib.contextmanager
    def progress(self):
        """``run.progress``: a progress bar over the training steps while the block runs (rank 0); log
        lines go through it meanwhile."""
        mode = self.cfg.run.progress
        if self.is_main and (mode is True or (mode == "auto" and sys.stderr.isatty())):
            from tqdm import tqdm

            self._bar = tqdm(total=self.cfg.train.steps, desc="train", unit="step", dynamic_ncols=True, leave=True)
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def step_done(self, step: int, row: dict, last: bool) -> None:
        """The progress bar moves on, or every ``run.print_every`` steps a line."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
        elif step % self.cfg.run.print_every == 0 or step == 1 or last:
            self.log(f"step {step}/{self.cfg.train.steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                     f"grad_norm {row['grad_norm']:.3f}  {row['tokens_per_s']:.0f} tok/s  "
                     f"{row['elapsed_s']:.0f}s")

    def summary(self, step: int, train_loss: Optional[float], val: dict, baseline: dict, totals: RunTotals,
                params: dict, health, compiled: Optional[list] = None, compile_clock=None) -> dict:
        """The run's summary (summary.json; collective: every rank's peak memory). ``health``: the
        run's :class:`~moe_dist.train.loop.health.RunHealth`."""
        wall = totals.end()
        steps_run, a2a = totals.steps, totals.a2a_bytes
        summary = {"steps": step, "train_loss": train_loss, "val_loss": val["loss"], "val_ppl": val["ppl"],
                   "unigram_loss": baseline["loss"], "unigram_ppl": baseline["ppl"], "val_tokens": val["tokens"],
                   "train_seconds": round(wall, 1), "tokens": totals.tokens, "parameters": params,
                   "skipped_steps": health.skipped_steps, "rollbacks": health.rollbacks,
                   # all-to-all bytes sent per step, summed over the ranks (None: no step trained in this run)
                   "a2a_intra_bytes_per_step": a2a[0] / steps_run if steps_run else None,
                   "a2a_inter_bytes_per_step": a2a[1] / steps_run if steps_run else None,
                   "peak_rss_gib": gather_peak_rss_gib(self.rt),  # every rank's, in order
                   **cuda_memory_gib(self.rt.device)}  # rank 0's
        if compile_clock is not None:  # this process's graphs and seconds spent compiling
            summary["compile"] = {"parts": len(compiled), **compile_clock.report()}
        return summary

    def finish(self, summary: dict, totals: RunTotals, val: dict, baseline: dict, diagnostics: RoutingDiagnostics,
               model: torch.nn.Module, tracker=None) -> None:
        """summary.json, the plots (``run.plots``) and the end-of-run lines (rank 0); metrics.jsonl
        must be complete (the routing summary reads it)."""
        if not self.is_main:
            return
        write_json_atomically(os.path.join(self.run_dir, "summary.json"), summary, indent=2)
        if self.cfg.run.plots:
            from .plots import make_plots

            make_plots(self.run_dir, baseline_loss=baseline["loss"])
            diagnostics.record_graphs(model)  # expert_load.png above covers the load heatmap
            diagnostics.write_pngs(os.path.join(self.run_dir, "plots"), include=("fluctuation", "graph"))
        self.log(f"done: {summary['steps']} steps in {totals.wall:.0f}s; run directory {self.run_dir}")
        self.log(format_report(val, baseline))
        if summary.get("time"):
            self.log(describe_time(summary["time"]))
        routing = routing_summary(read_metrics(os.path.join(self.run_dir, "metrics.jsonl")))
        if tracker is not None:
            tracker.summary(summary, routing)
        self.log(format_routing_summary(routing))
