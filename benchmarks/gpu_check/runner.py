"""The whole check: each section in a process of its own (its own process group and time limit,
a share of the budget), a failed or timed-out one reported with its log's last lines while the
others still run, the report rewritten after every section."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional

from .context import Context, SectionFailed, Skip, child_env, read_json, result_path, write_json
from .device import section_device
from .device_tests import section_tests
from .host_syncs import section_host_syncs
from .layer_bench import section_layer_bench
from .memory import section_memory_vs_dry_run
from .report import section_lines, summary_markdown, write_report
from .settings import INJECT_ENV, MIN_SECTION_S, PLANNED_S, ROOT, SECTIONS, WORK_ENTRIES
from .train import section_train


SECTION_FUNCS: dict[str, Callable[[Context], dict]] = {
    "device": section_device, "tests": section_tests, "train": section_train,
    "memory_vs_dry_run": section_memory_vs_dry_run, "host_syncs": section_host_syncs, "layer_bench": section_layer_bench}


def injected(name: str) -> Optional[str]:
    """What the test hook asks of this section: ``fail``, ``hang`` or None."""
    for item in os.environ.get(INJECT_ENV, "").split(","):
        key, _, what = item.partition("=")
        if key.strip() == name:
            return what.strip()
    return None


def run_section(name: str, args) -> int:
    """Run one section in this process; its result goes to WORK/results/NAME.json. 0: ok or skipped."""
    ctx = Context(name, args.device, args.quick, args.out, args.work, time.monotonic() + args.limit_s)
    path = result_path(args.work, name)
    try:
        what = injected(name)
        if what == "fail":
            raise RuntimeError(f"failure injected by {INJECT_ENV}")
        if what == "hang":
            time.sleep(3600)
        payload, rc = {"status": "ok", "figures": SECTION_FUNCS[name](ctx)}, 0
    except Skip as e:
        payload, rc = {"status": "skipped", "reason": str(e), "figures": ctx.figures}, 0
    except SectionFailed as e:
        payload, rc = {"status": "failed", "error": str(e), "figures": {**ctx.figures, **e.figures}}, 1
    except Exception as e:  # reported with its traceback in the log; the other sections still run
        traceback.print_exc()
        payload, rc = {"status": "failed", "error": f"{type(e).__name__}: {e}", "figures": ctx.figures}, 1
    write_json(path, payload)
    return rc


class Interrupted(Exception):
    """SIGTERM / SIGINT: stop the running section, keep what is done."""


def _on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


def section_limit(name: str, left_s: float, pending: list[str]) -> float:
    """This section's share of the time left, in proportion to the planned times of the sections still to run."""
    return left_s * PLANNED_S[name] / sum(PLANNED_S[n] for n in pending)


def _stop_group(proc: subprocess.Popen) -> None:
    """End the section's process group: the section and whatever it started (pytest, a benchmark,
    ``moe-dist train``'s launcher, whose ranks die with it). SIGKILL, not SIGTERM: a trainer
    answers SIGTERM by saving a checkpoint first, time this check does not have."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _log_tail(log_path: str, offset: int, lines: int = 30) -> list[str]:
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return text.splitlines()[-lines:]


def run_section_process(name: str, limit_s: float, args, log_path: str) -> dict:
    """One section as a child process with ``limit_s`` seconds; its entry for gpu_check.json."""
    path = result_path(args.work, name)
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--section", name, "--out", args.out, "--work", args.work,
           "--device", args.device, "--limit-s", f"{limit_s:.1f}"] + (["--quick"] if args.quick else [])
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"\n===== {name} (limit {limit_s:.0f} s) =====\n".encode())
        log.flush()
        env = child_env()
        if os.environ.get(INJECT_ENV):
            env[INJECT_ENV] = os.environ[INJECT_ENV]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, why = proc.wait(timeout=limit_s), None
        except subprocess.TimeoutExpired:
            rc, why = None, f"timed out after {limit_s:.0f} s (its limit in this run's budget)"
        except BaseException:
            _stop_group(proc)
            raise
        _stop_group(proc)  # after a timeout; after an exit: anything it left running
    seconds = round(time.monotonic() - t0, 1)
    payload = read_json(path) or {}
    status = payload.get("status") if rc in (0, 1) and payload.get("status") in ("ok", "failed", "skipped") else "failed"
    entry = {"status": status, "seconds": seconds, "limit_s": round(limit_s, 1), "figures": payload.get("figures", {})}
    if status == "skipped":
        entry["reason"] = payload.get("reason")
    if status == "failed":
        entry["error"] = why or payload.get("error") or f"the section's process exited with {rc} and wrote no result"
        entry["log_tail"] = _log_tail(log_path, offset)
    return entry


def prepare_work(work: str) -> None:
    """A fresh work directory for this run's results (the data cache is kept: it is keyed by its inputs)."""
    os.makedirs(work, exist_ok=True)
    for entry in WORK_ENTRIES:
        shutil.rmtree(os.path.join(work, entry), ignore_errors=True)


def run_all(args) -> int:
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        print(f"gpu_check: --sections {args.sections!r}: unknown {unknown}; allowed: {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    prepare_work(args.work)
    log_path = os.path.join(args.out, "sections.log")
    open(log_path, "w").close()
    start = time.monotonic()
    report = {"meta": {"device": args.device, "quick": args.quick, "budget_s": args.budget_s, "sections": names,
                       "python": sys.executable, "work": args.work, "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "sections": {n: {"status": "pending"} for n in names}}
    print(f"gpu_check: {len(names)} section(s) on {args.device}, budget {args.budget_s:.0f} s; results in {args.out}, "
          f"runs in {args.work}", flush=True)
    signal.signal(signal.SIGTERM, _on_signal)
    write_report(args.out, report)
    try:
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - start)
            limit = min(left, section_limit(name, left, names[i:]))
            if limit < MIN_SECTION_S:
                report["sections"][name] = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
            else:
                print(f"[{time.monotonic() - start:5.0f} s] {name}: started, limit {limit:.0f} s", flush=True)
                report["sections"][name] = run_section_process(name, limit, args, log_path)
            e = report["sections"][name]
            print(f"[{time.monotonic() - start:5.0f} s] {name}: {e['status']}"
                  + (f" in {e['seconds']} s" if "seconds" in e else "")
                  + (f" - {str(e.get('error') or e.get('reason')).splitlines()[0][:300]}" if e['status'] != "ok" else ""),
                  flush=True)
            for line in section_lines(name, e.get("figures")):
                print(f"    {line}", flush=True)
            report["meta"]["total_s"] = round(time.monotonic() - start, 1)
            write_report(args.out, report)
    except (Interrupted, KeyboardInterrupt) as e:
        for name, entry in report["sections"].items():
            if entry["status"] == "pending":
                entry.update(status="skipped", reason=f"the check was stopped ({e or 'interrupt'})")
        report["meta"]["total_s"] = round(time.monotonic() - start, 1)
        write_report(args.out, report)
        print(f"gpu_check: stopped ({e or 'interrupt'}); what finished is in {args.out}", flush=True)
        return 0
    print("\n" + summary_markdown(report), flush=True)
    return 0
