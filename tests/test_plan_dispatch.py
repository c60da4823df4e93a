"""The planner's dispatch bytes and step-time model: the expected rows of a balanced router against a
seeded Monte-Carlo count (flat, hierarchical, node-limited), hand-computed cases of the alpha-beta
model, that it moves the right way, and ``moe-dist plan``'s new section."""
import json
import os
from math import comb

import pytest
import torch

from moe_dist.cli import main as cli
from moe_dist.config import ConfigError
from moe_dist.plan import plan
from moe_dist.plan.memory import Workload, all_to_all_bytes
from moe_dist.plan.planner import make_network
from moe_dist.model.params import BlockShape
from moe_dist.plan.timing import Links, all_to_all_s, exchange_pass_s, ring_s
from moe_dist.plan.dispatch_rows import dispatch_bytes, group_shape, rows_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 100_000


def _experts(E: int, k: int, tokens: int, gen: torch.Generator, groups=None) -> torch.Tensor:
    """[tokens, k] expert ids of a balanced router: the top k of i.i.d. scores (k distinct experts,
    uniform); ``groups=(G, M)``: the node-limited rule first (group score = the sum of its best
    max(1, k // M) scores, the M best groups kept, the top k taken among their experts)."""
    scores = torch.randn(tokens, E, generator=gen, dtype=torch.float64)
    if groups is not None:
        G, M = groups
        per = scores.view(tokens, G, E // G)
        group_score = per.topk(max(1, k // M), dim=-1).values.sum(-1)
        keep = torch.zeros(tokens, G, dtype=torch.bool).scatter_(1, group_score.topk(M, dim=-1).indices, True)
        scores = scores.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    return scores.topk(k, dim=-1).indices


def _count(E: int, ep: int, g: int, k: int, seed: int, groups=None) -> dict:
    """Rows per token per all-to-all, counted over tokens of every origin rank: flat (one row per pair
    on another rank) and hierarchical (one row per distinct remote node to the proxy with the
    origin's local index, then one row per pair on another rank of that node, sent by the proxy)."""
    gen = torch.Generator().manual_seed(seed)
    r = min(ep, g)
    experts = _experts(E, k, TOKENS, gen, groups)
    origin = torch.randint(0, ep, (TOKENS,), generator=gen)
    rank = experts // (E // ep)  # [T, k] destination rank of each pair
    node, o_node, o_local = rank // r, (origin // r)[:, None], (origin % r)[:, None]
    flat_intra = ((node == o_node) & (rank != origin[:, None])).sum().item()
    flat_inter = (node != o_node).sum().item()
    n = ep // r
    hit = torch.zeros(TOKENS, n, dtype=torch.bool).scatter_(1, node, True)
    hier_inter = (hit.sum(1) - hit[torch.arange(TOKENS), o_node[:, 0]].long()).sum().item()
    proxy = node * r + o_local  # the rank of each pair's node that receives the token's row
    hier_intra = (rank != proxy).sum().item()
    return {"flat": {"intra": flat_intra / TOKENS, "inter": flat_inter / TOKENS},
            "hierarchical": {"intra": hier_intra / TOKENS, "inter": hier_inter / TOKENS}}


@pytest.mark.parametrize("E,ep,g,k", [(8, 4, 2, 2), (64, 64, 8, 8), (64, 16, 8, 6), (32, 32, 4, 4), (16, 4, 4, 2)])
def test_rows_equal_a_monte_carlo_count(E, ep, g, k):
    s = group_shape(ep, g, E, k)
    counted = _count(E, ep, g, k, seed=E + ep + k)
    for dispatch in ("flat", "hierarchical"):
        want = rows_per_token(s, dispatch)
        for where in ("intra", "inter"):
            assert want[where] == pytest.approx(counted[dispatch][where], rel=0.02, abs=1e-3), (dispatch, where)


@pytest.mark.parametrize("E,ep,g,k,M", [(64, 64, 8, 8, 1), (64, 64, 8, 8, 2), (64, 64, 8, 8, 4), (64, 64, 8, 2, 2),
                                        (32, 16, 4, 4, 2), (8, 4, 2, 2, 1)])
def test_node_limited_rows_equal_a_monte_carlo_count(E, ep, g, k, M):
    s = group_shape(ep, g, E, k)
    counted = _count(E, ep, g, k, seed=7 * M + k, groups=(s.nodes, M))
    # the node limit leaves every pair's destination equally likely: the flat dispatch sends as much
    assert rows_per_token(s, "flat", M) == rows_per_token(s, "flat")
    for dispatch in ("flat", "hierarchical"):
        want = rows_per_token(s, dispatch, M)
        for where in ("intra", "inter"):
            assert want[where] == pytest.approx(counted[dispatch][where], rel=0.02, abs=1e-3), (dispatch, M, where)
    # no token's experts span more than M nodes in the sampler (the rule it implements)
    gen = torch.Generator().manual_seed(1)
    nodes = _experts(E, k, 2000, gen, (s.nodes, M)) // (E // s.nodes)
    assert max(len(set(row.tolist())) for row in nodes) <= M


def test_hand_computed_rows_and_bytes():
    # 8 experts on 2 nodes x 2 ranks, top-2: flat sends a token's remote pairs (2 x 2/4 = 1 row per token);
    # hierarchical one row per remote node hit: 1 - C(4,2)/C(8,2) = 22/28, the duplication being
    # P(both experts on the remote node) = 6/28; inside the node 2 x 1/2 = 1 row per token
    s = group_shape(4, 2, 8, 2)
    assert rows_per_token(s, "flat") == {"intra": 0.5, "inter": 1.0}
    hier = rows_per_token(s, "hierarchical")
    assert hier["inter"] == pytest.approx(22 / 28) and hier["intra"] == pytest.approx(1.0)
    assert rows_per_token(s, "flat")["inter"] - hier["inter"] == pytest.approx(comb(4, 2) / comb(8, 2))
    assert rows_per_token(s, "hierarchical", 1)["inter"] == pytest.approx(0.5)
    # bytes: rows x tokens x d_model x dtype x 4 transfers x layers x micro-batches (x 6/4 recomputed forward)
    b = dispatch_bytes(s, "flat", None, tokens=768, d_model=256, act_bytes=4, moe_layers=4, grad_accum=1,
                       checkpointing=False)
    assert b == {"intra": 0.5 * 768 * 256 * 4 * 4 * 4, "inter": 1.0 * 768 * 256 * 4 * 4 * 4}
    ck = dispatch_bytes(s, "flat", None, 768, 256, 4, 4, 1, checkpointing=True)
    assert ck["inter"] == b["inter"] * 6 / 4
    # the flat figures are the memory module's all-to-all bytes (one rule)
    shape = BlockShape(d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768, expert_d_ff=512, num_experts=8,
                       top_k=2, gated=True)
    work = Workload(seq_len=256, micro_batch=3, grad_accum=1, act_bytes=4, vocab_size=4096, n_layers=4,
                    moe_blocks=[0, 1, 2, 3])
    old = all_to_all_bytes(shape, work, ep=4, gpus_per_node=2, checkpointing=False)
    assert old["per_gpu"] == pytest.approx(b["intra"] + b["inter"]) and old["inter_node_per_gpu"] == pytest.approx(b["inter"])
    assert group_shape(6, 4, 12, 2) is None  # a group of 6 on nodes of 4: not whole nodes


def test_alpha_beta_hand_cases():
    links = Links(intra_gbps=800.0, inter_gbps=80.0, alpha_s=1e-5)  # 100 GB/s and 10 GB/s
    s = group_shape(4, 2, 8, 2)
    # flat, 1000 tokens of 1024 fp32 values: 0.5 row/token intra (2.048 MB over 100 GB/s = 20.48 us) beside
    # 1 row/token inter for both GPUs of the node (8.192 MB over 10 GB/s = 819.2 us)
    a = all_to_all_s(s, "flat", None, 1000, 1024, 4, links, gpus_per_node=2)
    assert a["total"] == pytest.approx(1e-5 + 819.2e-6)
    h = all_to_all_s(s, "hierarchical", None, 1000, 1024, 4, links, gpus_per_node=2)
    assert h["inter"] == pytest.approx(1e-5 + 2 * 1000 * 22 / 28 * 4096 / 10e9)
    assert h["intra"] == pytest.approx(1e-5 + 1000 * 4096 / 100e9)
    # the loop kernel's pipeline: max(A, own/2) + remote + max(A, own/2)
    assert exchange_pass_s({"total": 1.0, "intra": 0.0, "inter": 1.0, "hidden": 1.0}, 8.0, 0.25, True) == pytest.approx(1 + 6 + 1)
    assert exchange_pass_s({"total": 0.1, "intra": 0.0, "inter": 0.1, "hidden": 0.1}, 8.0, 0.25, True) == pytest.approx(1 + 6 + 1)
    assert exchange_pass_s({"total": 0.1, "intra": 0.0, "inter": 0.1, "hidden": 0.1}, 8.0, 0.25, False) == pytest.approx(8.2)
    # hierarchical: the inter-node stage waits, the intra one overlaps
    assert exchange_pass_s({"total": 1.5, "intra": 0.5, "inter": 1.0, "hidden": 0.5}, 8.0, 0.25, True) == pytest.approx(2 + 2 + 6)
    # one GPU per node and no latency: the fan-out costs nothing, and still the inter-node stage waits in full
    h1 = all_to_all_s(group_shape(4, 1, 8, 2), "hierarchical", None, 1000, 1024, 4,
                      Links(intra_gbps=800.0, inter_gbps=80.0, alpha_s=0.0), gpus_per_node=1)
    assert h1["intra"] == 0.0 and h1["hidden"] == 0.0 and h1["inter"] > 0
    assert exchange_pass_s(h1, 8.0, 0.25, True) == pytest.approx(2 * h1["inter"] + 2 * 1.0 + 6)
    # ring over 4 ranks on 2 nodes of 8 MB: 3 alpha + 6 MB over the slower link (the node's uplink)
    assert ring_s(8e6, 4, True, 1, links) == pytest.approx(3e-5 + 6e6 / 10e9)
    assert ring_s(8e6, 4, False, 1, links) == pytest.approx(3e-5 + 6e6 / 100e9)
    assert ring_s(8e6, 1, True, 1, links) == 0.0


def _olmoe(nodes, **net):
    p = plan(os.path.join(ROOT, "configs", "olmoe-1b-7b.yaml"), nodes, 8, 80, micro_batch=1,
             network=make_network(**net))
    return {l["ep"]: {(v["dispatch"], v["max_groups"]): v for v in l["dispatch"]} for l in p["layouts"]}


def test_step_time_moves_the_right_way():
    slow, fast = _olmoe(2, inter_gbps=400), _olmoe(2, inter_gbps=3200)
    for key in (("flat", None), ("hierarchical", None), ("hierarchical", 1)):  # 2 nodes: no M = 2 row
        assert slow[16][key]["step_s"] > fast[16][key]["step_s"]  # more bandwidth, faster
        assert slow[16][key]["compute_s"] == fast[16][key]["compute_s"]
    within = slow[8][("flat", None)]
    assert within["inter_bytes_per_gpu_per_step"] == 0 and ("hierarchical", None) not in slow[8]
    # top-8 of 64 experts over 4 nodes: hierarchical sends fewer inter-node bytes and wins when the
    # uplink is the bottleneck; node-limited routing saves nothing under flat dispatch, much under hierarchical
    t = _olmoe(4, inter_gbps=400)[32]
    assert t[("hierarchical", None)]["inter_bytes_per_gpu_per_step"] < t[("flat", None)]["inter_bytes_per_gpu_per_step"]
    assert t[("hierarchical", None)]["step_s"] < t[("flat", None)]["step_s"]
    assert t[("flat", 1)]["inter_bytes_per_gpu_per_step"] == t[("flat", None)]["inter_bytes_per_gpu_per_step"]
    assert (t[("hierarchical", 1)]["inter_bytes_per_gpu_per_step"] < t[("hierarchical", 2)]["inter_bytes_per_gpu_per_step"]
            < t[("hierarchical", None)]["inter_bytes_per_gpu_per_step"])
    # with a free network only the compute and the pipeline's own rows remain: the step is the compute
    free = _olmoe(2, intra_gbps=1e9, inter_gbps=1e9, alpha_us=0)[16][("flat", None)]
    assert free["step_s"] == pytest.approx(free["compute_s"], rel=1e-3)
    # twice the compute rate: half the compute, a shorter step
    quick = _olmoe(2, inter_gbps=400, compute_tflops=800)[16][("flat", None)]
    assert quick["compute_s"] == pytest.approx(slow[16][("flat", None)]["compute_s"] / 2)
    assert quick["step_s"] < slow[16][("flat", None)]["step_s"]


def test_plan_command_prints_the_dispatch_section(capsys):
    config = os.path.join(ROOT, "configs", "tiny.yaml")
    assert cli(["plan", "--config", config, "--nodes", "2", "--gpus-per-node", "2", "--inter-gbps", "0.1",
                "--compute-tflops", "0.01", "--no-fsdp-overlap"]) == 0
    text = capsys.readouterr().out
    assert "expert dispatch per step (balanced router) and predicted step time" in text
    assert "inter-node 0.1 Gbit/s per node" in text and "FSDP overlap off" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith("4 ")]
    assert {r[1] for r in rows if len(r) > 3} >= {"flat", "hierarchical"}
    assert cli(["plan", "--config", config, "--nodes", "2", "--gpus-per-node", "2", "--dispatch", "hierarchical",
                "--max-groups", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    four = next(l for l in out["layouts"] if l["ep"] == 4)["dispatch"]
    assert [(v["dispatch"], v["max_groups"]) for v in four] == [("hierarchical", None), ("hierarchical", 1)]
    # ep=2 sits inside a node: there the hierarchical dispatch is the flat one, and that row is shown
    two = next(l for l in out["layouts"] if l["ep"] == 2)["dispatch"]
    assert [(v["dispatch"], v["max_groups"]) for v in two] == [("flat", None)]
    assert out["network"]["inter_gbps_per_node"] == 3200.0
    for argv, key in ((["--dispatch", "ring"], "--dispatch"), (["--inter-gbps", "0"], "--inter-gbps"),
                      (["--max-groups", "0"], "--max-groups"), (["--alpha-us", "-1"], "--alpha-us")):
        assert cli(["plan", "--config", config, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"moe-dist plan: error: {key}: ") and "allowed:" in err[0]
    with pytest.raises(ConfigError, match="--compute-tflops"):
        make_network(compute_tflops=0)


def test_the_configured_dispatch_and_node_limit_are_marked(capsys):
    config = os.path.join(ROOT, "configs", "tiny.yaml")
    assert cli(["plan", "--config", config, "--nodes", "2", "--gpus-per-node", "2", "--max-groups", "2",
                "parallel.dispatch=hierarchical", "model.moe.router_groups=2", "model.moe.max_groups_per_token=1"]) == 0
    marked = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(" *")]
    assert [r[1:4] for r in marked] == [["4", "hierarchical", "1"]]  # M=1 shown although --max-groups named only 2


def test_plan_table_prints_the_presets_and_regimes(capsys):
    from benchmarks.plan_table import main

    assert main(["--gpus", "8,16"]) == 0
    text = capsys.readouterr().out
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]): line for line in text.splitlines()
            if line.startswith("| olmoe") or line.startswith("| tinyllama")}
    # OLMoE at 16 GPUs, ep=16: the group spans 2 nodes, so hierarchical and M=1 have figures (M=2 = no limit)
    cells = [c.strip() for c in rows[("olmoe-1b-7b", "16", "16")].strip("|").split("|")]
    assert cells[3] == "2" and all(c != "-" for c in cells[4:7]) and cells[7] == "-"
    flat, hier = (float(c.split()[0].rstrip("*")) for c in cells[4:6])
    assert hier < flat
    # TinyLlama's 8 experts never leave a node: no hierarchical figure
    assert rows[("tinyllama-upcycle-8x2", "16", "8")].count(" - ") == 3
    assert "| top-2 instead of top-8 |" in text and "| 8x slower uplink" in text
