"""``moe-dist import``: a Hugging Face MoE checkpoint -> our checkpoint, ready to train or evaluate."""
from __future__ import annotations

from ..errors import UsageError
from ..train.cmd_common import add_overrides_argument, user_errors

HELP = "read a Mixtral, OLMoE or Qwen2-MoE checkpoint (Hugging Face format) into a moe_dist checkpoint"


def add_arguments(parser) -> None:
    parser.add_argument("--hf", required=True, metavar="DIR",
                        help="Hugging Face checkpoint directory: config.json, model.safetensors or shards + index, tokenizer")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output: config.yaml, model.safetensors (+ index), tokenizer files, import.json")
    parser.add_argument("--config", "-c", metavar="PATH",
                        help="a preset YAML (e.g. configs/olmoe-1b-7b.yaml) applied before the overrides")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="dtype of the written weights (auto = the checkpoint's)")
    parser.add_argument("--max-shard-gib", type=float, default=4.0, metavar="G", help="split the weights into files of about G GiB")
    add_overrides_argument(parser)


def run(args) -> int:
    def go() -> int:
        from ..config.load import read_yaml
        from .importer import import_hf

        base = read_yaml(args.config) if args.config else None
        if args.max_shard_gib <= 0:
            raise UsageError(f"--max-shard-gib {args.max_shard_gib}; allowed: > 0")
        import_hf(args.hf, args.out, args.overrides, base=base, dtype=args.dtype,
                  max_shard_bytes=int(args.max_shard_gib * (1 << 30)))
        print(f"next: moe-dist train --config {args.out}/config.yaml [--nproc N] [KEY=VALUE ...]   or   "
              f"moe-dist eval --checkpoint {args.out} [--nproc N]")
        return 0

    return user_errors("import", go)
