"""The job's runtime for training and evaluation: the process group (:func:`setup_runtime`),
torch's threads per process, the bf16 choice made once for the job, and every rank's peak memory."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from ...config import Config
from ...distributed.bootstrap import Runtime, init_distributed, shutdown
from ...exits import end_process
from ...hardware import peak_rss_bytes
from ...tuning.bf16 import bf16_choice, probe_shape

# set by `moe-dist ... --nproc N` when the user had no OMP_NUM_THREADS: the launcher's value is then
# the default (cores / local processes), not the user's choice
THREADS_DEFAULTED = "MOE_DIST_THREADS_DEFAULTED"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_choice(run_threads: Optional[int], local_world_size: int, env=os.environ) -> tuple[int, str]:
    """``(torch threads per process, why)``: ``run.threads`` if set, else the user's
    ``OMP_NUM_THREADS`` (a positive integer), else the cores this process may use / local processes."""
    if run_threads:
        return run_threads, "run.threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1 and env.get(THREADS_DEFAULTED) != "1":
        return int(omp), "OMP_NUM_THREADS"
    cores, local = _cores(), max(1, local_world_size)
    return max(1, cores // local), f"{cores} core(s) / {local} local process(es)"


def _probe_shape(cfg, world_size: int) -> tuple[int, int, int]:
    """A matmul of the model's size for the bf16 probe: one rank's tokens of a micro-batch by the
    feed-forward weight."""
    rows = max(1, cfg.train.global_batch // cfg.train.grad_accum // world_size) * cfg.train.seq_len
    return probe_shape(rows, cfg.model.d_model, cfg.model.moe.d_ff or cfg.model.d_ff)


def _largest_over_ranks(rt: Runtime):
    """The largest of every rank's figure (the same on every rank after it): a choice each rank
    measures is made once for the job."""
    def agree(value: float) -> float:
        if not rt.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())
    return agree


_SAID: set[str] = set()  # the dtype notes this process printed


def setup_runtime(cfg: Config, rt: Optional[Runtime] = None, choose_dtype: bool = True) -> Runtime:
    """The job's runtime (``rt``, or a new one), checked against the config's rules that need the
    number of processes. A new runtime that fails a check is shut down before the error leaves.
    ``choose_dtype``: run bf16 as fp32 where this CPU's bf16 matmuls are slow (a timed probe); a dry
    run, which plays a rank of a GPU job, keeps the config's dtype untimed."""
    owns = rt is None
    if owns:
        rt = init_distributed(cfg.expert_parallel_size, cfg.model.moe.num_experts, backend=cfg.parallel.backend,
                              device=cfg.run.device, timeout_s=cfg.parallel.timeout_s,
                              ranks_per_node=cfg.parallel.ranks_per_node, dispatch=cfg.parallel.dispatch,
                              heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s,
                              on_lost_peer=lambda line: end_process(line, kind="lost_peer"))
    try:
        cfg.check_world(rt.world_size)
        torch.set_num_threads(thread_choice(cfg.run.threads, rt.launch.local_world_size)[0])
        note = None
        if choose_dtype:
            cfg.train.dtype, note = bf16_choice(rt.device, cfg.train.dtype, cfg.train.bf16_on_slow_cpu,
                                                _probe_shape(cfg, rt.world_size), _largest_over_ranks(rt))
    except BaseException:
        if owns:
            shutdown(rt)  # while the error propagates: no meeting of the ranks, the group destroyed now
        raise
    if note and rt.is_main and note not in _SAID:  # a runtime passed on is checked again: said once
        _SAID.add(note)
        print(note, flush=True)
    return rt


def gather_peak_rss(rt: Runtime) -> list[int]:
    """Every rank's peak resident memory (bytes), in rank order (collective)."""
    mine = peak_rss_bytes()
    if not rt.distributed:
        return [mine]
    out = [0] * rt.world_size
    dist.all_gather_object(out, mine)
    return out


def gather_peak_rss_gib(rt: Runtime) -> list[float]:
    """:func:`gather_peak_rss` in GiB (3 decimals), as summary.json and eval results report it."""
    return [round(b / 2**30, 3) for b in gather_peak_rss(rt)]
