"""Where a token-graph router sends each token's routing: the mixing weights of a trained run.

``python -m moe_dist.commands.graph_probe --run-dir DIR`` (:mod:`moe_dist.commands.graph_probe`) loads a run's latest checkpoint (a run of
the ``similarity`` or ``attention`` router), runs validation sequences through it and prints, per
MoE layer, what the token graph ``P = W R`` did:

- the mean weight a token puts on itself, on the previous token and on the sequence's first
  token (an attention sink would show there);
- the effective number of keys a token mixes over, ``exp(entropy)`` of its weight row;
- the share of tokens whose top-1 expert the mixing changed (``argmax P`` against ``argmax R``);
- the coefficient of variation of top-1 load before (``R``) and after (``P``) mixing;
- for the attention router, how many sequences chose each head.

This explains what the study's numbers cannot: a nearly diagonal graph (weight on itself near 1)
routes like its base router; a broad one pulls every token of a sequence towards one expert.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch
import torch.nn as nn

from ..moe import moe_layers
from ..moe.routers import graph_mixing, token_graph


def _load_cv(top1: torch.Tensor, num_experts: int) -> float:
    counts = torch.bincount(top1.flatten(), minlength=num_experts).float()
    return float(counts.std(unbiased=False) / counts.mean().clamp_min(1e-12))


class _LayerTally:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.sums = {"self": 0.0, "previous": 0.0, "first": 0.0, "effective_keys": 0.0}
        self.rows = {"self": 0, "previous": 0, "first": 0, "effective_keys": 0}
        self.base_top1, self.mixed_top1, self.heads = [], [], None

    def add(self, W: torch.Tensor, probs: torch.Tensor, mixed: torch.Tensor, key_mask: Optional[torch.Tensor]) -> None:
        B, S, _ = W.shape
        real = torch.ones(B, S, dtype=torch.bool) if key_mask is None else key_mask.cpu().bool()
        i = torch.arange(S)
        entropy = -(W * W.clamp_min(torch.finfo(torch.float32).tiny).log()).sum(-1)
        parts = {"self": (W[:, i, i], real), "effective_keys": (entropy.exp(), real),
                 "previous": (W[:, i[1:], i[:-1]], real[:, 1:]), "first": (W[:, 1:, 0], real[:, 1:])}
        for key, (values, mask) in parts.items():
            self.sums[key] += float(values[mask].sum())
            self.rows[key] += int(mask.sum())
        self.base_top1.append(probs.argmax(-1)[real])
        self.mixed_top1.append(mixed.argmax(-1)[real])

    def add_heads(self, counts: torch.Tensor) -> None:
        counts = counts.detach().cpu().long()
        self.heads = counts if self.heads is None else self.heads + counts

    def result(self) -> dict:
        base, mixed = torch.cat(self.base_top1), torch.cat(self.mixed_top1)
        out = {key: self.sums[key] / max(1, self.rows[key]) for key in self.sums}
        out.update(top1_changed=float((base != mixed).float().mean()), load_cv_base=_load_cv(base, self.num_experts),
                   load_cv_mixed=_load_cv(mixed, self.num_experts), tokens=int(base.numel()))
        if self.heads is not None:
            out["heads"] = self.heads.tolist()
        return out


@contextlib.contextmanager
def _observing(model: nn.Module):
    """Tallies per MoE layer while the model runs (each token-graph router's mixing steps, through
    its observer hook); yields the list of tallies."""
    layers = moe_layers(model)
    tallies = [_LayerTally(layer.num_experts) for layer in layers]
    undo = []
    for index, layer in enumerate(layers):
        def after(module, _args, _out, index=index):
            heads = (module.stats.extras or {}).get("selected_heads") if module.stats is not None else None
            if heads is not None:
                tallies[index].add_heads(heads)
        undo.append(layer.register_forward_hook(after).remove)

        def observe(*, probs, q, k, scale, prior, key_bias, key_mask, causal, mixed, entropy, index=index):
            W = graph_mixing.dense_graph_weights(q, k, scale, prior, key_bias, key_mask, causal, entropy).cpu()
            tallies[index].add(W, probs.detach().float().cpu(), mixed.detach().float().cpu(), key_mask)
        if isinstance(layer.router, token_graph.TokenGraphRouter):
            undo.append(layer.router.add_graph_observer(observe))
    try:
        yield tallies
    finally:
        for remove in undo:
            remove()


@torch.no_grad()
def probe_token_graph(model: nn.Module, batches: Iterable[torch.Tensor]) -> list[dict]:
    """Per MoE layer (in model order), the mixing statistics above over ``batches`` of token ids
    ``[B, S]`` (each row a whole sequence); layers whose router mixes nothing give ``None``."""
    was_training = model.training
    model.eval()
    try:
        with _observing(model) as tallies:
            for tokens in batches:
                model(tokens)
    finally:
        model.train(was_training)
    return [t.result() if t.base_top1 else None for t in tallies]


def format_probe(results: list[dict]) -> str:
    lines = ["layer  self  previous  first  effective keys  top-1 changed  top-1 load CV base -> mixed  heads"]
    for index, r in enumerate(results):
        if r is None:
            lines.append(f"{index:<5}  (no token-graph mixing)")
            continue
        heads = " ".join(str(c) for c in r["heads"]) if "heads" in r else "-"
        lines.append(f"{index:<5}  {r['self']:.3f} {r['previous']:9.3f} {r['first']:6.3f} {r['effective_keys']:15.1f} "
                     f"{r['top1_changed']:14.1%} {r['load_cv_base']:17.3f} -> {r['load_cv_mixed']:.3f}  {heads}")
    return "\n".join(lines)


def probe_run(cfg, rt, path: str, run_dir: str, json_path: Optional[str]) -> None:
    """Load the checkpoint at ``path`` into the run's model, probe its validation sequences, print
    the table (and write ``json_path``)."""
    import json

    from ..train.checkpoint import load_checkpoint
    from ..train.setup.data import load_data, resolve_vocab
    from ..train.evaluation.validation import validation_batches
    from ..train.setup.model import build_meta_model, weights_filler
    from ..parallel.parallelize import parallelize

    data = load_data(cfg, rt, lambda _msg: None)
    model = build_meta_model(cfg, resolve_vocab(cfg, data))
    parallelize(model, rt, cfg.parallel, fill=weights_filler(cfg, None), dtype=cfg.train.dtype)
    step = load_checkpoint(model, path).get("step")
    batches = [torch.as_tensor(b[:, :-1]).long() for b in validation_batches(data, cfg.train.seq_len, cfg.eval, 0, 1)]
    results = probe_token_graph(model, batches)
    print(f"{run_dir}: router {cfg.model.moe.router}, checkpoint step {step}, "
          f"{sum(b.shape[0] for b in batches)} sequences of {cfg.train.seq_len} tokens")
    print(format_probe(results))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"run_dir": run_dir, "step": step, "layers": results}, f, indent=2)
