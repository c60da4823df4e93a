"""What a section sees: its :class:`Context` (device, sizes, deadline, figures so far), the two
outcomes other than success (:class:`Skip`, :class:`SectionFailed`), the result files and the
commands it starts from the repository root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

from .settings import INJECT_ENV, ROOT, Sizes, sizes_for


class Skip(Exception):
    """The section cannot run here (said why); reported as skipped, not failed."""


class SectionFailed(Exception):
    """The section ran and its check failed; ``figures`` are still reported."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures



@dataclass
class Context:
    name: str
    device: str
    quick: bool
    out: str
    work: str
    deadline: float  # time.monotonic() by which the section must be done
    figures: dict = field(default_factory=dict)

    @property
    def sizes(self) -> Sizes:
        return sizes_for(self.device, self.quick)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, *parts: str) -> str:
        """A file under --work (its directory made)."""
        p = os.path.join(self.work, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def fresh_dir(self, *parts: str) -> str:
        """A run directory under --work, removed if a previous run left it (the trainer makes it again)."""
        d = os.path.join(self.work, *parts)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        return d

    def partial(self, **figures) -> None:
        """Figures so far, written at once: a section stopped by its time limit keeps them."""
        self.figures.update(figures)
        write_json(result_path(self.work, self.name), {"status": "running", "figures": self.figures})


def result_path(work: str, name: str) -> str:
    return os.path.join(work, "results", f"{name}.json")


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def child_env(extra: Optional[dict] = None) -> dict:
    """This environment with the repository importable (whether or not the package is installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(INJECT_ENV, None)  # the hook acts on this check's sections, not on what they start
    env["PYTHONUNBUFFERED"] = "1"  # a process stopped at its time limit has printed all it had
    env.update(extra or {})
    return env


def run_command(cmd: list[str], timeout_s: float, stdout=None, env: Optional[dict] = None) -> int:
    """Run ``cmd`` from the repository root, printing into this section's log; its exit code."""
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), stdout=stdout, stderr=subprocess.STDOUT
                          if stdout is None else None, timeout=max(1.0, timeout_s))
    return done.returncode


def check_device(device: str) -> None:
    """A clear one-line error when the device cannot be used here."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda="
                           f"{torch.version.cuda}); use --device cpu to run this check on the CPU")
    if device not in ("cuda", "cpu"):
        raise RuntimeError(f"--device {device!r}; allowed: cuda, cpu")
