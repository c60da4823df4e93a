"""Cluster planner: parameter counts, per-GPU memory, all-to-all traffic, a layout that fits.

    from moe_dist.plan import plan, count_params
    p = plan("configs/hf/mixtral-8x7b.json", nodes=2, gpus_per_node=8, gpu_mem_gib=80)
"""
from ..model.params import count_params
from .planner import load_plan_input, plan
from .report import format_plan

__all__ = ["count_params", "plan", "load_plan_input", "format_plan"]
