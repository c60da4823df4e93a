"""``moe-dist import``: a Hugging Face MoE checkpoint -> our checkpoint, ready to train or evaluate."""
from __future__ import annotations

from .common import add_overrides_argument, add_weights_writer_arguments, max_shard_bytes, user_errors

HELP = "read a Mixtral, OLMoE or Qwen2-MoE checkpoint (Hugging Face format) into a moe_dist checkpoint"


def add_arguments(parser) -> None:
    parser.add_argument("--hf", required=True, metavar="DIR",
                        help="Hugging Face checkpoint directory: config.json, model.safetensors or shards + index, tokenizer")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output: config.yaml, model.safetensors (+ index), tokenizer files, import.json")
    add_weights_writer_arguments(parser, "configs/olmoe-1b-7b.yaml")
    add_overrides_argument(parser)


def run(args) -> int:
    def go() -> int:
        from ..config.load import read_yaml
        from ..hf.importer import import_hf

        base = read_yaml(args.config) if args.config else None
        import_hf(args.hf, args.out, args.overrides, base=base, dtype=args.dtype, max_shard_bytes=max_shard_bytes(args))
        print(f"next: moe-dist train --config {args.out}/config.yaml [--nproc N] [KEY=VALUE ...]   or   "
              f"moe-dist eval --checkpoint {args.out} [--nproc N]")
        return 0

    return user_errors("import", go)
