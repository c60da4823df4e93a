"""A Hugging Face MoE checkpoint (the families of :mod:`moe_dist.hf.architectures`) read block
by block under our names.

Per block: the attention part (:class:`~moe_dist.hf.checkpoint.HFCheckpoint`), the router
``ffn.router.weight`` ``[E, d]`` (the same layout as theirs) and the experts stacked by global
expert into our grouped layout, ``ffn.experts.w1`` / ``w3`` ``[E, d, ff]`` (gate, up) and
``ffn.experts.w2`` ``[E, ff, d]`` (down), i.e. each expert's ``nn.Linear`` weight transposed.
Checkpoints store one tensor per expert and projection (``...experts.{j}.w1.weight``), which
is also what transformers writes by default, or the fused layout transformers holds in memory
(and writes with ``save_original_format=False``): ``...mlp.experts.gate_up_proj`` ``[E, 2 ff, d]``
(each expert's gate rows, then its up rows) and ``...mlp.experts.down_proj`` ``[E, d, ff]``,
with the router at ``...mlp.gate.weight`` (Mixtral's ``block_sparse_moe`` is ``mlp`` there). A
checkpoint holding any ``gate_up_proj`` is read in the fused layout. Every tensor's shape is
checked against config.json.
Qwen2-MoE adds the shared expert (``ffn.shared_expert.w1/w3/w2.weight``, ``nn.Linear`` layout, and
``ffn.shared_expert_gate.weight`` ``[1, d]``) and dense blocks (``ffn.w1/w3/w2.weight``).
"""
from __future__ import annotations

from typing import Iterator

import torch

from .architectures import MOE_ARCHITECTURES, MoEArchitecture
from .checkpoint import HFCheckpoint
from .config import MOE_FAMILIES, HFFormatError


class MoECheckpoint(HFCheckpoint):
    """``MoECheckpoint(dir)``: config + lazily read weights of a Mixtral / OLMoE / Qwen2-MoE checkpoint."""

    def __init__(self, directory: str):
        super().__init__(directory, MOE_FAMILIES, "`moe-dist import`", "a dense checkpoint is read by `moe-dist upcycle`")
        self.arch: MoEArchitecture = MOE_ARCHITECTURES[self.family]
        self.fused = any(name.endswith(".experts.gate_up_proj") for name in self.weights.keys())
        archs = self.spec.raw.get("architectures")
        if archs and self.arch.causal_lm not in archs:
            raise HFFormatError(f"{directory}/config.json: architectures={archs} is not supported; `moe-dist import` "
                                f"reads model_type={self.family!r} as {self.arch.causal_lm!r}")

    def router(self, i: int) -> torch.Tensor:
        m = self.spec.model
        return self.tensor(self.arch.router_name(self.prefix, i, self.fused), (m["moe"]["num_experts"], m["d_model"]))

    def experts(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block ``i``'s experts in our layout ``(w1 [E, d, ff], w3 [E, d, ff], w2 [E, ff, d])``."""
        m = self.spec.model
        E, d, ff = m["moe"]["num_experts"], m["d_model"], m["moe"]["d_ff"] or m["d_ff"]
        if self.fused:
            gate_up_name, down_name = self.arch.fused_expert_names(self.prefix, i)
            gate_up = self.tensor(gate_up_name, (E, 2 * ff, d), " (transformers' fused layout: [experts, gate rows "
                                  "then up rows, hidden])")
            down = self.tensor(down_name, (E, d, ff), " (transformers' fused layout: [experts, hidden, intermediate])")
            gate, up = gate_up.split([ff, ff], dim=1)
            return tuple(t.transpose(1, 2).contiguous() for t in (gate, up, down))
        shapes = ((ff, d), (ff, d), (d, ff))  # gate, up, down as nn.Linear weights
        stacked = []
        for which in range(3):
            rows = [self.tensor(self.arch.expert_name(self.prefix, i, j, which), shapes[which]) for j in range(E)]
            stacked.append(torch.stack(rows).transpose(1, 2).contiguous())
        return stacked[0], stacked[1], stacked[2]

    def _linears(self, name, ff: int) -> dict[str, torch.Tensor]:
        """A SwiGLU MLP's (gate, up, down) ``nn.Linear`` weights as ``w1`` / ``w3`` / ``w2``; ``name(which)``
        gives the checkpoint name of each."""
        d = self.spec.model["d_model"]
        shapes = ((ff, d), (ff, d), (d, ff))
        return {f"{ours}.weight": self.tensor(name(which), shapes[which]) for which, ours in enumerate(("w1", "w3", "w2"))}

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block ``i`` under our names relative to the block."""
        m = self.spec.model
        out = self.attention(i)
        layers = m["moe"]["layers"]
        if layers != "every" and i not in layers:  # a dense block (Qwen2-MoE's mlp_only_layers / sparse step)
            dense = self._linears(lambda which: self.arch.dense_name(self.prefix, i, which), m["d_ff"])
            out.update({f"ffn.{k}": v for k, v in dense.items()})
            return out
        w1, w3, w2 = self.experts(i)
        out.update({"ffn.router.weight": self.router(i), "ffn.experts.w1": w1, "ffn.experts.w3": w3,
                    "ffn.experts.w2": w2})
        if m["moe"].get("shared_d_ff"):
            shared = self._linears(lambda which: self.arch.shared_name(self.prefix, i, which), m["moe"]["shared_d_ff"])
            out.update({f"ffn.shared_expert.{k}": v for k, v in shared.items()})
            out["ffn.shared_expert_gate.weight"] = self.tensor(self.arch.shared_gate_name(self.prefix, i),
                                                               (1, m["d_model"]))
        return out

    def _read_all(self):
        return self.tensors()

    def _describe_ffn(self) -> str:
        moe = self.spec.model["moe"]
        return f", {self.arch.experts_key}={moe['num_experts']}"

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(our name, tensor)`` of the whole model, one block at a time, in the checkpoint's dtype
        (a tied output projection is not repeated)."""
        yield "embed.weight", self.embedding()
        for i in range(self.spec.model["n_layers"]):
            for name, t in self.block(i).items():
                yield f"blocks.{i}.{name}", t
            self.weights.close()  # unmap what this block read
        yield "norm.weight", self.final_norm()
        head = self.lm_head()
        if head is not None:
            yield "lm_head.weight", head
