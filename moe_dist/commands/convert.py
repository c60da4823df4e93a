"""``moe-dist convert``: a sharded checkpoint -> one safetensors file (+ config) for one process."""
from __future__ import annotations

from .common import user_errors

HELP = "consolidate a sharded checkpoint into one safetensors file loadable on one process (no torch.distributed)"


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="<run>/checkpoints/step_NNNNNN, or a run directory (its latest complete checkpoint)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: model.safetensors, config.yaml, convert.json")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="dtype of the written floating-point tensors (auto = as saved)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")


def run(args) -> int:
    def go() -> int:
        from ..train.checkpoint.convert import consolidate

        consolidate(args.checkpoint, args.out, dtype=args.dtype, force=args.force)
        return 0

    return user_errors("convert", go)
