"""A dense Hugging Face checkpoint (Llama / Mistral / Qwen2 / Phi-3) read tensor by tensor,
with names and layouts translated into our decoder's.

The shared part (embedding, attention, norms, head) is :class:`~moe_dist.hf.checkpoint.HFCheckpoint`'s;
here the dense FFN under our names ``blocks.{i}.ffn.w1`` (gate) / ``w3`` (up) / ``w2`` (down),
``nn.Linear`` layout ``[out, in]``. Phi-3 fuses gate/up into ``gate_up_proj`` (rows: gate, up);
it is split here. Every tensor's shape is checked against what config.json implies.
"""
from __future__ import annotations

import torch

from .checkpoint import HFCheckpoint
from .config import DENSE_FAMILIES


class DenseCheckpoint(HFCheckpoint):
    """``DenseCheckpoint(dir)``: config + lazily read weights of a dense decoder checkpoint."""

    def __init__(self, directory: str):
        super().__init__(directory, DENSE_FAMILIES, "upcycling", "an MoE checkpoint is read by `moe-dist import`")

    def ffn(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block ``i``'s feed-forward weights ``(gate [ff, d], up [ff, d], down [d, ff])``."""
        m = self.spec.model
        d, ff = m["d_model"], m["d_ff"]
        p = f"{self.prefix}layers.{i}.mlp."
        if self.family == "phi3":
            gate, up = self.tensor(p + "gate_up_proj.weight", (2 * ff, d)).split([ff, ff])
        else:
            gate, up = self.tensor(p + "gate_proj.weight", (ff, d)), self.tensor(p + "up_proj.weight", (ff, d))
        return gate.contiguous(), up.contiguous(), self.tensor(p + "down_proj.weight", (d, ff))

    def _read_all(self):
        """The whole dense model under our names: ``(name, tensor)`` pairs."""
        sd = {"embed.weight": self.embedding(), "norm.weight": self.final_norm()}
        head = self.lm_head()
        sd["lm_head.weight"] = sd["embed.weight"] if head is None else head
        for i in range(self.spec.model["n_layers"]):
            sd.update({f"blocks.{i}.{k}": v for k, v in self.attention(i).items()})
            gate, up, down = self.ffn(i)
            sd.update({f"blocks.{i}.ffn.w1.weight": gate, f"blocks.{i}.ffn.w3.weight": up,
                       f"blocks.{i}.ffn.w2.weight": down})
        return sd.items()
