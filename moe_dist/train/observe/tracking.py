"""Weights & Biases beside metrics.jsonl and TensorBoard (``log.wandb``), from rank 0 only.

What a run sends: every metrics.jsonl row at its own step (numbers as scalars under the same
names as in TensorBoard, ``train/loss``, ``val/ppl``, ``moe_layer0/aux_loss``; per-expert lists such
as ``expert_counts`` and ``expert_bias`` as a histogram over the expert index, one per layer and
logged step: the data of the expert-load heatmap), the resolved config (overrides included) as the
W&B config, and the end-of-run summary (summary.json plus the per-layer routing summary).

One W&B run per training timeline: ``run.dir/wandb_run.json`` keeps its id and the last step sent.
A resumed or requeued run (``resume`` other than ``none``) continues that W&B run
(``resume="allow"`` with the kept id); ``resume=none`` starts a new one. W&B cannot delete logged
steps, so a resume from a checkpoint older than the last step sent replays steps W&B already
has: those are not sent again (W&B keeps the values first logged for them; metrics.jsonl holds
the replayed ones), and sending resumes after the last step sent. No step is sent twice.

Offline (``log.wandb_mode: offline`` or ``WANDB_MODE=offline``, for nodes without internet): the
run is written under ``run.dir/wandb/offline-run-*``; ``wandb sync`` uploads it later.
"""
from __future__ import annotations

import importlib.util
import os
import secrets
import string
import sys
from typing import Any, Optional

from ...config import Config
from ...config.load import config_to_dict
from ...errors import ConfigError, UserError, install_hint
from ...exits import EXIT_PREEMPTED, exit_code_of
from ...safe_io import UnreadableFile, read_json, write_json_atomically
from .metrics import layer_tag, max_load_ratio, scalar_tag

STATE_FILE = "wandb_run.json"
ID_CHARS = string.ascii_lowercase + string.digits  # W&B run ids: 8 of these, as wandb makes them


def install_command() -> str:
    return install_hint("wandb")


def wandb_installed() -> bool:
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent package
        return False


def check_tracking(cfg: Config) -> None:
    """``log.wandb: true`` needs the wandb package (checked before launch and on every rank)."""
    if cfg.log.wandb and not wandb_installed():
        raise ConfigError(f"log.wandb: true needs the wandb package, which {sys.executable} cannot import; install "
                          f"it with `{install_command()}` (or `pip install wandb`), or set log.wandb=false")


def read_state(run_dir: str) -> Optional[dict]:
    """``{"id", "last_step"}`` of the W&B run this run directory logs to, or None."""
    path = os.path.join(run_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    try:
        state = read_json(path, 64 * 1024)
    except UnreadableFile as e:
        raise UserError(f"{e}; the W&B state of this run directory (remove it to start a new W&B run)") from None
    if not isinstance(state, dict) or not isinstance(state.get("id"), str):
        raise UserError(f"{path}: not the W&B state moe-dist writes (an object with a string \"id\"); remove it to "
                        "start a new W&B run")
    return state


def write_state(run_dir: str, state: dict) -> None:
    path = os.path.join(run_dir, STATE_FILE)
    write_json_atomically(path, state, indent=None)


def new_run_id() -> str:
    return "".join(secrets.choice(ID_CHARS) for _ in range(8))


def _histogram(values: list):
    """A W&B histogram whose bins are the list's positions (expert 0, 1, ...) and heights its values;
    None for a list longer than W&B allows."""
    import wandb

    if len(values) > wandb.Histogram.MAX_LENGTH:
        return None
    return wandb.Histogram(np_histogram=(list(values), list(range(len(values) + 1))))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float))  # bools too: ``skipped`` is sent as 1


def wandb_row(row: dict) -> dict:
    """The W&B entries of one metrics.jsonl row (its ``step`` is the W&B step, not an entry)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key not in ("step", "moe") and _is_number(value):
            out[scalar_tag(key)] = float(value)
    for key, value in row.get("time", {}).items():  # a profiled step's split, as in TensorBoard
        out[f"time/{key}"] = float(value)
    for layer, stats in row.get("moe", {}).items():
        for key, value in stats.items():
            if _is_number(value):
                out[layer_tag(layer, key)] = float(value)
            elif isinstance(value, list) and value and all(_is_number(v) for v in value):
                hist = _histogram(value)
                if hist is not None:
                    out[layer_tag(layer, key)] = hist
        ratio = max_load_ratio(stats.get("expert_counts"))
        if ratio is not None:
            out[layer_tag(layer, "max_load_ratio")] = ratio
    return out


class WandbTracker:
    """The W&B run of a training run (rank 0). :meth:`log` takes metrics.jsonl rows."""

    def __init__(self, run, run_dir: str, last_step: int):
        self.run = run
        self.run_dir = run_dir
        self.last_step = last_step

    @classmethod
    def start(cls, cfg: Config, new_timeline: bool) -> "WandbTracker":
        """Start (``new_timeline``: a new W&B run) or continue the W&B run recorded in run.dir."""
        import wandb

        run_dir, log = cfg.run.dir, cfg.log
        state = None if new_timeline else read_state(run_dir)
        if state is None:
            state = {"id": new_run_id(), "last_step": 0}
        write_state(run_dir, state)
        try:
            run = wandb.init(id=state["id"], resume="allow", project=log.wandb_project, entity=log.wandb_entity,
                             name=log.wandb_name or os.path.basename(os.path.normpath(os.path.abspath(run_dir))),
                             tags=list(log.wandb_tags), mode=log.wandb_mode, dir=run_dir,
                             config=config_to_dict(cfg))
        except wandb.Error as e:
            raise ConfigError(f"log.wandb: could not start the W&B run ({e}); log in with `wandb login`, or run "
                              "offline (log.wandb_mode=offline or WANDB_MODE=offline) and `wandb sync` later") from None
        return cls(run, run_dir, int(state["last_step"]))

    def describe(self, step: int) -> str:
        """One line for the run's log: where the W&B run goes and, when this run starts at ``step``
        below the last step sent, which steps it will not send again."""
        where = (f"offline in {self.run.settings.sync_dir} (upload later: wandb sync {self.run.settings.sync_dir})"
                 if self.run.offline else self.run.url or "online")
        text = f"wandb: run {self.run.id}, {where}"
        if self.last_step:
            text += f"; continued after step {self.last_step}"
        if self.last_step > step:
            text += f" (steps {step + 1}..{self.last_step} replayed now are not sent again)"
        return text

    def log(self, row: dict) -> None:
        """Send a metrics.jsonl row at its step, unless W&B already has that step."""
        step = int(row["step"])
        if step <= self.last_step:  # replayed after a resume: W&B has this step
            return
        self.last_step = step
        write_state(self.run_dir, {"id": self.run.id, "last_step": step})  # before sending: never twice
        self.run.log(wandb_row(row), step=step)

    def summary(self, summary: dict, routing: dict) -> None:
        """The end-of-run summary (summary.json) and the per-layer routing summary."""
        self.run.summary.update({**summary, "routing": routing})

    def finish(self, error: Optional[BaseException] = None) -> None:
        """End the W&B run: finished, or failed / preempting with the exit code ``error`` ends the process with."""
        if self.run is None:
            return
        code = exit_code_of(error)
        if code == EXIT_PREEMPTED:
            self.run.mark_preempting()
        run, self.run = self.run, None
        run.finish(exit_code=code)


def start_tracking(cfg: Config, is_main: bool, new_timeline: bool, group=None) -> Optional[WandbTracker]:
    """Rank 0's :class:`WandbTracker` (None elsewhere or when ``log.wandb`` is false). Collective when
    ``log.wandb`` is set: a W&B run that cannot start stops every rank with the same error."""
    from ..checkpoint.collective import broadcast

    if not cfg.log.wandb:
        return None
    tracker, error = None, None
    if is_main:
        try:
            tracker = WandbTracker.start(cfg, new_timeline)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before it is raised
            error = e
    report = broadcast(None if error is None else (isinstance(error, ConfigError), str(error)), group)
    if error is not None:
        raise error
    if report:
        user_error, message = report
        raise ConfigError(message) if user_error else RuntimeError(f"rank 0 could not start the W&B run: {message}")
    return tracker
