"""``moe-dist plan --dry-run``: the real training step of one rank of a large world, in one process.

One process plays rank ``r`` of a world of ``nodes x gpus_per_node`` ranks on torch's fake process
group (collectives return at once with the right shapes) and fake tensors (shapes, dtypes and
autograd without storage or compute), and runs the project's own code path: the config checks,
the meta build, expert parallelism, the FSDP2 units, the optimizer, ``steps`` full training steps
(:class:`~moe_dist.train.loop.step.TrainStep`: forward, backward, clipping, optimizer step, expert-bias
update) under torch's FSDP2 memory tracker, then the checkpoint's save plan (the shards this rank
would write) without writing.

Values never exist, so the reads that decide a shape come from a stated routing model
(:mod:`moe_dist.moe.routing.stand_in`: ``balanced``, ``skew:F``, a run's histogram) and every other
host read (losses, the gradient norm, AdamW's step count) reads a finite stand-in value
(:class:`_StandInReads`): the step takes the path of a healthy step. By default the rank is the
one with the most work under the routing model: the busiest expert's rank, since the largest rank
is the one that runs out of memory.

Memory is reported per category of the tracker at the moment of the peak: ``weights`` (this rank's
shards, and its whole experts when they are not sharded), ``gathered_weights`` (FSDP2's unsharded
parameters), ``grads``, ``optimizer``, ``activations``, ``temporaries``, ``all_gather`` /
``reduce_scatter`` (FSDP2's communication buffers) and ``inputs``. Real GPUs add the CUDA context,
the allocator's rounding and caching, and communication library buffers, none of which exist here.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ConfigError, load_config
from ..moe import moe_layers
from ..moe.layer import set_stand_in
from ..moe.routing.stand_in import RoutingModel, Skewed, parse_routing_model
from ..parallel import expert_parameters

# tracker category -> the name the dry run reports it under
CATEGORIES = {"Sharded Param": "weights", "Unsharded Param": "gathered_weights", "Buffer": "buffers",
              "Sharded Grad": "grads", "Unsharded Grad": "grads", "Activation": "activations", "Temp": "temporaries",
              "All Gather": "all_gather", "Reduce Scatter": "reduce_scatter", "OptState": "optimizer",
              "Inputs": "inputs", "Parameter": "weights", "Gradient": "grads", "Optstate": "optimizer",
              "Other": "inputs"}
STAND_IN_FLOAT = 0.0  # what a floating-point host read returns: a finite loss and gradient norm, no NaN flag


def _group_ranks(pg) -> tuple:
    """The global ranks of a process group as an op argument carries it (a boxed ``ProcessGroup``)."""
    try:
        group = dist.ProcessGroup.unbox(pg) if not isinstance(pg, dist.ProcessGroup) else pg
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return ()


def _collective_entry(func, args) -> dict:
    """What a peer must agree on for one collective: the op, the group, sizes and split sizes."""
    name = func.name().split("::")[-1].split(".")[0]
    tensors = [a for a in args if torch.is_tensor(a)]
    lists = [a for a in args if isinstance(a, list) and all(isinstance(v, int) for v in a)]
    group = next((_group_ranks(a) for a in args if type(a).__name__ in ("ScriptObject", "ProcessGroup")), ())
    entry = {"op": name, "group": group, "numel": [int(t.numel()) for t in tensors],
             "row": [int(t[0].numel()) if t.dim() > 0 and t.shape[0] else 0 for t in tensors]}
    if name.startswith("alltoall_base") and len(lists) >= 2:
        entry["out_splits"], entry["in_splits"] = lists[0], lists[1]
    return entry


class _StandInReads(TorchDispatchMode):
    """Host reads of fake tensors (``item``, ``float(t)``, ``tolist``): the value of a fake tensor that
    still knows it (a constant such as AdamW's step count), else 0: a finite loss and gradient norm
    and no non-finite flag, so the step is applied. The reads that size tensors never come here (the
    routing model answers them). Each collective this rank starts is logged (``collectives``): what
    its peers must agree on (:mod:`moe_dist.plan.collective_check`)."""

    def __init__(self):
        super().__init__()
        self.collectives: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.collectives.append(_collective_entry(func, args))
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if getattr(t, "constant", None) is not None:
                return t.constant.item()
            return STAND_IN_FLOAT if t.dtype.is_floating_point else (False if t.dtype == torch.bool else 0)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_world(world: int, rank: int):
    """The default process group as rank ``rank`` of a fake world of ``world`` ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run makes its own (fake) process group; this process already has one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fake_tensors(reads: "_StandInReads"):
    """Fake tensors, with ``reads`` answering their host reads, and DTensor's sharding propagation
    in a fake mode of its own (:func:`_own_propagation_mode`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode, reads, _own_propagation_mode():
        yield mode


@contextlib.contextmanager
def _own_propagation_mode():
    """DTensor works out each op's output shapes by running it on global-shape fake tensors in the
    active fake mode, or a fresh one when there is none (a real run). In a dry run the active mode is
    the dry run's, so those whole-size tensors, never allocated on a GPU, would count as this rank's
    memory (an AdamW step over sharded experts: about 3x their size); torch's tracker leaves out what
    runs in another fake mode, so propagation gets one, as in a real run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import _sharding_prop

    propagation = FakeTensorMode(allow_non_fake_inputs=True)
    detect = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: propagation
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect


@contextlib.contextmanager
def _placing_parameters(mode):
    """While the model is built and its parameters placed (``to_empty``): torch's converter memo holds
    weak references, which forbid the tensor swap ``nn.Module._apply`` does on fake parameters, so
    the memo keeps strong ones; afterwards torch's weak memo again, else no tensor converted during
    the steps is ever freed (every free missed). ``mode`` None: real tensors, nothing to do."""
    if mode is None:
        yield
        return
    converter = mode.fake_tensor_converter.meta_converter
    weak, converter.tensor_memo = converter.tensor_memo, {}
    try:
        yield
    finally:
        converter.tensor_memo = weak


def _no_fill(model) -> None:
    """Fake weights need no values: nothing is computed."""


def _hosts(world: int, gpus_per_node: int) -> list[str]:
    return [f"node{r // gpus_per_node}" for r in range(world)]


def busiest_rank(cfg, routing: RoutingModel, world: int, gpus_per_node: int) -> int:
    """The rank that holds the busiest expert under ``routing`` (of the first MoE layer), in the first
    expert-parallel group: the rank that receives the most rows (and, with a capacity of the global
    scope and the ``position`` policy, the first to keep them)."""
    moe = cfg.model.moe
    blocks = moe.layer_indices(cfg.model.n_layers)
    if not blocks:
        return 0
    ep = cfg.expert_parallel_size(_hosts(world, gpus_per_node))
    return routing.busiest_expert(blocks[0], moe.num_experts) // (moe.num_experts // ep)


def _load(config: str, overrides: Iterable[str], world: int, gpus_per_node: int, micro_batch: Optional[int]):
    """The config as the trainer of that world would run it, on fake CPU tensors: the world's nodes
    declared (the dtype stays the config's: :func:`_runtime`)."""
    from .plan_input import hf_config, hf_seq_len, read_source

    extra = ["run.device=cpu", f"parallel.ranks_per_node={gpus_per_node}"]
    path, raw, hf = read_source(config)
    if hf:  # a Hugging Face config: its model, trained as the planner assumes
        sections = {"train": {"dtype": "bf16", "seq_len": hf_seq_len(raw), "global_batch": world, "grad_accum": 1},
                    "eval": {"batch": world}}
        cfg = hf_config(raw, path, list(overrides) + extra, sections)[1]
    else:
        cfg = load_config(path, list(overrides) + extra)
    if micro_batch is not None:
        cfg.train.global_batch = micro_batch * world * cfg.train.grad_accum
    if cfg.train.engine != "native":
        raise ConfigError(f"train.engine={cfg.train.engine!r}: the dry run runs the native engine (FSDP2); allowed: native")
    if not cfg.model.vocab_size:  # the tokenizer's size, as the planner reads it (data.tokenizer or data.vocab_size)
        from .plan_input import _vocab_of

        cfg.model.vocab_size = _vocab_of(cfg)
    return cfg


def check_skew(routing: RoutingModel, cfg) -> None:
    """Refuse a ``skew:F`` no router can produce: a token picks an expert at most once, so one expert
    receives at most every token, ``num_experts / top_k`` times the mean."""
    moe = cfg.model.moe
    if not isinstance(routing, Skewed) or not moe.layer_indices(cfg.model.n_layers):
        return
    most = moe.num_experts / moe.top_k
    if routing.factor > most:
        raise ConfigError(f"--routing: skew:{routing.factor:g}; allowed: skew:F with 1 <= F <= {most:g} "
                          f"({moe.num_experts} experts, top-{moe.top_k}: a token picks an expert at most once, so no "
                          f"expert receives more than experts / top_k = {most:g}x the mean)")


def _runtime(cfg):
    """The trainer's runtime for ``cfg`` (the world-size rules, the groups, the meshes) without the
    bf16 speed probe of the trainer's runtime: that times this CPU's matmuls to choose a CPU job's
    dtype, and a dry run plays a rank of a GPU job, whose dtype is the config's."""
    from ..train.setup.runtime import setup_runtime

    return setup_runtime(cfg, choose_dtype=False)


def _track_plain_parameters(tracker, model) -> None:
    """Parameters outside FSDP2 (whole experts when each expert has one copy, everything on one
    process) and their gradients, which the FSDP2 tracker does not see by itself."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    plain = [p for p in model.parameters() if type(p).__name__ != "DTensor" and not hasattr(p, "_local_tensor")]
    for p in plain:
        tracker._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)

        def as_grad(param):
            tracker._update_and_maybe_create_winfos(param.grad, _FSDPRefType.SHARDED_GRAD)

        p.register_post_accumulate_grad_hook(as_grad)


def _record_routing(model) -> list:
    """Each MoE layer forward's routed pairs per expert on this rank, in call order (a real run)."""
    calls = []

    def record(layer, args, output):
        calls.append(torch.bincount(layer.last_routing.expert_ids.reshape(-1).cpu(), minlength=layer.num_experts))

    for layer in moe_layers(model):
        layer.register_forward_hook(record)
    return calls


def _tracker(model, optimizer, batch):
    """torch's FSDP2 memory tracker (per FSDP2 category) when the model is sharded, else its plain
    memory tracker (one process: parameters, gradients, optimizer state, activations, temporaries)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
        _track_plain_parameters(tracker, model)
        tracker.track_inputs((batch,))
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer, batch)
    _global_peak_only(tracker)
    return tracker


def _allocate_optimizer_state(model, optimizer) -> None:
    """AdamW makes its moments in its first step; one step on zero gradients, before anything is
    tracked, makes them, so that the first tracked step is already a steady one (the optimizer
    state there from the start, the gradients freed by the step before)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def _global_peak_only(tracker) -> None:
    """torch's tracker, on every op, walks every module to keep per-module peaks as well; the dry
    run reads only the overall peak, which alone is kept (the walk was a third of a dry run's time)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def update_peak(peak_state) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = dict(snap)

    tracker._update_peak_stats = update_peak


def _per_micro_batch(engine, model, tracker) -> None:
    """The tracker keeps per-module figures of one forward and refuses a second one: each
    micro-batch's forward starts with those cleared (the peak over the whole run is kept). After
    each backward, the unsharded gradients FSDP2 keeps between micro-batches (no reduction until
    the last one) are filed as gradients: the tracker saw them made in backward and calls them
    temporaries."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed.fsdp import FSDPModule

    forward, backward = engine.forward, engine.backward
    fsdp_params = [fp for m in model.modules() if isinstance(m, FSDPModule)
                   for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None
                   for fp in group.fsdp_params]

    def tracked_forward(tokens):
        tracker.reset_mod_stats()
        return forward(tokens)

    def tracked_backward(loss):
        backward(loss)
        for fp in fsdp_params:
            for grad in (fp.unsharded_accumulated_grad, getattr(fp._unsharded_param, "grad", None)
                         if hasattr(fp, "_unsharded_param") else None):
                if grad is not None:
                    tracker._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)

    engine.forward, engine.backward = tracked_forward, tracked_backward


def _snapshot(tracker, which: str = "peak") -> dict[str, int]:
    out: dict[str, int] = {}
    for dev_snap in tracker.get_tracker_snapshot(which).values():
        for key, value in dev_snap.items():
            name = "total" if key == "Total" else CATEGORIES.get(getattr(key, "value", str(key)), str(key))
            out[name] = out.get(name, 0) + int(value)
    return out


def save_plan(model, optimizer, rank: int) -> dict:
    """The checkpoint shards this rank would write (DCP's local save plan), without writing."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ..train.checkpoint.collective import around_dcp
    from ..train.checkpoint.state import expert_keyed_state_dict, optimizer_state_dict

    state = expert_keyed_state_dict(model)
    state.update(optimizer_state_dict(model, optimizer))
    planner = DefaultSavePlanner()
    with around_dcp():
        planner.set_up_planner(state, is_coordinator=rank == 0)
        plan = planner.create_local_plan()
    tensor_bytes = other = 0
    for item in plan.items:
        data = item.tensor_data
        if data is None or isinstance(data, BytesStorageMetadata):
            other += 1
            continue
        tensor_bytes += math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return {"items": len(plan.items), "tensor_bytes": tensor_bytes, "byte_items": other}


def dry_run(config: str, overrides: Iterable[str] = (), *, nodes: int = 1, gpus_per_node: int = 8,
            rank: Optional[int] = None, routing="balanced", steps: int = 1,
            micro_batch: Optional[int] = None, observe=None, fake: bool = True,
            log_collectives: bool = False, all_micro_batches: bool = False) -> dict:
    """One rank's training memory at ``nodes x gpus_per_node`` ranks (module docstring); a dict
    (JSON): ``peak_bytes``, ``categories_bytes``, ``layout``, ``save_plan``, ``seconds``.
    ``observe(model, rt)``: called after the steps (a test's look at what the rank built).
    A step runs at most two of its ``train.grad_accum`` micro-batches (``all_micro_batches``: every
    one): the first (gradients kept unreduced) and the last (reduced); the ones between repeat the
    first with the gradients already allocated, so the peak is the same (tested) at a fraction of
    the time.
    ``log_collectives``: the result's ``collectives`` lists every collective of the steps (op, group,
    sizes, split sizes) for :mod:`moe_dist.plan.collective_check`.
    ``routing``: a :class:`RoutingModel` or its text (:func:`parse_routing_model`).
    ``fake=False``: the same measurement on real tensors in the process group that exists (the
    dry run's own validation: every rank of a real gloo world calls it; the routing is real, and
    ``routed_calls`` lists this rank's pairs per expert of each layer forward, in call order, for
    a :class:`~moe_dist.moe.routing.stand_in.RecordedRouting`)."""
    from ..train.engines import create_engine
    from ..train.observe.moe_stats import MoEStepStats
    from ..train.setup.model import build_meta_model, weights_filler
    from ..train.loop.step import TrainStep

    for key, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}: {value!r}; allowed: an integer >= 1")
    world = nodes * gpus_per_node
    model_of_routing = routing if isinstance(routing, RoutingModel) else parse_routing_model(routing)
    cfg = _load(config, overrides, world, gpus_per_node, micro_batch)
    check_skew(model_of_routing, cfg)
    if not fake:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if rank is None:
        rank = busiest_rank(cfg, model_of_routing, world, gpus_per_node)
    if not 0 <= rank < world:
        raise ConfigError(f"--rank: {rank}; allowed: 0..{world - 1} (a world of {nodes} x {gpus_per_node} ranks)")
    start = time.perf_counter()
    vocab = cfg.model.vocab_size
    with (_fake_world(world, rank) if fake else contextlib.nullcontext()):
        rt = _runtime(cfg)
        groups = rt.groups
        per_rank = cfg.train.global_batch // cfg.train.grad_accum // groups.dp_size
        micro = cfg.train.grad_accum if all_micro_batches else min(cfg.train.grad_accum, 2)
        reads = _StandInReads()
        with (_fake_tensors(reads) if fake else contextlib.nullcontext()) as mode:
            with _placing_parameters(mode):
                model = build_meta_model(cfg, vocab)
                set_stand_in(model, model_of_routing if fake else None)
                model.set_activation_checkpointing(cfg.train.activation_checkpointing)
                engine = create_engine(cfg, rt, log=lambda _: None)
                engine.prepare(model, fill=_no_fill if fake else weights_filler(cfg, None))
            step = TrainStep(cfg.train, rt, engine, model, MoEStepStats(model))
            batch = torch.randint(0, vocab, (per_rank, cfg.train.seq_len + 1))
            routed_calls = [] if fake else _record_routing(model)
            _allocate_optimizer_state(model, engine.optimizer)
            tracker = _tracker(model, engine.optimizer, batch)
            _per_micro_batch(engine, model, tracker)
            with tracker:
                for s in range(steps):
                    step(s, [batch] * micro)
            categories = _snapshot(tracker)
            saved = save_plan(model, engine.optimizer, rank)
            local_experts = sum(p.numel() for p in expert_parameters(model))
            if observe is not None:
                observe(model, rt)
        layers = moe_layers(model)
        layout = {"world_size": world, "nodes": nodes, "gpus_per_node": gpus_per_node, "rank": rank,
                  "ep": groups.ep_size, "edp": groups.edp_size, "dp": groups.dp_size,
                  "experts_per_rank": layers[0].experts.num_experts if layers else 0,
                  "expert_params_local": local_experts, "micro_batch": per_rank, "grad_accum": cfg.train.grad_accum,
                  "micro_batches_run": micro,
                  "seq_len": cfg.train.seq_len, "dtype": cfg.train.dtype, "dense": engine.dense_layout(),
                  "activation_checkpointing": cfg.train.activation_checkpointing}
    total = categories.pop("total", sum(categories.values()))
    return {"config": config, "overrides": list(overrides), "routing": model_of_routing.describe(), "steps": steps,
            "layout": layout, "peak_bytes": total, "categories_bytes": categories, "save_plan": saved,
            "seconds": round(time.perf_counter() - start, 2),
            **({} if fake else {"routed_calls": [c.tolist() for c in routed_calls]}),
            **({"collectives": reads.collectives} if log_collectives else {})}
