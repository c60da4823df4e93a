"""MoE routing statistics over a step's micro-batches: each MoE layer's counts, drops, losses and
router figures summed on the device while the step runs and read to the host once per logged step."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ...distributed.collectives import all_reduce_sum
from ...moe import MoELayer
from ...moe.routing.layer_stats import spans_summary

STANDARD_STATS = ("expert_counts", "dropped_fraction", "aux_loss", "z_loss", "entropy", "tokens", "capacity")


def read_tensors(values: list) -> list:
    """Host values of ``values`` (tensors, or plain numbers passed through) with ONE read per
    device: the tensors of a device are flattened into one float64 tensor and read with a single
    ``tolist()``. Each tensor comes back as a float (one element) or a list (integer tensors as ints)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            by_device.setdefault(v.device, []).append(i)
    out = list(values)
    for positions in by_device.values():
        flat = torch.cat([values[i].detach().reshape(-1).double() for i in positions]).tolist()
        pos = 0
        for i in positions:
            v = values[i]
            part, pos = flat[pos:pos + v.numel()], pos + v.numel()
            if not (v.dtype.is_floating_point or v.dtype.is_complex):
                part = [int(x) for x in part]
            out[i] = part if v.numel() != 1 else float(part[0])
    return out


class MoEStepStats:
    """Sums per-expert counts and drops, averages losses and entropy, over one step's micro-batches,
    for every MoE layer (keyed by its block index). The layer statistics are already global
    (identical on every rank); router extras a router lists in ``local_extras`` are figures of
    this rank's tokens and are reduced over the ranks in :meth:`summary`.

    :meth:`add` (once per micro-batch) only adds device tensors: no host read. :meth:`summary`
    (once per logged step) reads everything with one device-to-host read (after the one
    all-reduce of the local extras)."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.reset()

    def reset(self) -> None:
        self._acc: dict[int, dict[str, Any]] = {}

    def add(self) -> None:
        """Record the layers' statistics of the forward pass that just ran (device tensors only)."""
        for layer in self.layers:
            s = layer.stats
            if s is None:
                continue
            acc = self._acc.setdefault(layer.context.layer_idx, {"n": 0, "rows": 0, "local": {}, "lists": set(),
                                                                  "sums": None})
            counts = s.expert_counts.detach().double().round()
            pairs = counts.sum()
            tokens = s.tokens.detach().double()
            # [counts (E), pairs, dropped pairs, aux, z, entropy * tokens, tokens]
            step = torch.cat([counts, torch.stack([pairs, s.dropped_fraction.detach().double() * pairs,
                                                   s.aux_loss.detach().double(), s.z_loss.detach().double(),
                                                   s.entropy.detach().double() * tokens, tokens])])
            acc["sums"] = step if acc["sums"] is None else acc["sums"] + step
            acc["n"] += 1
            local = layer.router.local_extras
            rows = 0 if layer.last_routing is None else int(layer.last_routing.expert_ids.shape[0])
            acc["rows"] += rows
            for key, mode in local.items():
                if key in s.extras:  # a mean: weighted by this rank's router rows; a sum: as it is
                    v = s.extras[key]
                    v = (v if torch.is_tensor(v) else torch.tensor(v, device="cpu")).detach().double().reshape(-1)
                    if v.numel() > 1:
                        acc["lists"].add(key)
                    v = v * (rows if mode == "mean" else 1)
                    prev = acc["local"].get(key)
                    acc["local"][key] = v if prev is None else prev + v
            acc["extras"] = {k: v for k, v in s.extras.items() if k not in STANDARD_STATS and k not in local}
            if s.capacity is not None:
                acc["capacity"] = s.capacity
            if s.group_spans is not None:  # node-limited routing: tokens per number of groups they reach
                spans = s.group_spans.detach().double()
                acc["spans"] = spans if acc.get("spans") is None else acc["spans"] + spans

    def _reduce_local(self, group, device) -> Optional[torch.Tensor]:
        """``[rows of each layer, then every layer's local_extras values]`` summed over ``group``
        (the ranks holding distinct tokens), still on the device; None when no router has local
        extras. One all-reduce; every rank of ``group`` calls it."""
        idxs = sorted(self._acc)
        keys = [(i, k) for i in idxs for k in sorted(self._acc[i]["local"])]
        if not keys:
            return None
        parts = [torch.tensor([float(self._acc[i]["rows"]) for i in idxs], dtype=torch.float64, device="cpu")]
        parts += [self._acc[i]["local"][k] for i, k in keys]
        dev = device if device is not None else parts[-1].device
        return all_reduce_sum(torch.cat([p.to(dev) for p in parts]), group)

    def _local_figures(self, total: list) -> dict[int, dict[str, Any]]:
        idxs = sorted(self._acc)
        rows, pos, out = dict(zip(idxs, total[:len(idxs)])), len(idxs), {}
        for i in idxs:
            layer = next(m for m in self.layers if m.context.layer_idx == i)
            for k in sorted(self._acc[i]["local"]):
                n = self._acc[i]["local"][k].numel()
                vals, pos = total[pos:pos + n], pos + n
                if layer.router.local_extras[k] == "mean":
                    vals = [v / max(rows[i], 1.0) for v in vals]
                out.setdefault(i, {})[k] = vals if k in self._acc[i]["lists"] else vals[0]
        return out

    def summary(self, group=None, device=None) -> dict[str, dict]:
        """Per-layer figures of the step: one device-to-host read for all of them. Collective
        over ``group`` when a router has ``local_extras`` (every rank calls it)."""
        reduced = self._reduce_local(group, device)
        idxs = [m.context.layer_idx for m in self.layers if m.context.layer_idx in self._acc]
        values = [reduced] + [self._acc[i]["sums"] for i in idxs]
        values += [self._acc[i].get("capacity") for i in idxs]
        values += [self._acc[i].get("spans") for i in idxs]
        extras_keys = [(i, k) for i in idxs for k in self._acc[i].get("extras", {})]
        values += [self._acc[i]["extras"][k] for i, k in extras_keys]
        host = read_tensors(values)
        local = self._local_figures(host[0] if isinstance(host[0], list) else [host[0]]) if reduced is not None else {}
        sums = dict(zip(idxs, host[1:1 + len(idxs)]))
        capacity = dict(zip(idxs, host[1 + len(idxs):1 + 2 * len(idxs)]))
        spans = dict(zip(idxs, host[1 + 2 * len(idxs):1 + 3 * len(idxs)]))
        extras: dict[int, dict] = {}
        for (i, k), v in zip(extras_keys, host[1 + 3 * len(idxs):]):
            extras.setdefault(i, {})[k] = v
        out = {}
        for layer in self.layers:
            idx = layer.context.layer_idx
            if idx not in sums:
                continue
            n, num_experts = self._acc[idx]["n"], layer.num_experts
            figs = sums[idx]
            pairs, dropped, aux, z, ent_tokens, tokens = figs[num_experts:]
            row = {
                "expert_counts": [int(c) for c in figs[:num_experts]],
                "dropped_fraction": dropped / max(pairs, 1),
                "aux_loss": aux / n,
                "z_loss": z / n,
                "entropy": ent_tokens / max(tokens, 1),
            }
            if capacity[idx] is not None:
                row["capacity"] = int(capacity[idx])
            if spans[idx] is not None:
                row.update(spans_summary(spans[idx] if isinstance(spans[idx], list) else [spans[idx]]))
            row.update(extras.get(idx, {}))
            row.update(local.get(idx, {}))
            row.update(_plain(layer.extra_metrics()))  # router figures, expert bias
            out[str(idx)] = row
        return out


def _plain(d: dict) -> dict:
    """JSON-friendly values (tensors become numbers or lists)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        out[k] = v
    return out
