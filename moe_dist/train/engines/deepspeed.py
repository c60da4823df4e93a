"""``train.engine: deepspeed``: the same model, data, loss and schedule, updated by DeepSpeed ZeRO-1/2.

What stays ours: the model and its MoE layers (routing, all-to-all dispatch over our expert-
parallel group), the data order, the loss shares, the learning-rate schedule, evaluation,
metrics and checkpoints. What DeepSpeed does: gradient reduction, ZeRO partitioning of the
optimizer state (stage 1) and of the gradients (stage 2), clipping and the optimizer step.

Expert parameters go into DeepSpeed's MoE parameter groups: each is tagged
``allreduce=False, group_name="ep_size_<ep>"`` and the optimizer's groups are split with
``split_params_into_different_moe_groups_for_optimizer``, so DeepSpeed reduces them over its
expert-data-parallel group (the ranks that hold the same experts; checked against ours) and
dense parameters over all ranks. DeepSpeed *averages* every gradient over the data-parallel
world (it divides by the world size, also for experts), while our loss is each rank's share
of the global loss with gradients *summed* (moe_dist.parallel.grad_sync); scaling the loss by
the world size makes the two identical. The gradient norm DeepSpeed clips with counts every
expert once (it sums the partitions over all ranks), like the native engine's.

DeepSpeed only recognises its own ``deepspeed.moe.layer.MoE`` modules as MoE layers; while
``deepspeed.initialize`` runs, a parameter-less marker of that class sits in the model so that
the engine configures ZeRO for MoE, and it is removed right after.

The ds_config JSON (``deepspeed.config``) is honoured: ZeRO settings (bucket sizes, overlap,
offload, ...), ``gradient_clipping``, an ``optimizer`` block (DeepSpeed then builds it from our
parameter groups; the learning rate still follows ``train.lr`` and its schedule). Keys the
config already fixes must agree with it (batch sizes, accumulation); keys that would change
the model's numerics or our schedule are refused with a message: ``fp16``/``bf16`` (use
``train.dtype=bf16``: autocast with fp32 weights, like the native engine), ``scheduler``, and
ZeRO stages other than 1 and 2 (DeepSpeed's MoE refuses stage 3).

Checkpoints are the native format (moe_dist.train.checkpoint): model weights and AdamW state
keyed by parameter name and global expert. The ZeRO-partitioned optimizer state is gathered
per parameter with ``deepspeed.utils.safe_get_full_optimizer_state`` before a save and
scattered back with ``safe_set_full_optimizer_state`` after a resume, so a run can move
between the engines, world sizes and expert-parallel sizes. DeepSpeed's own
``engine.save_checkpoint`` is not used.

A non-finite step is skipped like the native engine's: DeepSpeed's ZeRO overflow check (NaN/Inf
in any gradient partition) is switched on for fp32 weights, and the trainer's verdict on the
loss (non-finite, a spike, NaN router logits) raises the same flag, so no update is applied.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import os
import socket
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ...config import ConfigError
from ...model.init import is_meta, materialize
from ...moe import moe_layers
from ...parallel import apply_expert_parallel, expert_parameters
from ..loop.optim import build_optimizer
from .base import Engine

ZERO_STAGES = (1, 2)
REFUSED_KEYS = {
    "fp16": "use train.dtype=bf16 (autocast, fp32 weights) instead; the router math stays fp32",
    "bf16": "use train.dtype=bf16 (autocast, fp32 weights) instead; the router math stays fp32",
    "scheduler": "the learning rate follows train.lr, train.warmup_steps and train.min_lr_ratio in both engines",
}


def deepspeed_available() -> tuple[bool, str]:
    """(importable, why not)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def require_deepspeed(device_type: str) -> None:
    """Import DeepSpeed for ``train.engine: deepspeed`` on a ``device_type`` ("cpu" / "cuda") device,
    or raise the user's error (any import failure, a broken installation too)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import: DeepSpeed picks its accelerator then
    ok, why = deepspeed_available()
    if not ok:
        raise ConfigError(f"train.engine: 'deepspeed' needs DeepSpeed (pip install -e '.[deepspeed]'): {why}; "
                          "allowed without it: 'native'")


def expert_group_name(ep: int) -> str:
    """DeepSpeed's name for the expert-parallel group of size ``ep`` (and of its expert-DP group)."""
    return f"ep_size_{ep}"


# ---- the ds_config ------------------------------------------------------------------------------------------
def load_user_config(path: Optional[str]) -> dict:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            user = json.load(f)
    except OSError as e:
        raise ConfigError(f"deepspeed.config: cannot read {path!r} ({e.strerror}); allowed: a DeepSpeed JSON config "
                          "file or null") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.config: {path!r} is not valid JSON ({e})") from None
    if not isinstance(user, dict):
        raise ConfigError(f"deepspeed.config: {path!r} must hold a JSON object, got {type(user).__name__}")
    return user


def build_ds_config(cfg, world_size: int, user: Optional[dict] = None) -> dict:
    """The DeepSpeed config for this run: the user's JSON with what our config decides filled in.

    Raises ConfigError naming the key when the JSON disagrees with our config or asks for
    something this engine does not do."""
    user = copy.deepcopy(user if user is not None else load_user_config(cfg.deepspeed.config))
    src = f"deepspeed.config ({cfg.deepspeed.config})" if cfg.deepspeed.config else "deepspeed"
    for key, why in REFUSED_KEYS.items():
        block = user.get(key)
        if block is not None and (key == "scheduler" or (isinstance(block, dict) and block.get("enabled", False))):
            raise ConfigError(f"{src}: key {key!r} is not supported with train.engine=deepspeed; {why}")

    t = cfg.train
    per_forward = t.global_batch // t.grad_accum
    micro = max(1, per_forward // world_size)  # ranks may differ by one sequence; only DeepSpeed's bookkeeping
    ours = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": t.grad_accum,
            "train_batch_size": micro * t.grad_accum * world_size}
    for key, value in ours.items():
        if key in user and user[key] != value:
            raise ConfigError(f"{src}: {key}={user[key]!r} disagrees with this run ({value}, from train.global_batch="
                              f"{t.global_batch}, train.grad_accum={t.grad_accum} and {world_size} rank(s)); "
                              "remove it from the JSON or change the train.* keys")
        user[key] = value

    zero = user.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{src}: zero_optimization must be an object")
    stage = cfg.deepspeed.zero_stage if cfg.deepspeed.zero_stage is not None else zero.get("stage", 2)
    if stage not in ZERO_STAGES:
        where = "deepspeed.zero_stage" if cfg.deepspeed.zero_stage is not None else f"{src}: zero_optimization.stage"
        raise ConfigError(f"{where}: {stage!r} is not allowed; allowed: 1, 2 (DeepSpeed's MoE does not run under "
                          "ZeRO-3; stage 0 is the native engine's job)")
    zero["stage"] = stage
    if zero.get("reduce_scatter") is False:
        raise ConfigError(f"{src}: zero_optimization.reduce_scatter=false is not allowed with MoE layers; allowed: true")
    zero["reduce_scatter"] = True
    if stage == 2 and zero.get("contiguous_gradients") is False:
        raise ConfigError(f"{src}: zero_optimization.contiguous_gradients=false is not allowed with MoE layers at "
                          "stage 2; allowed: true")
    zero.setdefault("contiguous_gradients", True)

    user.setdefault("gradient_clipping", float(t.grad_clip or 0.0))
    user.setdefault("steps_per_print", 10 ** 9)
    user.setdefault("wall_clock_breakdown", False)
    user.setdefault("zero_allow_untested_optimizer", True)
    return user


# ---- building the engine --------------------------------------------------------------------------------------
def _deepspeed_moe_marker(num_experts: int, ep: int):
    """A parameter-less ``deepspeed.moe.layer.MoE`` that makes the engine set ZeRO up for MoE."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    class _MoEMarker(MoE):
        def __init__(self):
            nn.Module.__init__(self)  # not MoE.__init__: no gate, no experts
            self.num_experts, self.ep_size = num_experts, ep
            self.expert_group_name = expert_group_name(ep)

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            if self.expert_group_name not in groups._get_expert_parallel_group_dict():
                groups._create_expert_and_data_parallel(self.ep_size,
                                                        use_data_before_expert_parallel_=use_data_before_expert_parallel_)

        def forward(self, *args, **kwargs):  # pragma: no cover - never part of the forward pass
            raise RuntimeError("the DeepSpeed MoE marker is not a layer")

    return _MoEMarker()


def _same_ranks(ours: Optional[dist.ProcessGroup], theirs, what: str) -> None:
    mine = dist.get_process_group_ranks(ours) if ours is not None else [dist.get_rank()]
    other = dist.get_process_group_ranks(theirs)
    if sorted(mine) != sorted(other):
        raise RuntimeError(f"DeepSpeed's {what} group {other} differs from moe_dist's {mine}")


def _moe_optimizer(model: nn.Module, train_cfg, ep: int) -> torch.optim.Optimizer:
    """Our AdamW (moe_dist.train.loop.optim), its expert parameters tagged and moved into DeepSpeed's
    MoE parameter groups (one per expert group name, ``moe=True``)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    for p in expert_parameters(model):
        p.allreduce = False  # DeepSpeed: not reduced over all ranks ...
        p.group_name = expert_group_name(ep)  # ... but over this group's expert-data-parallel ranks
    optimizer = build_optimizer(model, train_cfg)
    groups = [dict(g) for g in optimizer.param_groups]
    optimizer.param_groups = []
    for g in split_params_into_different_moe_groups_for_optimizer(groups):
        if g["params"]:
            optimizer.add_param_group(g)
    return optimizer


def build_deepspeed_engine(model: nn.Module, rt, cfg, log: Callable[[str], None] = print,
                           fill: Optional[Callable[[nn.Module], None]] = None):
    """Expert parallelism (our layout), then ``deepspeed.initialize`` over our process group.
    Returns the engine; ``engine.module`` is ``model``."""
    require_deepspeed(rt.device.type)
    import deepspeed
    from deepspeed.utils import groups as ds_groups
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    ds_config = build_ds_config(cfg, rt.world_size)
    apply_expert_parallel(model, rt.groups)
    if is_meta(model):  # built on the meta device: allocate and fill only this rank's experts
        fill(materialize(model, rt.device))
    else:
        model.to(rt.device)
    ep = rt.groups.ep_size
    # DeepSpeed reads its place from torchrun-style variables, whoever launched us (srun, mpirun, a test)
    for var, value in (("LOCAL_RANK", rt.launch.local_rank), ("RANK", rt.rank), ("WORLD_SIZE", rt.world_size),
                       ("LOCAL_SIZE", rt.launch.local_world_size)):
        os.environ.setdefault(var, str(value))
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)

    optimizer = _moe_optimizer(model, cfg.train, ep)
    params = None
    if "optimizer" in ds_config:  # the user's optimizer block: DeepSpeed builds it from our parameter groups
        params, optimizer = [dict(g) for g in optimizer.param_groups], None
    moe = [layer for layer in moe_layers(model)]
    model._deepspeed_moe_marker = _deepspeed_moe_marker(moe[0].num_experts if moe else 1, ep)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=params, config=ds_config)
    finally:
        del model._deepspeed_moe_marker
    name = expert_group_name(ep)
    _same_ranks(rt.groups.ep, ds_groups._get_expert_parallel_group(name), "expert-parallel")
    _same_ranks(rt.groups.edp, ds_groups._get_expert_data_parallel_group(name), "expert-data-parallel")
    zero = ds_config["zero_optimization"]
    log(f"engine: DeepSpeed {deepspeed.__version__} ZeRO-{zero['stage']}, experts in group {name} "
        f"(reduced over {dist.get_world_size(ds_groups._get_expert_data_parallel_group(name))} rank(s)), "
        f"optimizer {type(engine.optimizer.optimizer).__name__}, gradient clipping {ds_config['gradient_clipping']}")
    return engine


# ---- the optimizer state, per parameter ------------------------------------------------------------------------
class ZeroStateView:
    """The per-parameter face of a ZeRO-1/2 optimizer, for the trainer and the checkpoint code.

    ``param_groups``: one group of the model's trainable parameters; the trainer sets its
    ``lr`` and :meth:`DeepSpeedEngine.step` copies it to DeepSpeed's groups before a step.
    ``state[p]``: full AdamW tensors of parameter ``p`` (as the native engine keeps them), filled
    by :meth:`gather` (collective) for a save, or by the checkpoint loader and then pushed into
    DeepSpeed's partitions by :meth:`scatter` (collective) after a resume.
    """

    def __init__(self, engine, model: nn.Module):
        self.engine, self.zero = engine, engine.optimizer
        seen, params = set(), []
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        self.params = params
        self.param_groups = [{"params": params, "lr": self.zero.param_groups[0]["lr"]}]
        self.state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}

    def _base_state(self) -> list[dict]:
        base = self.zero.optimizer
        return [base.state.get(flat, {}) for flat in self.zero.single_partition_of_fp32_groups]

    def _link(self) -> None:
        """(Re)point every parameter's fragment mapping at the optimizer state of its group. DeepSpeed
        links once, after the first group's first step, before the other groups have state."""
        link = getattr(self.zero, "_lazy_init_hp_params_optimizer_state", None)
        if link is None or not hasattr(self.zero, "_hp_optimizer_states_linked"):
            raise RuntimeError("this DeepSpeed version cannot link optimizer state to parameters; checkpoints of "
                               "train.engine=deepspeed runs need deepspeed==0.19.8")
        self.zero._hp_optimizer_states_linked = False
        link()

    def gather(self) -> None:
        """Full per-parameter state from DeepSpeed's partitions (empty before the first step)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self.state = {}
        states = [s for s in self._base_state() if s]
        if not states:
            return
        keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        step = states[0].get("step")
        self._link()
        for p in self.params:
            full = {k: safe_get_full_optimizer_state(p, k) for k in keys}
            if any(v is None for v in full.values()):
                raise RuntimeError("DeepSpeed returned no optimizer state for a parameter; is it under ZeRO-1/2?")
            if step is not None:
                full["step"] = torch.as_tensor(float(step), dtype=torch.float32).clone()
            self.state[p] = {k: v.detach().to(p.device).view_as(p) if v.dim() > 0 else v for k, v in full.items()}

    def release(self) -> None:
        self.state = {}

    def scatter(self) -> None:
        """Push ``state`` (full tensors) and the model's (just loaded) weights into DeepSpeed."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        for p in self.params:  # the fp32 master partitions follow the loaded weights
            safe_set_full_fp32_param(p, p.data.float())
        if not self.state:
            return
        sample = next(iter(self.state.values()))
        keys = [k for k, v in sample.items() if v.dim() > 0]
        step = sample.get("step")
        base = self.zero.optimizer
        for flat in self.zero.single_partition_of_fp32_groups:  # the state AdamW creates at its first step
            st = base.state.setdefault(flat, {})
            for k in keys:
                st.setdefault(k, torch.zeros_like(flat))
            if step is not None:
                st["step"] = torch.as_tensor(float(step), dtype=torch.float32).clone()
        self._link()
        for p in self.params:
            for k in keys:
                safe_set_full_optimizer_state(p, self.state[p][k].float(), k)
        self.release()


def _skip_by_overflow(zero, skip_requested: Callable[[], bool]) -> None:
    """Make the ZeRO-1/2 optimizer ``zero`` skip every step with a NaN/Inf gradient (its
    ``check_grad_overflow``, on for fp32 weights too) and every step ``skip_requested()`` asks to
    skip: its overflow flag is raised after its own check, so DeepSpeed's skip path (no update,
    gradients dropped) runs."""
    if not hasattr(zero, "check_grad_overflow") or not hasattr(zero, "check_overflow"):
        raise ConfigError("train.engine=deepspeed: this DeepSpeed version's ZeRO optimizer has no overflow check, so a "
                          "non-finite step could not be skipped; allowed: deepspeed==0.19.8, or train.engine=native")
    zero.check_grad_overflow = True
    check = zero.check_overflow

    def check_overflow(*args, **kwargs):
        check(*args, **kwargs)
        zero.overflow = bool(zero.overflow) or skip_requested()

    zero.check_overflow = check_overflow


def _single_process_group(rt) -> bool:
    """DeepSpeed needs torch.distributed even for one process: start a 1-rank gloo group."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo" if rt.device.type == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    return True


@contextlib.contextmanager
def single_process_group(rt) -> Iterator[None]:
    """A 1-rank group for the block when torch.distributed is not started (the engines built inside
    reuse it: DeepSpeed keeps its groups in module globals, which a destroyed group would leave stale)."""
    owned = _single_process_group(rt)
    try:
        yield
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO-1/2 doing the gradient reduction, clipping and the update."""

    def __init__(self, cfg, rt, log: Callable[[str], None] = print):
        super().__init__(cfg, rt, log)
        self._owns_single_group = False

    def prepare(self, model: nn.Module, fill: Callable[[nn.Module], None]) -> None:
        self.model = model
        self._owns_single_group = _single_process_group(self.rt)
        self.ds_engine = build_deepspeed_engine(model, self.rt, self.cfg, log=self.log, fill=fill)
        self.optimizer = ZeroStateView(self.ds_engine, model)
        self._skip_next = False
        _skip_by_overflow(self.ds_engine.optimizer, lambda: self._skip_next)
        # DeepSpeed divides every gradient by the data-parallel world size; our loss shares want sums
        self._loss_factor = float(dist.get_world_size())

    def dense_layout(self) -> str:
        return f"deepspeed-zero{self.ds_engine.zero_optimization_stage()}"  # parallel.dense is not used by this engine

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.ds_engine(tokens)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradient sync on the last micro-batch = DeepSpeed's accumulation boundary."""
        self.ds_engine.set_gradient_accumulation_boundary(enabled)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds_engine.backward(loss * self._loss_factor, scale_wrt_gas=False)

    def step(self, loss_finite: bool = True) -> float:
        """DeepSpeed's own overflow skip: its ZeRO optimizer checks every gradient partition for
        NaN/Inf (all-reduced over its data-parallel group, so every rank decides alike) and then
        drops the gradients without an update; a non-finite loss (or a loss spike) with finite
        gradients takes the same path. A skipped step reports the norm DeepSpeed gives (inf) or NaN."""
        lr = self.optimizer.param_groups[0]["lr"]
        for group in self.ds_engine.optimizer.param_groups:
            group["lr"] = lr
        self._skip_next = not loss_finite  # the same on every rank: global figures
        self.ds_engine.step()  # reduce (stage 1), check overflow, clip, step, zero the gradients
        self.skipped = bool(self.ds_engine.optimizer.overflow)
        norm = self.ds_engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self) -> None:
        """Nothing left to do: ``ds_engine.step()`` zeroes the gradients at the accumulation boundary."""

    @contextlib.contextmanager
    def state_for_save(self) -> Iterator[None]:
        self.optimizer.gather()
        try:
            yield
        finally:
            self.optimizer.release()

    def state_loaded(self) -> None:
        self.optimizer.scatter()

    def close(self) -> None:
        if self._owns_single_group and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["DeepSpeedEngine", "ZeroStateView", "build_deepspeed_engine", "build_ds_config", "deepspeed_available",
           "expert_group_name", "ZERO_STAGES"]
