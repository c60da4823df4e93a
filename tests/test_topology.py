"""Which ranks share a node: host names or declared blocks of ranks, and the expert-parallel
groups' node layouts built from them on real gloo groups."""
import pytest

from helpers.dist_harness import run_ranks
from moe_dist.distributed.topology import NodeLayout, node_of_ranks
from moe_dist.errors import ConfigError


def test_nodes_from_host_names_in_first_seen_order():
    assert node_of_ranks(["b", "b", "a", "a", "c"]) == (0, 0, 1, 1, 2)
    assert node_of_ranks(["h"] * 4) == (0, 0, 0, 0)


def test_declared_blocks_of_ranks_override_the_names():
    assert node_of_ranks(["h"] * 6, ranks_per_node=2) == (0, 0, 1, 1, 2, 2)
    with pytest.raises(ConfigError, match=r"parallel.ranks_per_node=4 must be >= 1 and divide the world size 6"):
        node_of_ranks(["h"] * 6, ranks_per_node=4)


def test_ranks_per_node_is_checked_before_any_process_starts():
    """``check_world`` (the launcher's pre-flight, with the process count) refuses a block size
    that does not divide it, naming the key."""
    import os

    from moe_dist.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "test.yaml"), ["parallel.ranks_per_node=3", "parallel.ep=1"])
    with pytest.raises(ConfigError, match=r"^parallel.ranks_per_node: 3 must be >= 1 and divide the number of processes \(4\)"):
        cfg.check_world(4)
    cfg.check_world(3)
    load_config(os.path.join(root, "configs", "test.yaml"), ["parallel.ranks_per_node=2"]).check_world(4)


def test_layout_renumbers_and_answers_questions():
    lay = NodeLayout((3, 3, 5, 5))
    assert lay.node_of == (0, 0, 1, 1) and lay.num_nodes == 2 and lay.multi_node
    assert lay.peers_on(1) == (2, 3) and lay.local_index(3) == 1
    assert lay.contiguous() and lay.uniform() and lay.node_blocks()
    odd = NodeLayout((0, 1, 0))
    assert not odd.contiguous() and not odd.uniform() and not odd.node_blocks()
    assert NodeLayout((0, 0, 1)).contiguous() and not NodeLayout((0, 0, 1)).node_blocks()  # 2 ranks and 1
    assert not NodeLayout().multi_node and NodeLayout().size == 1 and not NodeLayout().node_blocks()


def _groups(rank, world, ep, ranks_per_node):
    from moe_dist.distributed.bootstrap import init_distributed

    rt = init_distributed(ep, 8, backend="gloo", device="cpu", ranks_per_node=ranks_per_node, environ={})
    return rt.groups.ep_nodes.node_of


def test_ep_groups_know_the_nodes_of_their_peers():
    # 4 ranks, declared as 2 nodes of 2: one ep group of 4 spans both; ep=2 groups stay on one node
    assert run_ranks(_groups, 4, (4, 2)) == [(0, 0, 1, 1)] * 4
    assert run_ranks(_groups, 4, (2, 2)) == [(0, 0)] * 4
    # the ranks' host names (all this machine's): one node
    assert run_ranks(_groups, 4, (4, None)) == [(0, 0, 0, 0)] * 4
