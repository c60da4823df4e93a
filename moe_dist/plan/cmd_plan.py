"""``moe-dist plan``: will this model train on this cluster, and with which layout?"""
from __future__ import annotations

import json

from ..train.cmd_common import add_overrides_argument, user_errors

HELP = "parameters, per-GPU memory, all-to-all traffic and a layout that fits, for a config on a cluster"


def add_arguments(parser) -> None:
    parser.add_argument("--config", "-c", required=True, metavar="PATH",
                        help="one of our YAML configs or a Hugging Face config.json (dense or MoE, e.g. Mixtral)")
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="G", help="GPUs per node (default 8)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0, metavar="M", help="memory of one GPU in GiB (default 80)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="S",
                        help="tokens per sequence (default: train.seq_len, or 4096 for a Hugging Face config)")
    parser.add_argument("--micro-batch", type=int, default=None, metavar="B",
                        help="sequences per GPU per forward (default: from train.global_batch / grad_accum / GPUs, or 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    add_overrides_argument(parser)


def run(args) -> int:
    def go() -> int:
        from . import format_plan, plan

        result = plan(args.config, args.nodes, args.gpus_per_node, args.gpu_mem_gib, args.overrides,
                      seq_len=args.seq_len, micro_batch=args.micro_batch)
        print(json.dumps(result, indent=2) if args.json else format_plan(result))
        return 0

    return user_errors("plan", go)
