"""``moe-dist sweep``: train a grid of routers x variants x seeds, then write the study's report."""
from __future__ import annotations

import json
import os
import shutil
import sys

from .common import user_errors

HELP = "run a router study (routers x variants x seeds over one base config; resumable) and write its report"


def add_arguments(parser) -> None:
    parser.add_argument("--config", "-c", required=True, metavar="STUDY", help="the study file (e.g. configs/study.yaml)")
    parser.add_argument("--out", metavar="DIR", help="study directory (default: the study's out:)")
    parser.add_argument("--runs-at-once", type=int, default=None, metavar="N",
                        help="concurrent runs (default: the study's runs_at_once; auto = usable cores / "
                             "(processes_per_run x threads_per_run))")
    parser.add_argument("--report-only", action="store_true", help="start no run: write the report of what has finished")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and what each still needs, start nothing")


def _setting(cfg) -> str:
    m, t = cfg.model, cfg.train
    return (f"{t.steps} steps of {t.global_batch} x {t.seq_len} tokens, d_model {m.d_model}, {m.n_layers} blocks, "
            f"MoE layers {m.moe.layers}, {m.moe.num_experts} experts, top-{m.moe.top_k}, aux-loss weight "
            f"{m.moe.aux_loss_coef}, z-loss weight {m.moe.z_loss_coef}, capacity factor "
            f"{'null (dropless)' if m.moe.capacity_factor is None else m.moe.capacity_factor}, "
            f"validation every {cfg.eval.every} steps on {cfg.eval.max_sequences} sequences")


def write_report(study, configs) -> tuple[list[dict], str]:
    """Collect every run, write study.json, figures/*.png and report.md under the study directory."""
    from ..study.collect import collect_run
    from ..study.figures import write_figures
    from ..study.report import aggregate, render_markdown

    records = [collect_run(run, configs[run.name].train.steps) for run in study.runs]
    agg = aggregate(study, records)
    figures = write_figures(study, records, agg, os.path.join(study.out, "figures"))
    reference_cfg = configs[study.runs[0].name]
    with open(os.path.join(study.out, "study.json"), "w", encoding="utf-8") as f:
        json.dump({"study": study.path, "base": study.base, "seeds": study.seeds, "reference": study.reference,
                   "setting": _setting(reference_cfg), "runs_at_once": study.runs_at_once,
                   "processes_per_run": study.processes_per_run, "threads_per_run": study.threads_per_run,
                   "runs": records, **agg}, f, indent=2)
    path = os.path.join(study.out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_markdown(study, records, agg, figures, _setting(reference_cfg)))
    return records, path


def _prepare_data(configs, log) -> None:
    """Build each distinct token cache once, before runs start side by side."""
    from ..data import prepare_data

    seen = set()
    for cfg in configs.values():
        key = json.dumps(vars(cfg.data), sort_keys=True, default=str)
        if key not in seen and not cfg.data.paths:  # data.paths: prepared already (moe-dist prepare)
            seen.add(key)
            prepare_data(cfg.data, log=log)


def run(args) -> int:
    if args.runs_at_once is not None and args.runs_at_once < 1:
        print(f"moe-dist sweep: error: --runs-at-once must be >= 1, got {args.runs_at_once}", file=sys.stderr)
        return 2
    state = {}

    def setup() -> int:
        from ..study.execute import plan
        from ..study.spec import check_runs, load_study

        study = load_study(args.config, out=args.out, runs_at_once=args.runs_at_once)
        configs = check_runs(study)
        state.update(study=study, configs=configs, plan=plan(study, configs))
        return 0

    code = user_errors("sweep", setup)
    if code:
        return code
    study, configs, todo = state["study"], state["configs"], state["plan"]
    print(f"study {study.path}: {len(study.runs)} runs ({len(study.routers)} routers x {len(study.variants)} "
          f"variant(s) x {len(study.seeds)} seeds), {len(todo.finished)} finished, {len(todo.todo)} to run, "
          f"{study.runs_at_once} at a time; directory {study.out}", flush=True)
    if args.dry_run:
        for job in todo.todo:
            print(f"  {job.run.name}: " + " then ".join(c[3] for c in job.commands))
        return 0
    os.makedirs(study.out, exist_ok=True)
    if os.path.abspath(study.path) != os.path.abspath(os.path.join(study.out, "study.yaml")):
        shutil.copyfile(study.path, os.path.join(study.out, "study.yaml"))
    interrupted, ended = False, []
    if not args.report_only and todo.todo:
        from ..study.execute import Progress, execute

        _prepare_data(configs, log=lambda msg: print(msg, flush=True))
        progress = Progress(total=len(study.runs), done=len(todo.finished), runs_at_once=study.runs_at_once)
        try:
            ended = execute(study, todo.todo, progress)
        except KeyboardInterrupt:
            interrupted = True
    records, report = write_report(study, configs)
    done = sum(r["status"] == "done" for r in records)
    print(f"{done}/{len(records)} runs finished; report {report}", flush=True)
    if interrupted:
        print("interrupted: run the same command again to resume", file=sys.stderr, flush=True)
        return 130
    failed = [j.run.name for j in ended if j.status != "done"]
    if failed:
        print(f"moe-dist sweep: {len(failed)} run(s) failed: {', '.join(failed)} (their sweep.log has the output; "
              "the same command retries them from their latest checkpoint)", file=sys.stderr)
        return 1
    return 0
