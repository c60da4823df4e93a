"""The import structure of moe_dist: imports point down the layers, no module of any package
imports itself through others, and every module of moe_dist.train imports on its own.

Two checks: (1) the static graph of import statements (module level and inside functions,
so lazy imports count too) of the whole moe_dist package; (2) each module of moe_dist.train
imported first in a process of its own (a fork of an interpreter that has loaded torch but
no moe_dist module), so an import cycle that only breaks in some order shows up.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import moe_dist

PACKAGE_DIR = os.path.dirname(os.path.abspath(moe_dist.__file__))
ROOT = os.path.dirname(PACKAGE_DIR)
TRAINER = "moe_dist.train.loop.trainer"
LAYERS_BELOW_TRAINER = ("moe_dist.train.engines", "moe_dist.train.checkpoint")


def _modules() -> dict[str, str]:
    """Dotted name -> file of every module of moe_dist (a package by its ``__init__.py``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE_DIR):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The moe_dist modules that ``name``'s import statements name (a ``from X import y`` names
    ``X.y`` when that is a module, else ``X``)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_engines_and_checkpoints_do_not_import_the_trainer():
    graph = _graph()
    below = [m for m in graph if m.startswith(LAYERS_BELOW_TRAINER)]
    assert "moe_dist.train.engines.deepspeed" in below and "moe_dist.train.checkpoint.resume" in below
    for module in below:
        assert TRAINER not in _reachable(graph, module), f"{module} imports {TRAINER} (directly or through others)"
    # and the trainer reaches both (it holds an engine and the checkpoints)
    assert {"moe_dist.train.engines", "moe_dist.train.checkpoint"} <= _reachable(graph, TRAINER)


# the packages of moe_dist from the top (commands) down; a module imports only from its own package
# or from packages on a lower line (tests/test_imports.py is where this order is written down)
LAYERS = (
    ("moe_dist.cli",),
    ("moe_dist.commands",),  # one module per subcommand: parses, then calls into the library below
    ("moe_dist.local_launch", "moe_dist.torchrun_launch"),
    ("moe_dist.upcycle", "moe_dist.study"),
    ("moe_dist.plan",),
    ("moe_dist.hf",),
    ("moe_dist.train",),
    ("moe_dist.data", "moe_dist.diagnostics", "moe_dist.parallel", "moe_dist.config", "moe_dist.weights",
     "moe_dist.integrations", "moe_dist.exits"),
    ("moe_dist.model",),
    ("moe_dist.moe",),
    ("moe_dist.tuning",),  # the choices made by timing: the experts and attention name what they offer it
    ("moe_dist.distributed",),
    ("moe_dist.checks", "moe_dist.safe_dcp"),
    ("moe_dist.safe_io",),
    ("moe_dist.errors", "moe_dist.hardware", "moe_dist.ports", "moe_dist.quiet"),
)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_imports_point_down_the_layers():
    level = {pkg: i for i, line in enumerate(LAYERS) for pkg in line}
    graph = _graph()
    unplaced = sorted({_package(m) for m in graph if m != "moe_dist"} - set(level))
    assert not unplaced, f"packages missing from LAYERS: {unplaced}"
    upward = [f"{m} -> {t}" for m, targets in sorted(graph.items()) if m != "moe_dist" for t in sorted(targets)
              if _package(t) != _package(m) and level[_package(t)] <= level[_package(m)]]
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


# inside moe_dist.moe, from the top: the layer; its options and the dispatcher; the routing stage; the
# routers, the shared expert and the experts (compute only); the routing types (what routers return and
# read), the row helpers. The dispatcher runs the experts and owns every exchange: the experts never
# import it, and the routing stage never imports the dispatcher.
MOE_FLOORS = (
    ("moe_dist.moe.layer",),
    ("moe_dist.moe.args", "moe_dist.moe.dispatch"),
    ("moe_dist.moe.routing",),
    ("moe_dist.moe.routers", "moe_dist.moe.shared", "moe_dist.moe.experts"),
    ("moe_dist.moe.routing.types", "moe_dist.moe.rows", "moe_dist.moe.counting"),
)


def test_moe_imports_point_down_its_floors():
    level = {unit: i for i, line in enumerate(MOE_FLOORS) for unit in line}
    graph = _graph()

    def unit(module: str) -> str:  # the longest floor entry that is the module or a package above it
        return max((u for u in level if module == u or module.startswith(u + ".")), key=len, default=module)

    inside = {m for m in graph if m.startswith("moe_dist.moe.")}
    unplaced = sorted({unit(m) for m in inside} - set(level))
    assert not unplaced, f"modules of moe_dist.moe missing from MOE_FLOORS: {unplaced}"
    upward = [f"{m} -> {t}" for m in sorted(inside) for t in sorted(graph[m])
              if t.startswith("moe_dist.moe.") and unit(t) != unit(m) and level[unit(t)] <= level[unit(m)]]
    assert not upward, "imports inside moe_dist.moe that do not point down its floors:\n" + "\n".join(upward)


# outside the installed package, above all of it: the benchmarks (benchmarks/, run from a checkout) and
# the test infrastructure (tests/helpers/: namespace clusters, Slurm daemons). moe_dist imports neither.
OUTSIDE_THE_PACKAGE = ("benchmarks", "tests", "helpers")


def _top_level_imports(path: str) -> set[str]:
    """The first names of every absolute import statement in ``path`` (module level and inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_imports_no_benchmark_or_test_infrastructure():
    """No module of moe_dist imports the benchmarks or the test helpers, and neither lives inside it."""
    users = sorted(f"{m} -> {sorted(_top_level_imports(p) & set(OUTSIDE_THE_PACKAGE))}"
                   for m, p in _modules().items() if _top_level_imports(p) & set(OUTSIDE_THE_PACKAGE))
    assert not users, "modules of moe_dist that import benchmarks or test infrastructure:\n" + "\n".join(users)
    inside = [d for d in ("bench", "testing") if any(m.startswith(f"moe_dist.{d}") for m in _modules())]
    assert not inside, f"moe_dist/{inside[0]} is back inside the package (benchmarks/ and tests/helpers/ are its homes)"


def test_benchmarks_import_only_the_package_and_the_cluster_harness():
    """benchmarks/ sits on top: it imports moe_dist, itself and, for the cluster benchmarks, the
    namespace-cluster harness (tests.helpers.cluster); nothing else of the tests."""
    bench_dir = os.path.join(ROOT, "benchmarks")
    found = {}
    for dirpath, dirnames, filenames in os.walk(bench_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                        found.setdefault(node.module, set()).add(os.path.relpath(path, ROOT))
    assert any(m.startswith("moe_dist.") for m in found)
    tests_used = {m for m in found if m.split(".")[0] in ("tests", "helpers")}
    assert tests_used <= {"tests.helpers.cluster"}, f"benchmarks importing test modules: {sorted(tests_used)}"
    assert "tests.helpers.cluster" in tests_used  # the cluster benchmarks still import it from its home


def test_no_import_cycle():
    """No module of any package of moe_dist imports itself through others (a package's
    ``__init__`` counts as a module)."""
    graph = _graph()
    packages = sorted({_package(m) for m in graph if m != "moe_dist"})
    assert {"moe_dist.train", "moe_dist.hf", "moe_dist.moe", "moe_dist.config"} <= set(packages)
    cycles = [m for m in sorted(graph) if m in _reachable(graph, m)]
    assert not cycles, f"modules that import themselves through others: {cycles}"


_FRESH_IMPORTS = r"""
import importlib, os, sys, traceback
import torch, numpy  # loaded once; every module below is imported in a fork that has no moe_dist module yet
assert not any(m == "moe_dist" or m.startswith("moe_dist.") for m in sys.modules)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("failed:", failed)
sys.exit(1 if failed else 0)
"""


def test_each_train_module_imports_first():
    names = sorted(m for m in _modules() if m.startswith("moe_dist.train"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FRESH_IMPORTS, *names], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_test_modules_do_not_import_each_other():
    """Shared test cases live in the helper package tests/helpers/ (moe_cases, probe_router, ...),
    never in a test_* module that another imports (that would run its tests' module code twice and
    hide the coupling); tests/ itself holds only test modules and conftest.py."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    helpers_dir = os.path.join(tests_dir, "helpers")
    stray = sorted(n for n in os.listdir(tests_dir) if n.endswith(".py") and not n.startswith("test_")
                   and n != "conftest.py")
    assert not stray, f"modules in tests/ that are not tests (move them into tests/helpers/): {stray}"
    files = [os.path.join(tests_dir, n) for n in sorted(os.listdir(tests_dir))]
    files += [os.path.join(helpers_dir, n) for n in sorted(os.listdir(helpers_dir))]
    bad = []
    for path in files:
        name = os.path.relpath(path, tests_dir)
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), name)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{name}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, f"test modules imported by others (move the shared cases into a helper module): {bad}"
