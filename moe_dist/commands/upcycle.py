"""``moe-dist upcycle``: a dense Hugging Face checkpoint -> an MoE checkpoint ready to train."""
from __future__ import annotations

from .common import add_overrides_argument, add_weights_writer_arguments, max_shard_bytes, user_errors

HELP = "turn a dense Llama / Mistral / Qwen2 / Phi-3 checkpoint into an MoE (experts copied from its FFNs)"


def add_arguments(parser) -> None:
    parser.add_argument("--dense", required=True, metavar="DIR",
                        help="Hugging Face checkpoint directory: config.json, model.safetensors or shards + index, tokenizer")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output: config.yaml, model.safetensors (+ index), tokenizer files, upcycle.json")
    parser.add_argument("--noise-std", type=float, default=0.0, metavar="F",
                        help="add N(0, F^2) noise to each expert copy (0 = exact copies: function preserved)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the router initialisation and the noise")
    add_weights_writer_arguments(parser, "configs/phi3-mini-upcycle-4x2.yaml")
    add_overrides_argument(parser)


def run(args) -> int:
    def go() -> int:
        from ..config.load import read_yaml
        from ..upcycle.core import upcycle

        base = read_yaml(args.config) if args.config else None
        upcycle(args.dense, args.out, args.overrides, base=base, noise_std=args.noise_std, seed=args.seed,
                dtype=args.dtype, max_shard_bytes=max_shard_bytes(args))
        print(f"next: moe-dist train --config {args.out}/config.yaml [--nproc N] [KEY=VALUE ...]")
        return 0

    return user_errors("upcycle", go)
