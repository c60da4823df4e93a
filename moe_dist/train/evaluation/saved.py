"""``moe-dist eval``'s work: the validation perplexity of a saved model (a training checkpoint or
a safetensors model directory) next to the unigram baseline's, at any world size and ep, once or
once per inference k; the run directory read under its read lock."""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional

from ...config import Config
from ...distributed.bootstrap import Runtime, shutdown
from ...errors import CheckpointError, MissingInputError, UsageError
from ...hardware import map_large_allocations
from ...parallel.parallelize import parallelize
from ...safe_io import write_json_atomically
from ...tuning.attention import decide_attention_dtype
from ..checkpoint import latest_checkpoint, load_checkpoint
from ..setup.data import load_data, resolve_vocab
from ..setup.model import build_meta_model, check_weights_directory, is_weights_directory, weights_filler
from ..setup.run_lock import RunDirReadLock
from ..setup.runtime import gather_peak_rss_gib, setup_runtime
from .validation import evaluate, format_report, unigram_baseline, validation_batches


def evaluate_run(cfg: Config, checkpoint: Optional[str] = None, rt: Optional[Runtime] = None,
                 write_json: bool = True) -> dict:
    """Validation perplexity of a saved model next to the unigram baseline's (collective).

    ``checkpoint``: a training checkpoint directory (default: the latest complete one in
    ``run.dir``) or a safetensors model directory (``moe-dist upcycle`` / ``convert`` output),
    read rank-locally at any world size and ep. ``write_json``: write ``run.dir/eval.json``.
    """
    owns = rt is None
    rt = setup_runtime(cfg, rt)
    log = print if rt.is_main else (lambda _msg: None)
    if rt.device.type == "cpu":
        map_large_allocations()  # before the weights: freed gather buffers go back to the system
    try:
        path = checkpoint or latest_checkpoint(cfg.run.dir)
        if path is None:
            raise MissingInputError(f"no complete checkpoint under {os.path.join(cfg.run.dir, 'checkpoints')} (run.dir)")
        check_weights_directory(cfg, path)
        data = load_data(cfg, rt, log)
        vocab = resolve_vocab(cfg, data)
        model = build_meta_model(cfg, vocab)
        weights = is_weights_directory(path)
        parallelize(model, rt, cfg.parallel, fill=weights_filler(cfg, path if weights else None), dtype=cfg.train.dtype)
        meta = {"step": 0} if weights else load_checkpoint(model, path)
        if meta.get("tokenizer_sha256") not in (None, data.tokenizer.sha256):
            raise CheckpointError(f"{path} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]}...) than "
                             f"the data settings give now ({data.tokenizer.sha256[:12]}...); check the data.* keys")
        batches = validation_batches(data, cfg.train.seq_len, cfg.eval, rt.groups.dp_rank, rt.groups.dp_size)
        decision = decide_attention_dtype(model, cfg.train.attention_dtype, cfg.train.dtype,
                                          batches[0].shape[0] if batches else 1, cfg.train.seq_len,
                                          rt.device)  # as training does, at eval's batch
        if decision is not None:
            log(decision.describe())
        val = evaluate(model, batches, rt.device, cfg.train.dtype, rt.groups.dp)
        baseline = unigram_baseline(data, cfg.train.seq_len, cfg.eval)
        result = {"checkpoint": path, "step": meta.get("step"), "val_loss": val["loss"], "val_ppl": val["ppl"],
                  "unigram_loss": baseline["loss"], "unigram_ppl": baseline["ppl"], "val_tokens": val["tokens"],
                  "world_size": rt.world_size, "ep": rt.groups.ep_size,
                  "peak_rss_gib": gather_peak_rss_gib(rt)}
        if rt.is_main:
            if write_json:
                os.makedirs(cfg.run.dir, exist_ok=True)
                write_json_atomically(os.path.join(cfg.run.dir, "eval.json"), result, indent=2)
            log(f"checkpoint {path} (step {meta.get('step')}), {rt.world_size} process(es), ep={rt.groups.ep_size}, "
                f"peak memory per process {max(result['peak_rss_gib']):.2f} GiB")
            log(format_report(val, baseline))
        return result
    finally:
        if owns:
            shutdown(rt)


def evaluation_ep(trained_ep, world_size: int):
    """The expert-parallel size of an evaluation on ``world_size`` processes: the training's when it
    divides them, else ``auto``, the rule a training run continued on another layout follows
    (:mod:`moe_dist.config.layout`). Checkpoints are keyed by global expert, so they load at any
    expert-parallel size."""
    from ...config.layout import AUTO

    return trained_ep if trained_ep == AUTO or world_size % trained_ep == 0 else AUTO


def evaluation_world_size() -> int:
    """The number of processes of this evaluation: the process group's, else the launcher's environment's."""
    import torch.distributed as dist

    from ...distributed.bootstrap import detect_launch

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return detect_launch().world_size


def check_inference_k(router: str) -> None:
    """A usage error unless ``router`` has an inference k option (``eval_k``)."""
    from ...moe.routers import ROUTERS

    if not ROUTERS[router].has_inference_k:
        having = sorted(name for name, cls in ROUTERS.items() if cls.has_inference_k)
        raise UsageError(f"--k: router {router!r} has no inference k (routers with one: {', '.join(having)})")


@contextlib.contextmanager
def reading_run_dir(run_dir: Optional[str], rt: Runtime):
    """Hold the run directory's read lock while the ranks read it (rank 0 takes it for all): a run
    may train there meanwhile, but none starts, resumes or prunes checkpoints (see run_lock)."""
    from ..checkpoint.collective import broadcast

    lock = RunDirReadLock(run_dir) if run_dir and rt.is_main else None
    refusal = broadcast(lock.acquire() if lock else None, None)
    if refusal:
        raise UsageError(refusal)
    try:
        yield
    finally:
        if lock:
            lock.release()


def evaluate_per_k(config_for_k: Callable[[int], Config], ks: list[int], checkpoint: Optional[str], rt: Runtime,
                   run_dir: Optional[str]) -> list[dict]:
    """:func:`evaluate_run` once per inference k (``config_for_k(k)``: the config with
    ``model.moe.router_options.eval_k`` set); with ``run_dir`` each result goes to its eval.json and
    the list to ``run_dir/eval_k.json``. Rank 0 prints the table."""
    results = [{"k": k, **evaluate_run(config_for_k(k), checkpoint, rt, write_json=bool(run_dir))} for k in ks]
    if rt.is_main and run_dir:
        write_json_atomically(os.path.join(run_dir, "eval_k.json"), results, indent=2)
    if rt.is_main:
        print("k  val_ppl  (unigram_ppl)")
        for r in results:
            print(f"{r['k']:<2} {r['val_ppl']:8.2f}  ({r['unigram_ppl']:.2f})")
    return results
