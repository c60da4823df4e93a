"""``moe-dist export``: write one of our MoE models as a Hugging Face checkpoint."""
from __future__ import annotations

from ..hf.export import FORMATS
from .common import add_overrides_argument, user_errors

HELP = "export a trained, upcycled or imported MoE model as a Hugging Face checkpoint (Mixtral, OLMoE or Qwen2-MoE format)"


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run directory (latest checkpoint), <run>/checkpoints/step_N, or a `moe-dist upcycle` / `import` output")
    parser.add_argument("--format", default="mixtral", choices=list(FORMATS), help="output format")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="dtype of the written weights (auto = bf16 if the run trained in bf16, else fp32)")
    add_overrides_argument(parser)


def run(args) -> int:
    def go() -> int:
        from ..hf.export import export

        export(args.checkpoint, args.format, args.out, dtype=args.dtype, overrides=args.overrides)
        return 0

    return user_errors("export", go)
