import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


# opt-in groups: marker -> (the variable that turns it on, why it is not in the default suite, its command).
# .ci/run runs each after the default suite; the Docker marker keeps its own switch (tests/test_docker_image.py).
OPT_IN = {
    "multinode": ("MOE_DIST_MULTINODE", "network-namespace nodes, minutes; root and `ip netns`",
                  "MOE_DIST_MULTINODE=1 scripts/test.sh -m multinode"),
    "compile": ("MOE_DIST_COMPILE", "every router and feature compiled, tens of minutes on 2 cores",
                "MOE_DIST_COMPILE=1 scripts/test.sh -m compile"),
}


def pytest_collection_modifyitems(config, items):
    """Tests of an opt-in marker (:data:`OPT_IN`) are skipped with their command as the reason unless
    their variable is 1."""
    import pytest

    for marker, (var, why, cmd) in OPT_IN.items():
        if os.environ.get(var) == "1":
            continue
        skip = pytest.mark.skip(reason=f"opt-in ({why}): {cmd}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_configure(config):
    """In-memory snapshots (``ckpt.memory_every``) of the runs the tests start land in a directory of
    this test session, removed at its end: a run a test kills leaves its snapshots behind by design
    (a resume takes them), and they must not pile up in the machine's /dev/shm. A test that names
    its own root (``MOE_DIST_SNAPSHOT_ROOT``) keeps it."""
    import tempfile

    from moe_dist.train.checkpoint.holder import ROOT_ENV

    if os.environ.get(ROOT_ENV):
        return
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    config._snapshot_root = tempfile.mkdtemp(prefix="moe_dist-tests-", dir=base)
    os.environ[ROOT_ENV] = config._snapshot_root


def pytest_unconfigure(config):
    import shutil

    root = getattr(config, "_snapshot_root", None)
    if root:
        shutil.rmtree(root, ignore_errors=True)
