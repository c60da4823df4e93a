"""``moe-dist prepare``: text, JSON-lines or Parquet inputs -> a tokenized dataset in Megatron's indexed format."""
from __future__ import annotations

import os

from .common import user_errors

HELP = "tokenize text / JSON-lines / Parquet inputs into Megatron indexed shards (.bin/.idx) + manifest, resumably"


def add_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="INPUT",
                        help="files, directories or globs: .txt/.md/.rst (one document each), .jsonl/.json "
                             "(+ .gz, .zst; one record per line), .parquet")
    parser.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="the dataset directory; train with data.paths=DIR (run again to resume)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a sentencepiece tokenizer.model, a Hugging Face tokenizer.json, or a model directory")
    parser.add_argument("--field", default="text", help="the text field of JSON-lines records / Parquet column")
    parser.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"),
                        help="auto = by file extension")
    parser.add_argument("--pattern", default=None, metavar="GLOB", help="only these files inside directory inputs")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="documents held out for validation, chosen by a hash of their name")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (0 = one per core; 1 = none)")
    parser.add_argument("--memory-mb", type=int, default=2048, help="memory the prepare may use, in MiB")
    parser.add_argument("--shard-mb", type=float, default=1024, help="input MiB per output shard (the unit of resume)")
    parser.add_argument("--max-record-mb", type=int, default=64,
                        help="a record or text file larger than this is left out and named")
    parser.add_argument("--task", type=int, default=None,
                        help="this task's slice of the inputs (default: $SLURM_ARRAY_TASK_ID with --tasks)")
    parser.add_argument("--tasks", type=int, default=1, help="tasks the inputs are spread over (a Slurm array)")
    parser.add_argument("--combine", action="store_true",
                        help="after all tasks: check DIR/part-*/ and write DIR/manifest.json listing their shards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line stays)")


def run(args) -> int:
    def go() -> int:
        from ..data.combine import combine_parts, part_dir
        from ..data.pipeline import PrepareSettings, run_prepare, summary_line
        from ..errors import UsageError

        if args.combine:
            print(summary_line(combine_parts(args.output), args.output))
            return 0
        if not args.inputs:
            raise UsageError("prepare: name at least one INPUT (file, directory or glob)")
        task = args.task
        if task is None:
            task = int(os.environ.get("SLURM_ARRAY_TASK_ID", 0)) if args.tasks > 1 else 0
        out = part_dir(args.output, task) if args.tasks > 1 else args.output
        run_prepare(PrepareSettings(
            inputs=args.inputs, output=out, tokenizer=args.tokenizer, format=args.format, pattern=args.pattern,
            field=args.field, val_fraction=args.val_fraction, workers=args.workers, memory_mb=args.memory_mb,
            shard_mb=args.shard_mb, max_record_mb=args.max_record_mb, progress=not args.no_progress, task=task,
            tasks=args.tasks))
        return 0

    return user_errors("prepare", go)
