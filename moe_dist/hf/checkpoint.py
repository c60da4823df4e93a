"""A Hugging Face decoder checkpoint read tensor by tensor, with names and layouts translated
into our decoder's: what dense and MoE checkpoints share (embedding, attention, norms, head).

Our names: ``embed.weight``, ``blocks.{i}.attn_norm.weight``, ``blocks.{i}.attn.w{q,k,v,o}.weight``
(+ ``.bias`` for q/k/v with ``model.qkv_bias``, + ``attn.q_norm`` / ``attn.k_norm`` with
``model.qk_norm``), ``blocks.{i}.ffn_norm.weight``, ``norm.weight``, ``lm_head.weight``. All
projections stay in ``nn.Linear`` layout ``[out, in]``. Phi-3 fuses q/k/v into ``qkv_proj``
(rows: queries, keys, values); it is split here. Every tensor's shape is checked against what
config.json implies. The feed-forward part is read by :class:`~moe_dist.hf.dense.DenseCheckpoint`
or :class:`~moe_dist.hf.moe_checkpoint.MoECheckpoint`.

:meth:`HFCheckpoint.check_explained` runs the whole reader over the file headers only (tensors on
the meta device) before anything is written: every tensor config.json implies is there with its
shape, and the checkpoint holds no tensor the config does not explain (a ninth expert when the
config says eight). Rotary ``inv_freq`` buffers (recomputed) and the stored ``lm_head.weight`` of a
tied model (the output projection is the embedding) are the tensors not read.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..weights import SafetensorsCheckpoint
from .config import HFFormatError, HFModelSpec, hf_model_spec, read_hf_config


class HFCheckpoint:
    """``HFCheckpoint(dir, families, reader, other)``: config + lazily read weights of a decoder
    checkpoint whose ``model_type`` is one of ``families`` (for the error: ``reader`` names the
    command that reads them, ``other`` the one that reads the rest)."""

    def __init__(self, directory: str, families: tuple[str, ...], reader: str, other: str):
        self.directory = directory
        self.spec: HFModelSpec = hf_model_spec(read_hf_config(directory), where=f"{directory}/config.json")
        if self.spec.family not in families:
            raise HFFormatError(f"{directory}: model_type={self.spec.family!r} cannot be read here; {reader} reads "
                                f"model_type in {list(families)} ({other})")
        self.weights = SafetensorsCheckpoint(directory)
        self.prefix = "model." if "model.embed_tokens.weight" in self.weights else ""
        if f"{self.prefix}embed_tokens.weight" not in self.weights:
            raise HFFormatError(f"{directory}: no 'model.embed_tokens.weight' in the checkpoint; is it a "
                                f"{self.spec.family} causal LM saved by transformers?")
        self._headers_only: Optional[set[str]] = None  # during check_explained: the names read so far

    @property
    def family(self) -> str:
        return self.spec.family

    def _describe(self) -> str:
        m = self.spec.model
        return (f"hidden_size={m['d_model']}, intermediate_size={m['d_ff']}, num_attention_heads={m['n_heads']}, "
                f"num_key_value_heads={m['n_kv_heads']}, vocab_size={m['vocab_size']}")

    def tensor(self, name: str, shape: tuple[int, ...], layout: str = "") -> torch.Tensor:
        """Tensor ``name`` (full checkpoint name), checked to have ``shape`` (``layout``: what its
        dimensions hold, for the error)."""
        actual = self.weights.shape(name)
        if actual != tuple(shape):
            raise HFFormatError(f"{self.directory}: tensor {name!r} has shape {list(actual)} but config.json "
                                f"({self._describe()}) implies {list(shape)}{layout}")
        if self._headers_only is not None:
            self._headers_only.add(name)
            return torch.empty(shape, device="meta")
        return self.weights.get(name)

    def _read_all(self) -> Iterable:  # pragma: no cover - abstract
        """Every tensor the reader takes from the checkpoint (subclasses: their whole model)."""
        raise NotImplementedError

    def check_explained(self) -> None:
        """Refuse a checkpoint missing a tensor config.json implies, holding one of another shape, or
        holding tensors the config does not explain (named, the first few); reads headers only."""
        self._headers_only = read = set()
        try:
            for _ in self._read_all():
                pass
        finally:
            self._headers_only = None
        if self.spec.model["tie_embeddings"]:
            read.add("lm_head.weight")
        extra = [k for k in self.weights.keys() if k not in read and not k.endswith("rotary_emb.inv_freq")]
        if extra:
            raise HFFormatError(f"{self.directory}: {len(extra)} tensor(s) that config.json ({self._describe()}"
                                f"{self._describe_ffn()}) does not explain, first {extra[:4]}; was config.json "
                                "edited, or are the weights of another model?")

    def _describe_ffn(self) -> str:
        return ""

    # ---- whole-model tensors --------------------------------------------------------------
    def embedding(self) -> torch.Tensor:
        m = self.spec.model
        return self.tensor(f"{self.prefix}embed_tokens.weight", (m["vocab_size"], m["d_model"]))

    def final_norm(self) -> torch.Tensor:
        return self.tensor(f"{self.prefix}norm.weight", (self.spec.model["d_model"],))

    def lm_head(self) -> Optional[torch.Tensor]:
        """The output projection, or None when it is tied to the embedding."""
        m = self.spec.model
        if m["tie_embeddings"]:
            return None
        if "lm_head.weight" not in self.weights:
            raise HFFormatError(f"{self.directory}: tie_word_embeddings is false but the checkpoint has no 'lm_head.weight'")
        return self.tensor("lm_head.weight", (m["vocab_size"], m["d_model"]))

    # ---- one block ----------------------------------------------------------------------
    def attention(self, i: int) -> dict[str, torch.Tensor]:
        """Block ``i``'s norms and attention under our names relative to the block."""
        m = self.spec.model
        d, hd = m["d_model"], self.spec.head_dim
        q_rows, kv_rows = m["n_heads"] * hd, m["n_kv_heads"] * hd
        p = f"{self.prefix}layers.{i}."
        out = {"attn_norm.weight": self.tensor(p + "input_layernorm.weight", (d,)),
               "ffn_norm.weight": self.tensor(p + "post_attention_layernorm.weight", (d,)),
               "attn.wo.weight": self.tensor(p + "self_attn.o_proj.weight", (d, q_rows))}
        if self.family == "phi3":
            qkv = self.tensor(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, d))
            out["attn.wq.weight"], out["attn.wk.weight"], out["attn.wv.weight"] = qkv.split([q_rows, kv_rows, kv_rows])
        else:
            for ours, theirs, rows in (("wq", "q_proj", q_rows), ("wk", "k_proj", kv_rows), ("wv", "v_proj", kv_rows)):
                out[f"attn.{ours}.weight"] = self.tensor(p + f"self_attn.{theirs}.weight", (rows, d))
                if m["qkv_bias"]:
                    out[f"attn.{ours}.bias"] = self.tensor(p + f"self_attn.{theirs}.bias", (rows,))
        if m.get("qk_norm", "none") == "projection":  # OLMoE: RMSNorm over the whole q and k projections
            out["attn.q_norm.weight"] = self.tensor(p + "self_attn.q_norm.weight", (q_rows,))
            out["attn.k_norm.weight"] = self.tensor(p + "self_attn.k_norm.weight", (kv_rows,))
        return {k: v.contiguous() for k, v in out.items()}
