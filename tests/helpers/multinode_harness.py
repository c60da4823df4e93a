"""The namespace cluster and the project's launcher on it, shared by the multi-node tests
(tests/test_multinode.py, tests/test_multinode_resize.py).

* ``cluster``: a module fixture of 2 nodes (tests/helpers/cluster/), skipped with the reason
  where it cannot run; ``_clean_nodes`` (autouse where imported): the bridge allowed through
  iptables before each test, no process left on a node and every link up after it;
* :func:`start_nodes` / :func:`finish`: ``launch/torchrun.sh`` on the first nodes, and one node's
  result; :func:`_config`: ``configs/test.yaml`` with a run directory and quiet settings;
* :func:`_one_rank_line`: the one line a node's launcher prints for its ranks.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from helpers.cluster import Cluster, ClusterUnavailable, remove_stale, unavailable_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUIET = ["run.progress=false", "run.plots=false", "run.tensorboard=false", "ckpt.save_final=false",
         "eval.max_sequences=8"]
STEPS = 4
RUN_TIMEOUT = 240  # one launch on a busy 2-core machine: ~20-40 s alone


def up_or_skip(prepare=None, nodes: int = 2, **kw):
    """A cluster of ``nodes`` nodes for a module's tests (a generator for a fixture: ``yield from``),
    ``prepare(cluster)`` run on it first; the test skipped with the reason where none can be made."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    remove_stale()
    c = Cluster(nodes, **kw)
    try:
        c.up()  # removes what it made when it fails
    except ClusterUnavailable as e:  # e.g. a firewall between the bridge's ports
        pytest.skip(str(e))
    try:
        if prepare is not None:
            prepare(c)
        yield c
    finally:
        c.down()


@contextlib.contextmanager
def slurm_on(c: Cluster, prefix: str, **kw):
    """The project's test Slurm across the namespace nodes of ``c`` in a fresh directory (skipped with
    the reason when it cannot be set up); ``kw`` go to :class:`~helpers.slurm.SlurmCluster`."""
    from helpers.slurm import SlurmCluster, install_slurm

    reason = install_slurm()
    if reason:
        pytest.skip(f"cannot set up Slurm: {reason}")
    root = tempfile.mkdtemp(prefix=prefix)
    os.chmod(root, 0o755)
    try:
        with SlurmCluster(root, on=c, **kw) as s:
            yield s
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    yield from up_or_skip()


@pytest.fixture(autouse=True)
def _clean_nodes(request):
    """Before every test, the bridge allowed through iptables (a dockerd started meanwhile, as CI's
    engine set-up does, sets the FORWARD policy to DROP); after it, no process left on a node and
    every link plugged in (also after a failure)."""
    c = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    if c is not None:
        c.allow_forwarding()
    yield
    if c is not None:
        for nd in c.nodes:
            c.kill_node(nd)
            c.set_link(nd, True)


def _env(**extra) -> dict:
    """This environment for a node's processes, less what a launcher or the rule of the socket interface
    sets (a test names those itself), plus the interpreter and the repository."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
                        "NPROC_PER_NODE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") and not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _config(tmp, name, *extra) -> list[str]:
    return ["configs/test.yaml", f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache",
            f"train.steps={STEPS}", *QUIET, *extra]


def start_nodes(c: Cluster, tmp, name: str, nodes: int, nproc: int, *overrides, master="node0", nnodes=None,
                rdzv_id=None):
    """Start ``launch/torchrun.sh`` on the first ``nodes`` nodes; [(Popen, stdout file, stderr file)].
    ``nnodes``: the launcher's ``NNODES`` (default ``nodes``; ``"MIN:MAX"``: elastic); ``rdzv_id``: the
    rendezvous id (default: a new one)."""
    rdzv_id = rdzv_id or f"{name}-{time.time_ns()}"
    return [start_node(c, tmp, name, i, nproc, *overrides, master=master, nnodes=nnodes or str(nodes), rdzv_id=rdzv_id)
            for i in range(nodes)]


def start_node(c: Cluster, tmp, name: str, i: int, nproc: int, *overrides, master: str, nnodes: str, rdzv_id: str,
               suffix: str = ""):
    """Start ``launch/torchrun.sh`` on node ``i`` of a job with rendezvous id ``rdzv_id``; (Popen, stdout
    file, stderr file), the files ``NAME.nodeI{suffix}.out`` / ``.err``."""
    env = _env(NPROC_PER_NODE=str(nproc), NNODES=nnodes, NODE_RANK=str(i), MASTER_ADDR=master, RDZV_ID=rdzv_id)
    out = open(tmp / f"{name}.node{i}{suffix}.out", "w+")
    err = open(tmp / f"{name}.node{i}{suffix}.err", "w+")
    return (c.popen(c.nodes[i], ["bash", "launch/torchrun.sh", *_config(tmp, name, *overrides)], env=env,
                    cwd=ROOT, stdout=out, stderr=err), out, err)


def finish(proc, timeout: float):
    """Wait for one node's launcher (killed after ``timeout`` s); (rc, stdout, stderr)."""
    p, out, err = proc
    try:
        p.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    out.seek(0)
    err.seek(0)
    return p.returncode, out.read(), err.read()


def _one_rank_line(err: str) -> str:
    """The rank's own line: the only one of the job on the node (torch's socket warnings aside)."""
    lines = [line for line in err.splitlines() if line.strip() and not _TORCH_WARNING.match(line)]
    assert len(lines) == 1 and lines[0].startswith("moe-dist train:"), err[-4000:]
    return lines[0]


# torch's warnings, from C++ ([W1125 16:27:24.886935753 socket.cpp:207] [c10d] The hostname of the client
# socket cannot be retrieved) and from torchrun (W1125 17:17:00.525000 10258 torch/distributed/run.py:865]
# node_rank is only used for static rdzv_backend)
_TORCH_WARNING = re.compile(r"^\[?W\d{4} [\d:.]+ (\d+ )?\S+\] ")
