"""moe_dist routers inside Megatron-Core's MoE layer (real megatron-core on gloo, CPU).

  - Megatron's MoELayer with our router vs moe_dist's MoELayer with the same weights: outputs,
    input and weight gradients, the router state after the per-step hook and a second forward
    agree to 1e-5, for topk, sinkhorn, ac, symphony and similarity with the allgather and the
    alltoall dispatchers (two layers in a row: AC clusters layer 2's tokens by layer 1's top-1),
    and for ac and sinkhorn with a padding mask (Megatron's True = padding), and topk with
    Megatron's group-limited routing options (moe_router_num_groups / moe_router_group_topk);
  - inside Megatron at 1 vs 2 ranks (ep=2, the batch split over the ranks): the same results,
    while Megatron's own sinkhorn router (local tokens only) differs: the control;
  - Megatron dist-checkpointing save/load keeps the routers' state (also loaded at ep=1);
  - the group-limited choice against Megatron-Core's own ``group_limited_topk``.

Megatron-Core needs a few CUDA calls stubbed on a CPU: tests/helpers/megatron_shim.py (test-only).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed: install the megatron extra "
                              "(EXTRAS=dev,megatron bash scripts/setup.sh)"),
]

TOL = 1e-5
DISPATCHERS = ("allgather", "alltoall")
INVARIANT = ("topk", "sinkhorn", "ac", "symphony")


# ---- what the ranks run -----------------------------------------------------------------
def _one_rank(rank, world):
    from helpers import megatron_cases as mc

    mc.init_megatron(ep=1)
    out = {"vs_moe_dist": {}, "megatron": {}}
    x, w = mc.data()
    for router, options in mc.ROUTERS.items():
        for disp in DISPATCHERS:
            ref = mc.reference_layers(router, options)
            meg = mc.megatron_layers(disp, router, options)
            mc.copy_weights(ref, meg)
            got = mc.run_megatron(meg, x, w, dp_size=1)
            out["vs_moe_dist"][f"{router}/{disp}"] = _max_diffs(got, mc.run_reference(ref, x, w))
            out["megatron"][f"{router}/{disp}"] = got
    for router in ("ac", "sinkhorn"):  # routers whose statistics skip padding tokens
        ref = mc.reference_layers(router, mc.ROUTERS[router])
        meg = mc.megatron_layers("alltoall", router, mc.ROUTERS[router])
        mc.copy_weights(ref, meg)
        got = mc.run_megatron(meg, x, w, dp_size=1, pad=mc.padding())
        out["vs_moe_dist"][f"{router}/alltoall/padding"] = _max_diffs(got, mc.run_reference(ref, x, w, mc.padding()))
    for disp in DISPATCHERS:  # global capacity, lowest gates dropped first
        ref = mc.reference_layers("topk", {}, capacity=mc.CAPACITY)
        meg = mc.megatron_layers(disp, "topk", {}, capacity=mc.CAPACITY)
        mc.copy_weights(ref, meg)
        got = mc.run_megatron(meg, x, w, dp_size=1)
        out["vs_moe_dist"][f"topk/{disp}/capacity"] = _max_diffs(got, mc.run_reference(ref, x, w))
        out["megatron"][f"topk/{disp}/capacity"] = got
    for disp in DISPATCHERS:  # group-limited routing from Megatron's moe_router_num_groups / group_topk
        ref = mc.reference_layers("topk", {}, groups=mc.GROUPS)
        meg = mc.megatron_layers(disp, "topk", {}, groups=mc.GROUPS)
        mc.copy_weights(ref, meg)
        got = mc.run_megatron(meg, x, w, dp_size=1)
        out["vs_moe_dist"][f"topk/{disp}/groups"] = _max_diffs(got, mc.run_reference(ref, x, w))
        out["megatron"][f"topk/{disp}/groups"] = got
    out["control"] = _control(mc, x, w, dp_size=1)
    mc.finish_megatron()
    return out


def _two_ranks(rank, world):
    from helpers import megatron_cases as mc

    mc.init_megatron(ep=2)
    x, w = mc.data()
    xs, ws = mc.rank_slice(x, rank, world), mc.rank_slice(w, rank, world)
    out = {"megatron": {}}
    for router in INVARIANT:
        for disp in DISPATCHERS:
            ref = mc.reference_layers(router, mc.ROUTERS[router])  # the same weights on every rank
            meg = mc.megatron_layers(disp, router, mc.ROUTERS[router])
            mc.copy_weights(ref, meg)
            out["megatron"][f"{router}/{disp}"] = mc.run_megatron(meg, xs, ws, dp_size=world)
    for disp in DISPATCHERS:
        ref = mc.reference_layers("topk", {}, capacity=mc.CAPACITY)
        meg = mc.megatron_layers(disp, "topk", {}, capacity=mc.CAPACITY)
        mc.copy_weights(ref, meg)
        out["megatron"][f"topk/{disp}/capacity"] = mc.run_megatron(meg, xs, ws, dp_size=world)
        ref = mc.reference_layers("topk", {}, groups=mc.GROUPS)
        meg = mc.megatron_layers(disp, "topk", {}, groups=mc.GROUPS)
        mc.copy_weights(ref, meg)
        out["megatron"][f"topk/{disp}/groups"] = mc.run_megatron(meg, xs, ws, dp_size=world)
    out["control"] = _control(mc, xs, ws, dp_size=world)
    mc.finish_megatron()
    return out


def _control(mc, x, w, dp_size):
    """Megatron-Core's own sinkhorn router (moe_router_load_balancing_type=sinkhorn)."""
    ref = mc.reference_layers("topk", {})
    meg = mc.megatron_layers("alltoall", None, load_balancing="sinkhorn", aux=0.0, z=None)
    mc.copy_weights(ref, meg, megatron_router=True)
    x = x.clone().requires_grad_()
    y1, _ = meg[0](x)
    y2, _ = meg[1](x + y1)
    return {"y1": y1.detach(), "y2": y2.detach()}


def _max_diffs(a: dict, b: dict) -> dict:
    def diff(p, q):
        return float((p.float() - q.float()).abs().max()) if p.numel() else 0.0

    out = {k: diff(a[k], b[k]) for k in ("y1", "y2", "x_grad", "z2")}
    out["router_grads"] = max(diff(p, q) for p, q in zip(a["router_grads"], b["router_grads"]))
    out["expert_grads"] = max(diff(a["expert_grads"][l][e], b["expert_grads"][l][e])
                              for l in range(2) for e in a["expert_grads"][l])
    out["router_state"] = max(diff(a["router_state"][l][n], b["router_state"][l][n])
                              for l in range(2) for n in b["router_state"][l])
    out["scale"] = float(b["y2"].abs().max())
    return out


# ---- fixtures: one spawn per world size ---------------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    from helpers.dist_harness import run_ranks

    return run_ranks(_one_rank, 1, timeout=600)[0]


@pytest.fixture(scope="module")
def two_ranks():
    from helpers.dist_harness import run_ranks

    return run_ranks(_two_ranks, 2, timeout=600)


# ---- tests ----------------------------------------------------------------------------------
def test_megatron_layer_with_our_router_matches_moe_dist_layer(one_rank):
    res = one_rank["vs_moe_dist"]
    assert len(res) == 16
    for case, diffs in res.items():
        assert diffs["scale"] > 0.1, (case, diffs)  # outputs of order one: the tolerance is meaningful
        for key, value in diffs.items():
            if key != "scale":
                assert value <= TOL, f"{case}: {key} differs by {value:.3g}"


def _cat_ranks(per_rank: list, key: str) -> torch.Tensor:
    return torch.cat([r[key] for r in per_rank], dim=1)  # [S, B, H]: ranks hold slices of B


def test_one_vs_two_ranks_inside_megatron(one_rank, two_ranks):
    cases = [f"{router}/{disp}" for router in INVARIANT for disp in DISPATCHERS]
    cases += [f"topk/{disp}/{kind}" for disp in DISPATCHERS for kind in ("capacity", "groups")]
    for case in cases:
        one = one_rank["megatron"][case]
        two = [r["megatron"][case] for r in two_ranks]
        for key in ("y1", "y2", "x_grad", "z2"):
            err = float((_cat_ranks(two, key) - one[key]).abs().max())
            assert err <= TOL, f"{case}: {key} differs by {err:.3g} between 1 and 2 ranks"
        for l in range(2):
            for r in two:  # averaged over the ranks: the same on both
                err = float((r["router_grads"][l] - one["router_grads"][l]).abs().max())
                assert err <= TOL, f"{case}: router {l} gradient differs by {err:.3g}"
                for name, value in one["router_state"][l].items():
                    err = float((r["router_state"][l][name].double() - value.double()).abs().max())
                    assert err <= TOL, f"{case}: router {l} state {name} differs by {err:.3g}"
            held = {e: g for r in two for e, g in r["expert_grads"][l].items()}
            assert sorted(held) == sorted(one["expert_grads"][l])  # ep=2: each rank holds half the experts
            for e, g in held.items():
                err = float((g - one["expert_grads"][l][e]).abs().max())
                assert err <= TOL, f"{case}: expert {e} of layer {l} gradient differs by {err:.3g}"
    for disp in DISPATCHERS:  # the capacity cases drop pairs, the same ones at 1 and 2 ranks
        dropped = one_rank["megatron"][f"topk/{disp}/capacity"]["dropped"]
        assert (dropped > 0).all()
        for r in two_ranks:
            assert torch.equal(r["megatron"][f"topk/{disp}/capacity"]["dropped"], dropped)
    # the control: Megatron-Core's sinkhorn balances each rank's tokens only
    err = float((_cat_ranks([r["control"] for r in two_ranks], "y2") - one_rank["control"]["y2"]).abs().max())
    assert err > 1e-3, f"Megatron's own sinkhorn router gave the same output on 1 and 2 ranks ({err:.3g})"


# ---- distributed checkpointing ------------------------------------------------------------
def _checkpoint_save_and_load(rank, world, ckpt_dir):
    """Train a step, save; then fresh layers in the same processes load it back."""
    from helpers import megatron_cases as mc
    from megatron.core import dist_checkpointing

    mc.init_megatron(ep=world)
    x, w = mc.data()
    xs, ws = mc.rank_slice(x, rank, world), mc.rank_slice(w, rank, world)
    models = _checkpoint_models(mc)
    for name, layers in models.items():
        ref = mc.reference_layers(*_CKPT_ROUTERS[name])
        mc.copy_weights(ref, layers)
        mc.run_megatron(layers, xs, ws, dp_size=world)  # training forward, backward, per-step hook
    dist_checkpointing.save(_sharded(models), ckpt_dir)
    saved = {name: _router_states(layers) for name, layers in models.items()}
    saved["y"] = _eval_output(models, xs)
    loaded = _load(mc, rank, world, ckpt_dir)
    mc.finish_megatron()
    return {"saved": saved, "loaded": loaded}


def _checkpoint_load(rank, world, ckpt_dir):
    from helpers import megatron_cases as mc

    mc.init_megatron(ep=world)
    out = _load(mc, rank, world, ckpt_dir)
    mc.finish_megatron()
    return out


def _load(mc, rank, world, ckpt_dir) -> dict:
    from megatron.core import dist_checkpointing

    torch.manual_seed(123)  # fresh layers, other weights
    models = _checkpoint_models(mc)
    before = {name: _router_states(layers) for name, layers in models.items()}
    state = dist_checkpointing.load(_sharded(models), ckpt_dir)
    for name, layers in models.items():
        for i, layer in enumerate(layers):
            prefix = f"{name}.{i}."
            layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    out = {name: _router_states(layers) for name, layers in models.items()}
    out["before"] = before
    out["y"] = _eval_output(models, mc.rank_slice(mc.data()[0], rank, world))
    return out


_CKPT_ROUTERS = {"symphony": ("symphony", {}), "ac": ("ac", {"start_layer": 1, "eval_mode": "running"})}


def _checkpoint_models(mc):
    return {name: mc.megatron_layers("alltoall", router, options) for name, (router, options) in _CKPT_ROUTERS.items()}


def _sharded(models) -> dict:
    out = {}
    for name, layers in models.items():
        for i, layer in enumerate(layers):
            out.update(layer.sharded_state_dict(prefix=f"{name}.{i}."))
    return out


def _router_states(layers) -> list:
    return [{k: v.detach().clone() for k, v in layer.router.router.state_dict().items()} for layer in layers]


@torch.no_grad()
def _eval_output(models, x) -> dict:
    out = {}
    for name, layers in models.items():
        layers.eval()
        y1, _ = layers[0](x)
        y2, _ = layers[1](x + y1)
        out[name] = y2
    return out


def test_dist_checkpointing_keeps_router_state(tmp_path):
    from helpers.dist_harness import run_ranks

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    both = run_ranks(_checkpoint_save_and_load, 2, args=(ckpt,), timeout=600)
    saved = [r["saved"] for r in both]
    assert any(name.endswith(".distcp") or name == "metadata.json" for name in os.listdir(ckpt))
    at_one_rank = run_ranks(_checkpoint_load, 1, args=(ckpt,), timeout=600)  # EP 2 -> 1
    for world, loaded in ((2, [r["loaded"] for r in both]), (1, at_one_rank)):
        for name in _CKPT_ROUTERS:
            for l in range(2):
                want = saved[0][name][l]
                assert want, f"{name} layer {l}: the router has no state to save"
                for got in loaded:
                    for key, value in want.items():
                        assert torch.equal(got[name][l][key], value), f"{name} layer {l} {key} (loaded at {world} ranks)"
            # the training step changed the state (so equality above is not trivial)
            changed = [not torch.equal(loaded[0]["before"][name][l][k], v)
                       for l in range(2) for k, v in saved[0][name][l].items()]
            assert any(changed), name
            y_saved = torch.cat([r["y"][name] for r in saved], dim=1)
            y_loaded = torch.cat([r["y"][name] for r in loaded], dim=1)
            assert float((y_saved - y_loaded).abs().max()) <= TOL, f"{name}: eval output after loading at {world} ranks"


def _planted_checkpoints(rank, world, tmp):
    """Save, then: a clean load; the router's state (Symphony's graph, a tensor) declared as a pickled
    bytes entry; a module's extra state (an object entry) replaced by a pickle that runs code. Each
    loaded with the checked loader, and the last with Megatron-Core's own loader as the control."""
    import shutil

    from helpers import megatron_cases as mc
    from helpers.checkpoint_payloads import plant_bytes_entry, read_metadata
    from megatron.core import dist_checkpointing

    from moe_dist.integrations.megatron import load_checkpoint

    def attempt(loader, ckpt):
        try:
            loader(_sharded(_checkpoint_models(mc)), ckpt)
            return None
        except BaseException as e:  # noqa: BLE001 - reported to the test
            return type(e).__name__, str(e)

    mc.init_megatron(ep=world)
    x, w = mc.data()
    models = _checkpoint_models(mc)
    for name, layers in models.items():
        mc.copy_weights(mc.reference_layers(*_CKPT_ROUTERS[name]), layers)
        mc.run_megatron(layers, x, w, dp_size=world)
    clean = os.path.join(tmp, "clean")
    os.makedirs(clean)
    dist_checkpointing.save(_sharded(models), clean)
    out = {"clean": attempt(load_checkpoint, clean)}
    keys = sorted(read_metadata(clean).state_dict_metadata)
    targets = {"router state": next(k for k in keys if k.startswith("symphony.") and ".router." in k),
               "extra state": next(k for k in keys if k.endswith("_extra_state/shard_0_4") or "_extra_state" in k)}
    for kind, key in targets.items():
        ckpt, marker = os.path.join(tmp, kind.replace(" ", "-")), os.path.join(tmp, f"ran-{kind.replace(' ', '-')}")
        shutil.copytree(clean, ckpt)
        plant_bytes_entry(ckpt, key, marker)
        out[kind] = {"key": key, "checked": attempt(load_checkpoint, ckpt), "ran": os.path.exists(marker)}
        out[kind]["control"] = attempt(dist_checkpointing.load, ckpt)
        out[kind]["control ran"] = os.path.exists(marker)
    mc.finish_megatron()
    return out


def test_checkpoint_entries_planted_with_code_are_refused(tmp_path):
    """:func:`load_checkpoint` loads a clean checkpoint and refuses, unread, the plug-in's router state
    declared as a pickled object and a module's extra state that would run code. The control:
    Megatron-Core's own ``dist_checkpointing.load`` runs the second."""
    from helpers.dist_harness import run_ranks

    [out] = run_ranks(_planted_checkpoints, 1, args=(str(tmp_path),), timeout=600)
    assert out["clean"] is None, out["clean"]
    for kind in ("router state", "extra state"):
        got = out[kind]
        assert got["checked"] and got["checked"][0] == "UnsafeCheckpoint", got
        assert got["key"] in got["checked"][1] and "\n" not in got["checked"][1], got
        assert not got["ran"], f"{kind}: the checked loader ran the payload"
    assert out["extra state"]["control ran"], "the control: Megatron-Core's loader did not run the planted object"


# ---- configuration errors (no process group needed) ---------------------------------------
def _config(**overrides):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
              moe_router_topk=2, use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


@pytest.mark.parametrize("overrides, kwargs, message", [
    ({"moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "position"}, {}, "allowed: ['probs']"),
    ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, {},
     "moe_pad_expert_input_to_capacity=True is not supported"),
    ({}, {"router": "hyper", "router_options": {"k_min": 1, "k_max": 2, "k_schedule_steps": 10}}, "k schedule"),
    ({"moe_router_load_balancing_type": "seq_aux_loss"}, {}, "allowed: ['aux_loss', 'global_aux_loss', 'none']"),
    ({}, {"router": "attention"}, "reads the preceding attention"),
    ({}, {"router": "nope"}, "allowed: ["),
    ({}, {"router": "topk", "router_options": {"bogus": 1}}, "unknown key(s) ['bogus']"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1}, {"router": "sinkhorn"},
     "max_groups_per_token is not allowed with router 'sinkhorn'"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 1}, {"router": "topk"},
     "moe_router_num_groups=4, moe_router_group_topk=1: model.moe.max_groups_per_token=1: 1 group(s) of 1 experts"),
])
def test_bad_configuration_is_refused(overrides, kwargs, message):
    from moe_dist.integrations.megatron import MegatronRouter

    with pytest.raises(ValueError) as err:
        MegatronRouter(_config(**overrides), None, **kwargs)
    assert message in str(err.value)


def test_spec_helper_replaces_only_moe_routers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_dist.integrations.megatron import MegatronRouter, use_moe_dist_router

    moe = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    spec = use_moe_dist_router(moe, router="sinkhorn", router_options={"max_iters": 20})
    builder = spec.submodules.mlp.submodules.router
    assert builder.func is MegatronRouter and builder.keywords["router"] == "sinkhorn"
    assert moe.submodules.mlp.submodules.router is not builder  # the input spec is left as it was
    with pytest.raises(ValueError, match="has no MoE layer"):
        use_moe_dist_router(get_gpt_layer_local_spec())


# ---- group-limited routing against Megatron-Core's own rule -----------------------------------
@pytest.mark.parametrize("E, k, G, M", [(8, 2, 2, 1), (8, 4, 4, 2), (16, 6, 4, 2), (16, 8, 8, 4), (64, 8, 8, 4)])
def test_group_limit_chooses_what_megatron_chooses(E, k, G, M):
    """select_topk with ``groups=(G, M)`` picks the experts Megatron-Core's ``group_limited_topk``
    picks (moe_router_num_groups / moe_router_group_topk) from the same softmax scores: the same
    rule written twice, by independent hands."""
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    from moe_dist.moe.routers.base import select_topk

    torch.manual_seed(E * 100 + k)
    probs = torch.softmax(torch.randn(4096, E) * 2, dim=-1)
    ids, gates = select_topk(probs, probs, k, False, groups=(G, M))
    theirs_p, theirs_ids = group_limited_topk(probs, k, probs.shape[0], E, G, M)
    assert torch.equal(ids.sort(-1).values, theirs_ids.sort(-1).values)
    torch.testing.assert_close(gates.sort(-1).values, theirs_p.sort(-1).values, rtol=0, atol=0)
    assert max(len(set((row // (E // G)).tolist())) for row in ids) == M  # at most M groups, and M used
