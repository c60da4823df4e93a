"""``parallel.ep`` on any number of processes (moe_dist/config/layout.py): the sizes allowed, what
``parallel.ep: auto`` picks from where the ranks run, the refusal of an explicit size that does not
fit (naming the allowed ones), and both on real gloo process groups. The same job continuing on fewer
or more nodes is tests/test_multinode_resize.py (the namespace cluster)."""
from __future__ import annotations

import itertools
import math
import os

import pytest

from helpers.dist_harness import run_ranks
from moe_dist.config import ConfigError, load_config
from moe_dist.config.layout import auto_ep, ep_sizes, expert_parallel_size

TEST_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "test.yaml")


def test_allowed_sizes_divide_the_world_size_and_the_experts():
    assert ep_sizes(4, 4) == [1, 2, 4]
    assert ep_sizes(2, 4) == [1, 2]
    assert ep_sizes(6, 8) == [1, 2]
    assert ep_sizes(3, 12) == [1, 3]
    assert ep_sizes(1, 8) == [1]
    assert ep_sizes(64, 256) == [1, 2, 4, 8, 16, 32, 64]


def nodes(*per_node: int) -> list[str]:
    """Host names of ranks numbered node by node (torchrun, Slurm's block distribution)."""
    return [f"node{i}" for i, n in enumerate(per_node) for _ in range(n)]


@pytest.mark.parametrize("experts,hosts,expected", [
    (4, nodes(2, 2), 2),          # 2 nodes x 2: the all-to-all stays inside each node (not 4 across both)
    (4, nodes(2), 2),             # the remaining node of that job: the same size
    (4, nodes(1, 1), 1),          # 2 nodes x 1: any larger group would span nodes
    (4, nodes(4), 4),             # one machine: the largest allowed size
    (8, nodes(8, 8), 8),
    (8, nodes(8, 8, 8), 8),       # 24 processes: 8 still divides both
    (6, nodes(4, 4), 2),          # gcd(6, 4)
    (4, nodes(3, 1), 1),          # unequal nodes: a group of 2 would span node0 and node1 (ranks 2, 3)
    (4, nodes(2, 4, 2), 2),
    (4, ["a", "b", "a", "b"], 1), # ranks dealt round-robin over the nodes (Slurm's cyclic distribution)
    (4, nodes(1), 1),
])
def test_auto_is_the_largest_size_whose_groups_stay_on_one_host(experts, hosts, expected):
    assert auto_ep(experts, hosts) == expected


def test_auto_matches_its_definition_on_every_small_layout():
    """Against the definition, by brute force: every placement of up to 6 ranks on up to 3 hosts."""
    for world in range(1, 7):
        for hosts in itertools.product("abc", repeat=world):
            for experts in (1, 2, 3, 4, 6, 8, 12):
                fits = [d for d in range(1, world + 1) if world % d == 0 and experts % d == 0
                        and all(len(set(hosts[s:s + d])) == 1 for s in range(0, world, d))]
                assert auto_ep(experts, list(hosts)) == max(fits), (hosts, experts)
    # ranks numbered node by node, the same count on every node: the gcd of the experts and that count
    for per_node, n_nodes, experts in itertools.product((1, 2, 3, 4, 8), (1, 2, 3), (2, 4, 6, 8, 64)):
        assert auto_ep(experts, nodes(*[per_node] * n_nodes)) == math.gcd(experts, per_node)


def test_an_explicit_size_is_kept_or_refused_with_the_allowed_ones():
    assert expert_parallel_size(4, 4, nodes(2, 2)) == 4  # explicit: spanning nodes is the user's choice
    assert expert_parallel_size(2, 4, nodes(2)) == 2
    with pytest.raises(ConfigError) as info:
        expert_parallel_size(4, 4, nodes(2))  # the 2-node job's ep=4 on the remaining node
    assert str(info.value) == ("parallel.ep: 4 must divide the world size 2; allowed on 2 process(es) with "
                               "model.moe.num_experts=4: 1, 2 or auto")
    with pytest.raises(ConfigError, match=r"^parallel.ep: 2 must divide the world size 3; allowed on 3 process\(es\) "
                                          r"with model.moe.num_experts=4: 1 or auto$"):
        expert_parallel_size(2, 4, nodes(3))
    assert expert_parallel_size("auto", 4, nodes(2, 2)) == 2


def test_the_config_accepts_auto_and_names_the_allowed_values():
    cfg = load_config(TEST_CONFIG, ["parallel.ep=auto"])
    assert cfg.parallel.ep == "auto"
    for world in (1, 2, 3, 4, 8):
        cfg.check_world(world)  # auto fits any number of processes
    assert cfg.expert_parallel_size(nodes(2, 2)) == 2
    with pytest.raises(ConfigError, match=r"^parallel.ep: 3 must divide model.moe.num_experts=4; allowed: 1, 2, 4 or "
                                          r"auto$"):
        load_config(TEST_CONFIG, ["parallel.ep=3"])
    with pytest.raises(ConfigError, match=r"^parallel.ep: got 'automatic' \(str\); allowed: an integer or one of "
                                          r"'auto'$"):
        load_config(TEST_CONFIG, ["parallel.ep=automatic"])
    with pytest.raises(ConfigError, match=r"^parallel.ep: 4 must divide the world size 6; allowed on 6 process\(es\) "
                                          r"with model.moe.num_experts=4: 1, 2 or auto$"):
        load_config(TEST_CONFIG, ["parallel.ep=4", "train.global_batch=12", "eval.batch=12"]).check_world(6)


def _groups_of(rank, world_size, choices):
    """``init_distributed`` on an existing gloo group with the config's ep, for each ``parallel.ep`` choice."""
    from moe_dist.distributed.bootstrap import init_distributed

    out = []
    for choice in choices:
        cfg = load_config(TEST_CONFIG, [f"parallel.ep={choice}"])
        try:
            rt = init_distributed(cfg.expert_parallel_size, cfg.model.moe.num_experts)
        except ConfigError as e:
            out.append({"error": str(e)})
            continue
        out.append({"ep": rt.groups.ep_size, "edp": rt.groups.edp_size, "mesh": list(rt.mesh.mesh.shape)})
    return out


def test_auto_and_a_refused_size_on_real_process_groups():
    """Every rank gathers the host names (all this machine's here) and reaches the same size; an
    explicit size that does not fit is refused on every rank, before any group is made."""
    results = run_ranks(_groups_of, 2, (["auto", 4, 1],))
    assert results == [[{"ep": 2, "edp": 1, "mesh": [1, 2]},
                        {"error": "parallel.ep: 4 must divide the world size 2; allowed on 2 process(es) with "
                                  "model.moe.num_experts=4: 1, 2 or auto"},
                        {"ep": 1, "edp": 2, "mesh": [2, 1]}]] * 2
