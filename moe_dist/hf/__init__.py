"""Hugging Face interop: read dense Llama / Mistral / Qwen2 / Phi-3 checkpoints (config.json,
safetensors, sharded index, tokenizer files) for upcycling, read Mixtral and OLMoE checkpoints
(``moe-dist import``), and export our MoE models in Mixtral or OLMoE format."""
from .config import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES, HFFormatError, HFModelSpec, hf_model_spec, read_hf_config
from .dense import DenseCheckpoint
from .moe_checkpoint import MoECheckpoint
from ..weights import SafetensorsCheckpoint, ShardedWriter

__all__ = ["DENSE_FAMILIES", "FAMILIES", "MOE_FAMILIES", "HFFormatError", "HFModelSpec", "hf_model_spec",
           "read_hf_config", "DenseCheckpoint", "MoECheckpoint", "SafetensorsCheckpoint", "ShardedWriter"]
