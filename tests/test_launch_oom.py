"""launch/slurm/common.sh's oom_evidence names the kernel's out-of-memory kill: a process given a memory
cgroup (v1) of 64 MiB allocates 512 MiB and is killed (137) by the kernel; oom_evidence, in bash with no
Python, prints the kernel log's line for it since the launch, and nothing for a time after it.

Needs root, cgroup v1's memory controller at /sys/fs/cgroup/memory and a readable kernel log (dmesg):
ENVIRONMENT.md section 10; skipped with the reason elsewhere."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "/sys/fs/cgroup/memory"


def _oom_evidence(since: int) -> str:
    lib = os.path.join(ROOT, "launch", "slurm", "common.sh")
    r = subprocess.run(["bash", "-c", f'. "{lib}"; oom_evidence "$1" ""', "_", str(since)], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert r.returncode == 0 and not r.stderr, r
    return r.stdout


def test_the_kernels_out_of_memory_kill_is_named(tmp_path):
    if os.geteuid() != 0 or not os.path.exists(os.path.join(BASE, "memory.limit_in_bytes")):
        pytest.skip("needs root and cgroup v1's memory controller at /sys/fs/cgroup/memory")
    if subprocess.run(["dmesg"], capture_output=True).returncode != 0:
        pytest.skip("the kernel log is not readable here (dmesg)")
    group = os.path.join(BASE, f"moe-oom-test-{os.getpid()}")
    os.makedirs(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(64 << 20))
        since = int(time.time())
        p = subprocess.run(["bash", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "b = bytearray(512 << 20)"',
                            sys.executable], capture_output=True, text=True, timeout=120)
        assert p.returncode == -9, p  # SIGKILL (a shell says 137)
        deadline = time.monotonic() + 10
        while "Killed process" not in (out := _oom_evidence(since)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the kernel's line may come a moment after the kill
    finally:
        for _ in range(50):
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
    lines = out.splitlines()
    assert lines and all(line.startswith("out of memory: the kernel: ") for line in lines), out
    assert "Killed process" in lines[-1] and "total-vm" not in lines[-1], out
    assert _oom_evidence(int(time.time()) + 5) == ""  # nothing after it
