"""A container stand-in for the tasks of a Slurm job on the test Slurm cluster (tests/test_multinode_slurm.py,
tests/test_multinode_quickstart.py)."""
from __future__ import annotations

import os
import sys


def container_stand_in(root: str) -> dict:
    """A container for the tasks, as pyxis or apptainer make one: this test's interpreter (its virtual
    environment) is mounted at a path that is an empty directory outside, in a mount namespace of each
    task's own, its ``bin`` first on ``PATH`` there (so ``moe-dist`` runs by name inside only). Returns the
    environment for ``launch/slurm/train.sbatch``: ``MOE_DIST_TASK_PREFIX`` (the wrapper, which also
    prefixes any command: ``WRAPPER moe-dist ...``) and ``PYTHON`` (the interpreter inside); the batch
    script on the host cannot run it."""
    inside = os.path.join(root, "container-venv")
    os.makedirs(inside, exist_ok=True)
    wrapper = os.path.join(root, "container.sh")
    with open(wrapper, "w") as f:
        f.write("#!/bin/bash\nexec unshare --mount --propagation private /bin/bash -c "
                f"'mount --bind {sys.prefix} {inside} && PATH={inside}/bin:$PATH && exec \"$@\"' container \"$@\"\n")
    os.chmod(wrapper, 0o755)
    python = os.path.join(inside, "bin", os.path.basename(sys.executable))
    assert not os.path.exists(python)
    return {"PYTHON": python, "MOE_DIST_TASK_PREFIX": wrapper}
