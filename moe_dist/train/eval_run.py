"""``moe-dist eval``'s work: the validation perplexity of a saved model (a training checkpoint or
a safetensors model directory) next to the unigram baseline's, at any world size and ep."""
from __future__ import annotations

import os
from typing import Optional

from ..config import Config
from ..distributed.bootstrap import Runtime, shutdown
from ..errors import CheckpointError, MissingInputError
from ..hardware import map_large_allocations
from ..safe_io import write_json_atomically
from ..tuning.attention import decide_attention_dtype
from .checkpoint import latest_checkpoint, load_checkpoint
from .data_setup import load_data, resolve_vocab
from .evaluate import evaluate, format_report, unigram_baseline, validation_batches
from .model_setup import build_meta_model, check_weights_directory, is_weights_directory, weights_filler
from ..parallel.parallelize import parallelize
from .runtime import gather_peak_rss_gib, setup_runtime


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
