"""The host-synchronisation budget of a training step.

Per MoE layer forward at most ONE device-to-host read (the split sizes the dispatch and the
expert kernels need, read as one small tensor), none in backward, for every registered
router, on one process and on 2 gloo ranks with expert parallelism 2. Routers that need more
are listed in ``EXTRA_READS`` with the reason, and the test asserts their exact number.
A training step through the trainer reads no statistics per micro-batch.
"""
import os

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.host_sync import count_host_syncs
from helpers.moe_cases import make_batch, make_layer, split_sizes
from benchmarks.attention_inputs import synthetic_attention_inputs
from moe_dist.distributed import build_parallel_groups
from moe_dist.moe import ROUTERS, RouterInputs
from moe_dist.moe.routers.token_graph import AttentionRouter
from moe_dist.parallel import apply_expert_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S, E = 4, 6, 8  # 4 sequences of 6 tokens, 8 experts (2 ranks: 2 sequences each)

# options that reach each router's synchronising paths (noise, Sinkhorn on every call, the AC
# clusters, the k schedule, Symphony's bias correction)
ROUTER_OPTIONS = {
    "ssr": {"p": 1.0, "noise_alpha": 1.0},
    "hyper": {"k_max": 4, "k_schedule_steps": 8, "embed_dim": 16, "hyper_dim": 32},
    "smoe_dropout": {"k_max": 4, "k_schedule_steps": 8},
    "ac": {"start_layer": 0},
    "symphony": {"bias_correction": True},
    "attention": {"base": "noisy_topk"},
}
CAPACITY_CASES = {  # topk with capacity: (capacity_scope, drop_policy)
    "topk+capacity global/position": ("global", "position"),
    "topk+capacity global/probs": ("global", "probs"),
    "topk+capacity local/position": ("local", "position"),
    "topk+capacity local/probs": ("local", "probs"),
}

# Reads a layer forward makes besides the dispatch's one, and why. The budget is 1 + these.
LAYOUT = ("training noise is drawn for the concatenated global batch, so the ranks' token counts "
          "(one all-gather, read once) size it and place this rank's rows")
CONVERGENCE = "the Sinkhorn stop test reads the reduced marginal error once every check_every iterations"
PROBS_GATHER = ("the probs drop policy with global capacity gathers every rank's gates: the ranks' pair "
                "counts are read once to size that gather (2 ranks or more)")


def extra_reads(name: str, layer, world: int) -> tuple[int, str]:
    """(reads beyond the dispatch's one, reason) for one forward of ``layer`` in training."""
    n, why = 0, []
    if layer.router.needs_token_layout:
        n, why = n + 1, why + [LAYOUT]
    sinkhorn_iters = layer.stats.extras.get("sinkhorn_iters")
    if sinkhorn_iters is not None and float(layer.stats.extras["sinkhorn_calls"]) > 0:
        iters, every, cap = int(sinkhorn_iters), layer.router.check_every, layer.router.max_iters
        n += (iters - 1) // every + (1 if iters < cap else 0)  # a test at each multiple of check_every below max_iters
        why.append(CONVERGENCE)
    args = layer.args
    if args.capacity_factor is not None and (args.capacity_scope, args.drop_policy) == ("global", "probs") and world > 1:
        n, why = n + 1, why + [PROBS_GATHER]
    return n, "; ".join(why)


def _layer(name: str):
    if name in CAPACITY_CASES:
        scope, policy = CAPACITY_CASES[name]
        return make_layer({"num_experts": E, "router": "topk", "capacity_factor": 1.0, "capacity_scope": scope,
                           "drop_policy": policy, "router_options": {"init_std": 1.0}})
    return make_layer({"num_experts": E, "router": name, "router_options": ROUTER_OPTIONS.get(name, {})})


def _context(layer, x, rank: int, seqs: slice) -> RouterInputs:
    """Everything a router may read: the global step 3 (k schedule half way) in the layer's
    context; sequence structure, padding, the previous layer's top-1, the attention inputs in
    what the layer's forward gets."""
    ctx = layer.context
    ctx.step, ctx.micro_step, ctx.seed = 3, 0, 11
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, -1] = False  # the last token of every sequence is padding
    attention = synthetic_attention_inputs(x.detach(), heads=2, seed=rank) if isinstance(layer.router, AttentionRouter) else None
    return RouterInputs(batch_shape=(x.shape[0], x.shape[1]), padding_mask=mask[seqs],
                        prev_top1=torch.arange(B * S).remainder(E - 1).view(B, S)[seqs].reshape(-1), attention=attention)


def measure(rank: int, world: int) -> dict:
    """Syncs of one forward and one backward of every router's layer (and topk with capacity),
    after one warm-up call (first-call work such as kernel choice is not the steady state)."""
    torch.manual_seed(0)
    groups = build_parallel_groups(world, E) if world > 1 else None
    sizes = split_sizes(B, world, uneven=False)
    seqs = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    out = {}
    for name in sorted(ROUTERS) + sorted(CAPACITY_CASES):
        layer = _layer(name)
        if groups is not None:
            apply_expert_parallel(layer, groups)
        layer.train()
        for call in range(2):
            x, w = (t.view(B, S, -1)[seqs].clone() for t in make_batch(B * S, seed=call + 1))
            x.requires_grad_(True)
            inputs = _context(layer, x, rank, seqs)
            with count_host_syncs() as fwd:
                y = layer(x, inputs)
            loss = (y * w).sum() + layer.aux_loss
            with count_host_syncs() as bwd:
                loss.backward()
        extra, why = extra_reads(name, layer, world)
        out[name] = {"forward": fwd.describe(), "n_forward": len(fwd), "backward": bwd.describe(),
                     "n_backward": len(bwd), "extra": extra, "why": why}
    return out


def _check(results: list, world: int) -> None:
    for rank, res in enumerate(results):
        for name, r in res.items():
            where = f"router {name}, {world} rank(s), rank {rank}"
            assert r["n_backward"] == 0, f"{where}: backward synchronised with the host:\n{r['backward']}"
            allowed = 1 + r["extra"]
            assert r["n_forward"] <= allowed, (f"{where}: {r['n_forward']} host reads in one forward, budget "
                                               f"{allowed} ({r['why'] or 'the dispatch split sizes'}):\n{r['forward']}")
            if r["extra"]:  # routers listed as needing more use exactly what is listed
                assert r["n_forward"] == allowed, f"{where}: expected exactly {allowed} reads ({r['why']}):\n{r['forward']}"


def test_counter_sees_every_kind_of_read():
    """Positive control: each way of reading a device value is counted, a pure device op is not."""
    t = torch.arange(6.0)
    reads = {
        "item": lambda: t[0].item(), "int": lambda: int(t[1]), "float": lambda: float(t[1]),
        "bool": lambda: bool(t[1] > 0), "if": lambda: 1 if t.sum() else 0, "tolist": lambda: t.tolist(),
        "numpy": lambda: t.numpy(), "equal": lambda: torch.equal(t, t), "nonzero": lambda: t.nonzero(),
        "bincount": lambda: torch.bincount(t.long()), "mask": lambda: t[t > 1],
        "repeat_interleave": lambda: torch.repeat_interleave(t, t.long()), "unique": lambda: torch.unique(t),
    }
    for name, fn in reads.items():
        with count_host_syncs() as log:
            fn()
        assert len(log) == 1, f"{name}: {len(log)} events:\n{log.describe()}"
    with count_host_syncs() as log:
        torch.zeros(6).scatter_add_(0, t.long(), t)
        torch.repeat_interleave(t, t.long(), output_size=15)
        torch.isfinite(t).all()
    assert len(log) == 0, log.describe()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the wrapper is gone afterwards


def test_counter_sees_a_sync_inside_a_layer(monkeypatch):
    """Positive control through the real layer: a router that reads a value is caught, with its line."""
    layer = _layer("topk")
    route = type(layer.router).route

    def reading_route(self, x, ctx, inputs):
        routing = route(self, x, ctx, inputs)
        if routing.logits.abs().max() > 1e9:  # a host read
            raise AssertionError
        return routing

    x = torch.randn(B * S, 16)
    with count_host_syncs() as before:
        layer(x)
    monkeypatch.setattr(type(layer.router), "route", reading_route)
    with count_host_syncs() as after:
        layer(x)
    assert len(after) == len(before) + 1, after.describe()
    assert any("test_host_sync.py" in where and "1e9" in where for _, where, _ in after.events), after.describe()


def test_layer_budget_one_process():
    _check([measure(0, 1)], 1)


def test_layer_budget_two_ranks_expert_parallel():
    _check(run_ranks(measure, 2), 2)


# ---- a training step through the trainer ----------------------------------------------------------
def _trainer(tmp, *extra):
    from moe_dist.config import load_config
    from moe_dist.train.loop.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "parallel.ep=1", "run.tensorboard=false", "run.progress=false", "run.plots=false", *extra])
    return Trainer(cfg)


def step_syncs(trainer):
    """Host syncs of one ``train_step`` (after a warm-up step), with the engine's ``step()``
    (gradient norm, optimizer) tagged "update"."""
    trainer.train_step()  # warm-up: first-call work is not the steady state
    engine = trainer.engine
    update = engine.step
    with count_host_syncs() as log:
        def tagged_update(*args, **kwargs):
            log.tag = "update"
            try:
                return update(*args, **kwargs)
            finally:
                log.tag = ""
        engine.step = tagged_update
        try:
            trainer.train_step()
        finally:
            del engine.step
    return log


def _old_style_summary(per_micro: list) -> dict:
    """The step figures the way the statistics were aggregated before (host numbers per micro-batch)."""
    out = {}
    for snap in per_micro:
        for idx, s in snap.items():
            acc = out.setdefault(idx, {"n": 0, "tokens": 0, "counts": None, "pairs": 0, "dropped": 0.0, "aux": 0.0,
                                       "z": 0.0, "entropy": 0.0})
            pairs = sum(s["expert_counts"])
            acc["n"] += 1
            acc["tokens"] += s["tokens"]
            acc["counts"] = s["expert_counts"] if acc["counts"] is None else [a + b for a, b in zip(acc["counts"], s["expert_counts"])]
            acc["pairs"] += pairs
            acc["dropped"] += s["dropped_fraction"] * pairs
            acc["aux"] += s["aux_loss"]
            acc["z"] += s["z_loss"]
            acc["entropy"] += s["entropy"] * s["tokens"]
    return {str(i): {"expert_counts": a["counts"], "dropped_fraction": a["dropped"] / max(a["pairs"], 1),
                     "aux_loss": a["aux"] / a["n"], "z_loss": a["z"] / a["n"], "entropy": a["entropy"] / max(a["tokens"], 1)}
            for i, a in out.items()}


def test_train_step_reads_no_statistics_per_micro_batch(tmp_path):
    """Per micro-batch only the MoE layers' dispatch reads; per step the summed losses (one read in
    train_step) and the gradient norm (in the engine's step). torch's AdamW (foreach, not capturable) keeps its
    step counters on the host, so its .item() calls in optimizer.step() read host memory, not the
    device, and are left out. The step's statistics are read by MoEStepStats.summary, once, and
    equal what per-micro-batch host aggregation gave."""
    trainer = _trainer(tmp_path, "train.grad_accum=2", "model.moe.capacity_factor=1.0")
    per_micro = []
    add = trainer.moe_stats.add

    def recording_add():  # the reference figures, taken outside the counted phases
        add()
        per_micro.append({m.context.layer_idx: m.stats.as_dict() for m in trainer.moe})

    try:
        log = step_syncs(trainer)
        trainer.moe_stats.add = recording_add
        trainer.train_step()
        with count_host_syncs() as summary_log:
            summary = trainer.moe_stats.summary(trainer.rt.groups.dp, trainer.rt.device)
    finally:
        trainer.close()
    micro, layers = trainer.cfg.train.grad_accum, len(trainer.moe)
    assert micro == 2 and layers == 2
    in_step = [e for e in log.events if not e[2]]
    # the dispatch's one read per layer call (read_counts in the row helpers, moe/rows.py)
    dispatch_reads = [e for e in in_step if "moe/rows.py" in e[1] and "flat.tolist()" in e[1]]
    assert len(dispatch_reads) == micro * layers, log.describe()
    others = [e for e in in_step if e not in dispatch_reads]
    assert len(others) == 1 and "train/loop/step.py" in others[0][1] and "sums.tolist()" in others[0][1], log.describe(others)
    update = [e for e in log.tagged("update") if "optimizer.step()" not in e[1]]
    assert len(update) == 1 and "grad_norm" in update[0][1], log.describe(update)
    assert len(summary_log) == 1, summary_log.describe()
    reference = _old_style_summary(per_micro)
    for idx, ref in reference.items():
        got = summary[idx]
        assert got["expert_counts"] == ref["expert_counts"], idx
        for key in ("dropped_fraction", "aux_loss", "z_loss", "entropy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-12), (idx, key)
        assert got["capacity"] == per_micro[-1][int(idx)]["capacity"]
    assert any(r["dropped_fraction"] > 0 for r in reference.values())  # the capacity case is exercised


def _nonfinite_on_one_rank(rank, world):
    groups = build_parallel_groups(world, E)
    layer = apply_expert_parallel(_layer("topk"), groups)
    layer.context.layer_idx = 3
    x = torch.randn(5, 16)
    if rank == 0:
        x[2, 1] = float("nan")
    try:
        layer(x)
    except FloatingPointError as e:
        return str(e)
    return "no error"


def test_nonfinite_logits_raise_on_every_rank_without_a_read_of_their_own():
    """The non-finite count rides on the gathered statistics and the dispatch's read: a NaN on one
    rank raises the same error, naming the layer, on every rank (no rank left in a collective)."""
    messages = run_ranks(_nonfinite_on_one_rank, 2)
    for m in messages:
        assert m.startswith("layer 3 router: router logits contain 8 NaN/Inf values (of 80)"), m
