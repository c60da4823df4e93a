"""Hugging Face interop: read dense Llama / Mistral / Qwen2 / Phi-3 checkpoints (config.json,
safetensors, sharded index, tokenizer files) and export our MoE models in Mixtral format."""
from .config import DENSE_FAMILIES, FAMILIES, HFFormatError, HFModelSpec, hf_model_spec, read_hf_config
from .dense import DenseCheckpoint
from .safetensors_io import SafetensorsCheckpoint, ShardedWriter

__all__ = ["DENSE_FAMILIES", "FAMILIES", "HFFormatError", "HFModelSpec", "hf_model_spec", "read_hf_config",
           "DenseCheckpoint", "SafetensorsCheckpoint", "ShardedWriter"]
