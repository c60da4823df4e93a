"""The table and the target check printed by the layer benchmark."""
from __future__ import annotations

from collections import defaultdict

COLUMNS = [  # (header, key, format)
    ("impl", "impl", "{}"), ("router", "router", "{}"), ("ep", "ep", "{}"), ("procs", "procs", "{}"),
    ("dtype", "dtype", "{}"), ("tokens", "tokens", "{}"), ("setting", "expert_kernel", "{}"), ("kernel", "kernel", "{}"),
    ("ms/step", "step_ms", "{:.1f}"), ("cpu ms", "cpu_ms", "{:.1f}"), ("tok/s", "tokens_per_s", "{:.0f}"), ("us/tok", "time_per_token_us", "{:.1f}"),
    ("peak MiB", "peak_mem_mib", "{:.0f}"), ("faults", "page_faults", "{}"), ("x floor", "time_vs_floor", "{:.3f}"),
    ("x deepspeed", "time_vs_deepspeed", "{:.3f}"), ("x no-EP", "time_vs_control", "{:.3f}"),
    ("x topk", "time_vs_topk", "{:.3f}"), ("x best fixed", "time_vs_best_fixed", "{:.3f}"), ("imbalance", "imbalance", "{:.2f}"), ("load", "load_avg", "{:.1f}"),
]

TARGETS = {"floor": 1.15, "deepspeed": 1.0, "control": 1.1, "per_token_spread": 1.2, "auto": 1.05}
# layer time with the router / with ``topk`` in the same rounds, at S = 512: the token-graph routers
# <= 1.10, Selective Sinkhorn at small p <= 1.02, every other router <= 1.03
ROUTER_TARGETS = {"similarity": 1.10, "attention": 1.10, "ssr": 1.02, "symphony": 1.03, "ac": 1.03, "hyper": 1.03,
                  "smoe_dropout": 1.03, "xmoe": 1.03, "noisy_topk": 1.03, "sinkhorn": 1.03}


def _cell(rec: dict, key: str, fmt: str) -> str:
    v = rec.get(key)
    if v is None:
        return "-"
    if key == "impl" and rec.get("fastest_floor"):
        return f"{v}*"
    return fmt.format(v)


def table(records: list[dict]) -> str:
    rows = [[h for h, _, _ in COLUMNS]] + [[_cell(r, k, f) for _, k, f in COLUMNS] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i >= 8 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("x = time ratio (this / other), median of per-round ratios; < 1 is faster. floor* = fastest floor kernel. "
                 "tok/s summed over processes; load = 1-min load average during the case.")
    return "\n".join(lines)


def target_check(records: list[dict]) -> list[str]:
    """One line per target and case group: the figure, the limit and whether it is met."""
    out = []
    ours = [r for r in records if r["impl"] == "moe_dist" and r["router"] == "topk"]

    def line(ok: bool, what: str) -> None:
        out.append(f"{'met ' if ok else 'MISS'}  {what}")

    for r in ours:
        where = f"ep={r['ep']} procs={r['procs']} {r['dtype']} {r['tokens']} tokens, expert_kernel={r.get('expert_kernel', 'auto')}"
        if "time_vs_best_fixed" in r:
            v = r["time_vs_best_fixed"]
            line(v <= TARGETS["auto"], f"expert kernel auto ({r.get('kernel')}) / best fixed ({r['best_fixed_kernel']}) "
                                       f"= {v:.3f} (<= {TARGETS['auto']}) at {where}")
        if "time_vs_floor" in r:
            v = r["time_vs_floor"]
            line(v <= TARGETS["floor"], f"time / floor = {v:.3f} (<= {TARGETS['floor']}) at {where}")
        if "time_vs_deepspeed" in r:
            v = r["time_vs_deepspeed"]
            line(v <= TARGETS["deepspeed"], f"time / deepspeed = {v:.3f} (<= {TARGETS['deepspeed']}) at {where}")
        if "time_vs_control" in r:
            v = r["time_vs_control"]
            line(v <= TARGETS["control"], f"time / no-EP control = {v:.3f} (<= {TARGETS['control']}) at {where}")
    by_group = defaultdict(list)
    for r in ours:
        by_group[(r["ep"], r["procs"], r["dtype"], r.get("expert_kernel", "auto"))].append(r)
    for (ep, procs, dtype, kernel), rs in by_group.items():
        if len(rs) < 2:
            continue
        rs = sorted(rs, key=lambda r: r["tokens"])
        tpt = [r["time_per_token_us"] for r in rs]
        spread = max(tpt) / min(tpt)
        line(spread <= TARGETS["per_token_spread"],
             f"time per token max/min = {spread:.3f} (<= {TARGETS['per_token_spread']}) over tokens "
             f"{rs[0]['tokens']}..{rs[-1]['tokens']} at ep={ep} procs={procs} {dtype}, expert_kernel={kernel}")
    for r in records:
        limit = ROUTER_TARGETS.get(r["router"])
        if r["impl"] != "moe_dist" or limit is None or "time_vs_topk" not in r:
            continue
        v = r["time_vs_topk"]
        sizes = (f"d_model={r['d_model']} d_ff={r['d_ff']}" if "d_model" in r else "") + (
            f" heads={r['heads']}/{r['kv_heads']}" if r["router"] == "attention" and "heads" in r else "")
        line(v <= limit, f"{r['router']} time / topk = {v:.3f} (<= {limit}) at seq_len={r.get('seq_len')} {sizes} "
                         f"{r['dtype']} {r['tokens']} tokens")
    return out


def markdown(records: list[dict]) -> str:
    """The table as GitHub markdown (for the pages of benchmarks/results/)."""
    head = [h for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(r, k, f) for _, k, f in COLUMNS) + " |" for r in records]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m benchmarks.report results.jsonl [...]``: markdown table and target check
    of saved ``--json`` output."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    records = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            records += [json.loads(line) for line in f if line.strip().startswith("{")]
    print(markdown(records) + "\n\nTargets:\n\n" + "\n".join(f"- {line}" for line in target_check(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
