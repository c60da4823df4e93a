"""Decoder-only language model (RMSNorm, RoPE, GQA via SDPA, SwiGLU) with MoE blocks."""
from .layers import Attention, RMSNorm, SwiGLU, apply_rotary, rotary_tables
from .transformer import Block, TransformerLM, build_model, count_parameters

__all__ = ["Attention", "RMSNorm", "SwiGLU", "apply_rotary", "rotary_tables", "Block", "TransformerLM", "build_model",
           "count_parameters"]
