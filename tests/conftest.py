import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Multi-node tests (marker ``multinode``: nodes as network namespaces, minutes) are opt-in, as the
    Docker ones are: ``MOE_DIST_MULTINODE=1 scripts/test.sh -m multinode`` (what ``.ci/run`` runs after
    the default suite). Without it they are skipped with that command as the reason."""
    if os.environ.get("MOE_DIST_MULTINODE") == "1":
        return
    import pytest

    skip = pytest.mark.skip(reason="opt-in (network-namespace nodes, minutes; root and `ip netns`): "
                                   "MOE_DIST_MULTINODE=1 scripts/test.sh -m multinode")
    for item in items:
        if "multinode" in item.keywords:
            item.add_marker(skip)
