"""The check's report: ``gpu_check.json`` (every section's entry) and ``gpu_check.md`` (a table of
the sections and the figures a reader wants first)."""
from __future__ import annotations

import os

from .context import write_json
from .settings import BIG_NAME


def write_report(out: str, report: dict) -> None:
    write_json(os.path.join(out, "gpu_check.json"), report)
    with open(os.path.join(out, "gpu_check.md"), "w", encoding="utf-8") as f:
        f.write(summary_markdown(report))


def _fmt(v, nd: int = 3) -> str:
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def section_lines(name: str, figs: dict) -> list[str]:
    """The figures a reader wants first, per section (none when it has none)."""
    f = figs or {}
    if not f:
        return []
    if name == "device":
        return [f"{f.get('gpu') or 'CPU ' + str(f.get('cpu_capability'))}; torch {f.get('torch')}, CUDA {f.get('cuda')}, "
                f"{f.get('cpu_count')} CPUs; {f.get('matmul_n')}^3 {f.get('matmul_dtype')} matmul "
                f"{_fmt(f.get('matmul_tflops'))} TFLOP/s (datasheet {_fmt(f.get('datasheet_bf16_tflops'))})"]
    if name == "tests":
        lines = [f"{f.get('passed')} passed, {f.get('failed')} failed, {f.get('skipped')} skipped "
                 f"({', '.join(f.get('files', []))})"]
        return lines + [f"  FAILED {t}" for t in f.get("failed_tests", [])[:20]]
    if name == "train":
        lines = []
        for case in ("main_job", BIG_NAME):
            r = f.get(case)
            if isinstance(r, dict):
                lines.append(f"{case}: {_fmt(r.get('tokens_per_s_median'))} tokens/s, "
                             f"step {_fmt(r.get('step_ms_median'))} ms, "
                             f"MFU {_fmt(r.get('mfu_vs_measured_matmul'))} of the measured matmul / "
                             f"{_fmt(r.get('mfu_vs_planner_default'))} of {_fmt(r.get('planner_default_tflops'))} TFLOP/s, "
                             f"peak allocated {_fmt(r.get('cuda_peak_allocated_gib'))} GiB, loss "
                             f"{_fmt(r.get('loss_first'))} -> {_fmt(r.get('loss_last'))}")
            elif r is not None:
                lines.append(f"{case}: {r}")
        return lines
    if name == "memory_vs_dry_run":
        return [f"real peak allocated {_fmt(f.get('real_training_peak_allocated_gib'))} GiB in training "
                f"({_fmt(f.get('real_cuda_peak_allocated_gib'))} GiB whole run), dry run "
                f"{_fmt(f.get('dry_run_peak_gib'))} GiB (real / dry run {_fmt(f.get('real_over_dry_run'))}), planner "
                f"{_fmt(f.get('planner_total_gib'))} GiB (real / planner {_fmt(f.get('real_over_planner'))})"]
    if name == "host_syncs":
        p = f.get("per_step", {})
        return [f"per step: Memcpy DtoH {_fmt(p.get('Memcpy DtoH'))}, cudaStreamSynchronize "
                f"{_fmt(p.get('cudaStreamSynchronize'))}, "
                f"aten::_local_scalar_dense {_fmt(p.get('aten::_local_scalar_dense'))}, "
                f"aten::item {_fmt(p.get('aten::item'))}; expected {f.get('expected_reads_per_step')} reads "
                f"({f.get('moe_layers')} MoE layers x {f.get('micro_batches')} + 2)"
                + ("" if "matches_expected" not in f else f"; as expected: {f['matches_expected']}")]
    if name == "layer_bench":
        return [f"{r.get('tokens')} tokens {r.get('dtype')} {r.get('expert_kernel')} -> {r.get('kernel')}: "
                f"{_fmt(r.get('step_ms'))} ms, x floor {_fmt(r.get('time_vs_floor'))}"
                for r in f.get("rows", []) if r.get("impl") == "moe_dist"]
    return []


def summary_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# GPU check ({meta['device']}{', quick' if meta['quick'] else ''})", "",
             f"{meta['python']} · budget {meta['budget_s']:.0f} s · {meta.get('total_s', '-')} s in all", "",
             "| section | status | seconds | limit |", "|---|---|---|---|"]
    for name, e in report["sections"].items():
        lines.append(f"| {name} | {e['status']} | {e.get('seconds', '-')} | {e.get('limit_s', '-')} |")
    for name, e in report["sections"].items():
        lines += ["", f"## {name}: {e['status']}"]
        lines += [f"- {l}" for l in section_lines(name, e.get("figures"))]
        if e.get("reason"):
            lines.append(f"- skipped: {e['reason']}")
        if e.get("error"):
            lines.append(f"- error: {str(e['error']).splitlines()[0][:500]}")
    return "\n".join(lines) + "\n"
