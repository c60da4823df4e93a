"""``moe-dist plan``: will this model train on this cluster, and with which layout?"""
from __future__ import annotations

import json

from .common import add_overrides_argument, user_errors

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
    dry = parser.add_argument_group("dry run: one rank's real training step on fake tensors (moe_dist/plan/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true",
                     help="run the training step of one rank of this cluster in this process (fake process group "
                          "and tensors), print its memory at the peak next to the planner's and a verdict against "
                          "--gpu-mem-gib; exit status 0: fits, 3: does not fit, 2: bad input")
    dry.add_argument("--rank", type=int, default=None, metavar="R",
                     help="the rank to play (default: the busiest expert's rank under --routing)")
    dry.add_argument("--routing", default="balanced", metavar="MODEL",
                     help="the dispatch's counts: balanced, skew:F (the busiest expert F x the mean, 1 <= F <= "
                          "num_experts / top_k), or a run's metrics.jsonl / run directory (its last logged expert counts)")
    dry.add_argument("--steps", type=int, default=1, metavar="K",
                     help="training steps of the dry run (default 1: the optimizer state is made before it)")
    dry.add_argument("--check-collectives", action="store_true",
                     help="dry-run several ranks and check that every group's members agree on each collective "
                          "(sizes, all-to-all splits): the ranks of the first ep and edp groups, or --all-ranks")
    dry.add_argument("--all-ranks", action="store_true", help="--check-collectives: every rank of the world")
    from ..plan.planner import DEFAULT_ALPHA_US, DEFAULT_COMPUTE_TFLOPS, DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS

    net = parser.add_argument_group("step time (alpha-beta model; docs/scale.md)")
    net.add_argument("--dispatch", default="all", metavar="D",
                     help="expert dispatch to predict: flat, hierarchical or all (default all)")
    net.add_argument("--max-groups", default="1,2", metavar="M[,M]",
                     help="node-limited routing: at most M nodes per token, one or more values (default 1,2; "
                          "none: no node-limited rows)")
    net.add_argument("--intra-gbps", type=float, default=DEFAULT_INTRA_GBPS, metavar="G",
                     help=f"one GPU's link inside a node, Gbit/s each way (default {DEFAULT_INTRA_GBPS:g}: NVLink 4)")
    net.add_argument("--inter-gbps", type=float, default=DEFAULT_INTER_GBPS, metavar="G",
                     help=f"one node's network uplink, Gbit/s each way, shared by its GPUs (default "
                          f"{DEFAULT_INTER_GBPS:g}: 8 x 400 Gbit/s InfiniBand)")
    net.add_argument("--alpha-us", type=float, default=DEFAULT_ALPHA_US, metavar="US",
                     help=f"latency of one message in microseconds (default {DEFAULT_ALPHA_US:g})")
    net.add_argument("--compute-tflops", type=float, default=DEFAULT_COMPUTE_TFLOPS, metavar="T",
                     help=f"achieved matmul TFLOP/s per GPU (default {DEFAULT_COMPUTE_TFLOPS:g}: H100 bf16 at ~40%% "
                          "of peak; A100 bf16 ~150, H200 ~450)")
    net.add_argument("--no-fsdp-overlap", dest="fsdp_overlap", action="store_false",
                     help="FSDP2's gathers and reductions do not overlap compute (CPU processes)")
    add_overrides_argument(parser)


def _max_groups(text: str) -> list:
    """``--max-groups``: ``1,2`` -> [1, 2]; ``none`` -> []; a value that is not an integer stays as
    it is, for :func:`~moe_dist.plan.planner.make_network` to name."""
    if text.strip().lower() == "none":
        return []
    return [int(v) if v.strip().isdigit() else v.strip() for v in text.split(",") if v.strip()]


def _check_collectives(args) -> int:
    from ..plan.collective_check import check_world

    ranks = list(range(args.nodes * args.gpus_per_node)) if args.all_ranks else None
    result = check_world(args.config, args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node, ranks=ranks,
                         routing=args.routing, steps=args.steps, micro_batch=args.micro_batch,
                         log=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["problems"]:
        print(f"{len(result['problems'])} disagreement(s) between ranks (a real job would hang or fail):")
        print("\n".join(result["problems"][:20]))
    else:
        n = sum(result["collectives_per_rank"].values())
        print(f"ranks {result['ranks']} of {result['world_size']} (ep={result['ep']}) agree on all {n} collectives "
              f"of their steps ({result['seconds']:.0f} s)")
    return 1 if result["problems"] else 0


def run(args) -> int:
    def go() -> int:
        if args.check_collectives:
            return _check_collectives(args)
        if args.dry_run:
            from ..plan.dry_run import dry_run
            from ..plan.dry_run_report import DOES_NOT_FIT, format_dry_run, with_planner

            result = with_planner(dry_run(args.config, args.overrides, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                          rank=args.rank, routing=args.routing, steps=args.steps,
                                          micro_batch=args.micro_batch), args.gpu_mem_gib)
            print(json.dumps(result, indent=2) if args.json else format_dry_run(result))
            return 0 if result["verdict"]["fits"] else DOES_NOT_FIT
        from ..plan import format_plan, plan
        from ..plan.planner import make_network

        network = make_network(args.dispatch, _max_groups(args.max_groups), args.intra_gbps, args.inter_gbps,
                               args.alpha_us, args.compute_tflops, args.fsdp_overlap)
        result = plan(args.config, args.nodes, args.gpus_per_node, args.gpu_mem_gib, args.overrides,
                      seq_len=args.seq_len, micro_batch=args.micro_batch, network=network)
        print(json.dumps(result, indent=2) if args.json else format_plan(result))
        return 0

    return user_errors("plan", go)
