"""One optimizer step: the micro-batches' forward and backward, then reduce, clip and update.

Each rank's loss is its *share* of the step's global loss (sum of its token losses / tokens in the
global step, plus its share of the MoE auxiliary losses / grad_accum), gradients are summed over
ranks, so any number of ranks computes what one process computes on the whole batch. The trainer
runs it every step; ``moe-dist plan --dry-run`` runs the same step on fake tensors.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.bootstrap import Runtime
from ...distributed.ranges import COLLECTIVE, OPTIMIZER, timed_range
from ...hardware import batch_to_device
from ...moe import collect_aux_loss, moe_layers
from ...moe.dispatch.traffic import take_traffic
from ..evaluation.validation import autocast
from ..observe.moe_stats import MoEStepStats
from .optim import lr_at, set_lr


class TrainStep:
    """The step of ``engine`` on ``model`` (``train``: the config's ``train`` section)."""

    def __init__(self, train, rt: Runtime, engine, model: nn.Module, moe_stats: MoEStepStats):
        self.cfg, self.rt, self.engine, self.model, self.moe_stats = train, rt, engine, model, moe_stats
        self.moe = moe_layers(model)

    def _set_context(self, step: int, micro_step: int) -> None:
        for layer in self.moe:
            ctx = layer.context
            ctx.step, ctx.micro_step, ctx.seed = step, micro_step, self.cfg.seed

    def __call__(self, step: int, micro_batches: Sequence[torch.Tensor],
                 is_spike: Callable[[float], bool] = lambda loss: False) -> dict:
        """Optimizer step ``step`` (0-based) on ``micro_batches``; ``is_spike(loss)``: whether a finite
        loss is a spike that must not be applied. Host reads of the step itself: the gradient norm
        (``update``) and the summed losses (one ``tolist`` of a small tensor, with the step's
        all-to-all bytes, which the MoE layers count on the host and ride on the losses'
        all-reduce), once per step; per micro-batch only the MoE layers' own (one per layer forward,
        see ``MoELayer.forward``). Statistics stay on the device (``MoEStepStats.add``) until a
        logged step reads them."""
        cfg, dev = self.cfg, self.rt.device
        lr = lr_at(step, cfg)
        set_lr(self.engine.optimizer, lr)
        step_tokens = cfg.global_batch * cfg.seq_len
        # [LM loss sum, aux loss share, NaN router logits?, a2a bytes sent intra-node, inter-node]
        sums = torch.zeros(5, dtype=torch.float64, device=dev)
        self.moe_stats.reset()
        for layer in self.moe:  # NaN router logits counted by evaluation forwards are not this step's
            layer.take_nonfinite_logits()
        take_traffic(layer.traffic for layer in self.moe)  # nor the bytes their exchanges sent
        for m, batch in enumerate(micro_batches):
            self._set_context(step, m)
            self.engine.set_gradient_sync(m == len(micro_batches) - 1)
            x = batch_to_device(batch, dev)
            with autocast(dev, cfg.dtype):
                logits = self.engine.forward(x[:, :-1])
            lm_sum = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            del logits  # backward does not read them: [tokens, vocab] freed before it, not after the next forward
            aux = collect_aux_loss(self.model).to(dev) / len(micro_batches)
            self.engine.backward(lm_sum / step_tokens + aux)
            self.moe_stats.add()
            sums[:2] += torch.stack([lm_sum.detach().double(), aux.detach().double()])
        router_bad = {layer.context.layer_idx: bad for layer in self.moe if (bad := layer.take_nonfinite_logits())}
        sums[2] = float(bool(router_bad))  # the layers' counts are global already; the all-reduce makes it certain
        traffic = take_traffic(layer.traffic for layer in self.moe)  # host integers, exact in float64
        sums[3], sums[4] = float(traffic.intra), float(traffic.inter)  # fills: no tensor made on the default device
        if self.rt.distributed:
            with timed_range(COLLECTIVE):
                dist.all_reduce(sums, group=self.rt.groups.dp)
        lm_total, aux_total, router_flag, intra, inter = sums.tolist()  # the step's one read of the losses
        loss = lm_total / step_tokens
        spike = math.isfinite(loss) and is_spike(loss)
        # reduce, clip, update; a step whose global loss or gradient norm is not finite, whose router
        # logits were not, or whose loss spiked is not applied
        with timed_range(OPTIMIZER):
            grad_norm = self.engine.step(loss_finite=math.isfinite(lm_total) and math.isfinite(aux_total)
                                         and not router_flag and not spike)
            skipped = self.engine.skipped
            self.engine.zero_grad()
            for layer in self.moe:  # the router's per-step state and the expert bias; a skipped step's counts are dropped
                if skipped:
                    layer.discard_step()
                else:
                    layer.after_optimizer_step()
        row = {"loss": loss, "aux_loss": aux_total, "lr": lr, "grad_norm": grad_norm,
               "a2a_intra_bytes": int(intra), "a2a_inter_bytes": int(inter)}
        if skipped:
            row["skipped"] = True
        if spike:
            row["spike"] = True
        if router_flag:
            row["router_nonfinite"] = router_bad or True
        return row
