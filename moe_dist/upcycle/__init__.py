"""Sparse upcycling of dense Hugging Face checkpoints into moe_dist MoE models.

    from moe_dist.upcycle import upcycle
    upcycle("Phi-3-mini-4k-instruct", "runs/phi3-4x2", ["model.moe.num_experts=4", "model.moe.layers=every_other"])
"""
from .core import preserves_function, upcycle, upcycle_config, upcycle_model, upcycled_tensors
from ..weights import has_model_weights, load_model_weights, save_model_weights

__all__ = ["upcycle", "upcycle_config", "upcycle_model", "upcycled_tensors", "preserves_function",
           "load_model_weights", "save_model_weights", "has_model_weights"]
