"""Cluster planner: parameter counts, per-GPU memory, all-to-all traffic, a layout that fits, and
each layout's dispatch bytes and predicted step time.

    from moe_dist.plan import plan, count_params, make_network
    p = plan("configs/hf/mixtral-8x7b.json", nodes=2, gpus_per_node=8, gpu_mem_gib=80)
    p = plan("configs/olmoe-1b-7b.yaml", 8, 8, 80, network=make_network(inter_gbps=400))  # + layouts[i]["dispatch"]
"""
from ..model.params import count_params
from .plan_input import load_plan_input
from .planner import make_network, plan
from .report import format_plan

__all__ = ["count_params", "plan", "load_plan_input", "format_plan", "make_network"]
