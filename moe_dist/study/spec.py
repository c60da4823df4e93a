"""The study file of ``moe-dist sweep``: one base config, a grid of routers x variants x seeds.

    out: runs/study                 # one run directory per grid point under out/runs/
    base: configs/tiny.yaml         # the training config every run starts from
    overrides: {train.steps: 400}   # KEY: VALUE applied to every run
    seeds: [0, 1, 2]                # train.seed of each repetition
    reference: topk                 # the router the others are compared with (time, tokens/s, perplexity)
    routers:                        # label: {router, options, overrides, compare_to}
      topk: {}
      ssr: {options: {p: 0.01}}
      symphony: {options: {base: topk}, compare_to: topk}
    variants: {default: {}}         # label: {KEY: VALUE}; a third axis of the grid (optional)
    eval_k: [1, 2, 4]               # inference k, for routers that have one (eval_k option)
    runs_at_once: auto              # auto = usable cores // (processes_per_run x threads_per_run)
    processes_per_run: 1
    threads_per_run: 1

A run's overrides are, in order: the study's, the variant's, the router's, then
``model.moe.router``, its options, ``train.seed`` and ``run.dir``. Relative paths are
relative to the working directory, as for ``moe-dist train``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from ..config import ConfigError

LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")
TOP_KEYS = ("out", "base", "overrides", "seeds", "reference", "routers", "variants", "eval_k", "runs_at_once",
            "processes_per_run", "threads_per_run")
ROUTER_KEYS = ("router", "options", "overrides", "compare_to")


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"study {key}: {msg}")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def override_text(key: str, value: Any) -> str:
    """``KEY=VALUE`` with the value written as JSON (which YAML reads back unchanged)."""
    return f"{key}={json.dumps(value)}"


def _overrides(value: Any, key: str) -> list[str]:
    """A mapping ``{KEY: VALUE}`` or a list of ``KEY=VALUE`` strings, as override strings."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [override_text(str(k), v) for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return list(value)
    _fail(key, f"got {value!r}; allowed: a mapping of KEY: VALUE or a list of KEY=VALUE strings")
    return []


@dataclass
class RouterEntry:
    label: str
    router: str
    options: dict
    overrides: list[str]
    compare_to: Optional[str]


@dataclass
class RunSpec:
    """One grid point: where it runs and the overrides of its training config."""

    name: str
    router: str  # the router entry's label
    variant: str
    seed: int
    run_dir: str
    overrides: list[str]

    def as_dict(self) -> dict:
        return {"name": self.name, "router": self.router, "variant": self.variant, "seed": self.seed,
                "run_dir": self.run_dir, "overrides": self.overrides}


@dataclass
class Study:
    path: str
    out: str
    base: str
    overrides: list[str]
    seeds: list[int]
    reference: str
    routers: dict[str, RouterEntry]
    variants: dict[str, list[str]]
    eval_k: list[int]
    processes_per_run: int
    threads_per_run: int
    runs_at_once: int
    runs: list[RunSpec] = field(default_factory=list)

    @property
    def runs_dir(self) -> str:
        return os.path.join(self.out, "runs")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(key, f"got {value!r}; allowed: an integer >= 1")
    return value


def _label(value: Any, key: str) -> str:
    if not isinstance(value, str) or not LABEL.match(value):
        _fail(key, f"label {value!r}; allowed: letters, digits and _ . + -")
    return value


def _routers(raw: Any) -> dict[str, RouterEntry]:
    if not isinstance(raw, dict) or not raw:
        _fail("routers", f"got {raw!r}; allowed: a non-empty mapping of label: {{router, options, overrides, compare_to}}")
    out = {}
    for label, entry in raw.items():
        label = _label(label, "routers")
        entry = {} if entry is None else entry
        if not isinstance(entry, dict):
            _fail(f"routers.{label}", f"got {entry!r}; allowed: a mapping with keys {list(ROUTER_KEYS)}")
        unknown = sorted(set(entry) - set(ROUTER_KEYS))
        if unknown:
            _fail(f"routers.{label}", f"unknown key(s) {unknown}; allowed: {list(ROUTER_KEYS)}")
        options = entry.get("options") or {}
        if not isinstance(options, dict):
            _fail(f"routers.{label}.options", f"got {options!r}; allowed: a mapping of router options")
        out[label] = RouterEntry(label=label, router=str(entry.get("router", label)), options=dict(options),
                                 overrides=_overrides(entry.get("overrides"), f"routers.{label}.overrides"),
                                 compare_to=entry.get("compare_to"))
    for e in out.values():
        if e.compare_to is not None and e.compare_to not in out:
            _fail(f"routers.{e.label}.compare_to", f"{e.compare_to!r} is not a router label; allowed: {sorted(out)}")
    return out


def load_study(path: str, out: Optional[str] = None, runs_at_once: Optional[int] = None) -> Study:
    """Read and check a study file; ``out`` / ``runs_at_once`` replace the file's values."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: study file {path!r} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        _fail("file", f"{path!r} must hold a mapping with keys {list(TOP_KEYS)}")
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        _fail("file", f"unknown key(s) {unknown}; allowed: {list(TOP_KEYS)}")
    if not raw.get("base"):
        _fail("base", "missing; allowed: the path of a training config (e.g. configs/tiny.yaml)")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                      for s in seeds) or len(set(seeds)) != len(seeds):
        _fail("seeds", f"got {seeds!r}; allowed: a non-empty list of distinct integers >= 0")
    routers = _routers(raw.get("routers"))
    reference = raw.get("reference", next(iter(routers)))
    if reference not in routers:
        _fail("reference", f"{reference!r} is not a router label; allowed: {sorted(routers)}")
    variants_raw = raw.get("variants") or {"default": {}}
    if not isinstance(variants_raw, dict):
        _fail("variants", f"got {variants_raw!r}; allowed: a mapping of label: {{KEY: VALUE}}")
    variants = {_label(k, "variants"): _overrides(v, f"variants.{k}") for k, v in variants_raw.items()}
    eval_k = raw.get("eval_k") or []
    if not isinstance(eval_k, list) or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in eval_k):
        _fail("eval_k", f"got {eval_k!r}; allowed: a list of integers >= 1 (empty: no inference-k evaluation)")
    procs = _positive_int(raw.get("processes_per_run", 1), "processes_per_run")
    threads = _positive_int(raw.get("threads_per_run", 1), "threads_per_run")
    at_once = runs_at_once if runs_at_once is not None else raw.get("runs_at_once", "auto")
    if at_once == "auto":
        at_once = max(1, usable_cores() // (procs * threads))
    at_once = _positive_int(at_once, "runs_at_once (or --runs-at-once)")
    study = Study(path=path, out=out or str(raw.get("out") or "runs/study"), base=str(raw["base"]),
                  overrides=_overrides(raw.get("overrides"), "overrides"), seeds=list(seeds), reference=reference,
                  routers=routers, variants=variants, eval_k=sorted(set(eval_k)), processes_per_run=procs,
                  threads_per_run=threads, runs_at_once=at_once)
    study.runs = expand(study)
    return study


def expand(study: Study) -> list[RunSpec]:
    """The grid, routers outermost then variants then seeds (so each router's seeds finish together)."""
    runs = []
    one_variant = len(study.variants) == 1
    for label, entry in study.routers.items():
        for variant, variant_overrides in study.variants.items():
            for seed in study.seeds:
                name = f"{label}-s{seed}" if one_variant else f"{label}-{variant}-s{seed}"
                run_dir = os.path.join(study.runs_dir, name)
                overrides = [*study.overrides, *variant_overrides, *entry.overrides,
                             override_text("model.moe.router", entry.router),
                             *(override_text(f"model.moe.router_options.{k}", v) for k, v in entry.options.items()),
                             override_text("train.seed", seed), override_text("run.dir", run_dir),
                             f"run.threads={study.threads_per_run}", "run.progress=false"]
                runs.append(RunSpec(name=name, router=label, variant=variant, seed=seed, run_dir=run_dir,
                                    overrides=overrides))
    return runs


def check_runs(study: Study) -> dict[str, Any]:
    """Load every run's training config (errors name the run and the key). Returns {run name: Config}."""
    from ..config import load_config

    configs = {}
    for run in study.runs:
        try:
            cfg = load_config(study.base, run.overrides)
            cfg.check_world(study.processes_per_run)
        except ConfigError as e:
            raise ConfigError(f"run {run.name}: {e}") from None
        configs[run.name] = cfg
    return configs
