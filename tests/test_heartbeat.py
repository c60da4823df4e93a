"""A silent rank noticed in seconds (moe_dist/distributed/heartbeat.py): real gloo ranks started
through the project's bootstrap with a real TCP store, one of them frozen with SIGSTOP (its
connections stay open, as with a hung machine or a cut link: no collective fails by itself before
parallel.timeout_s, 600 s here)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.dist_harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASE = os.path.join(HERE, "helpers", "heartbeat_case.py")
HEARTBEAT_S = 2


def _start(world: int, mode: str) -> list[subprocess.Popen]:
    port, procs = free_port(), []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, CASE, mode, str(HEARTBEAT_S)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def _ready(procs) -> None:
    for p in procs:
        line = p.stdout.readline().strip()
        assert line == "ready", (line, p.stderr.read() if p.poll() is not None else "")


def _ended(p, timeout: float) -> tuple[int, list[str]]:
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"rank still running after {timeout} s")
    return rc, p.stderr.read().strip().splitlines()


def _cleanup(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("frozen", [1, 2])
def test_a_frozen_rank_ends_the_others_in_seconds_with_its_name(frozen):
    procs = _start(3, "loop")
    try:
        _ready(procs)
        os.kill(procs[frozen].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for r, p in enumerate(procs):
            if r == frozen:
                continue
            rc, lines = _ended(p, 60)
            seconds = time.monotonic() - t0
            assert rc == 1 and len(lines) == 1, (rc, lines)  # one line, no traceback
            assert lines[0] == (f"moe-dist train: rank {r}: no heartbeat from rank {frozen} on {os.uname().nodename} "
                                f"for {HEARTBEAT_S} s (parallel.heartbeat_timeout_s): the job was stopped "
                                "(resume=auto continues from the last checkpoint)"), lines
            assert HEARTBEAT_S <= seconds < HEARTBEAT_S + 20, seconds
    finally:
        _cleanup(procs)


def test_a_lost_store_ends_every_rank_that_cannot_reach_it():
    """Rank 0's process holds the job's TCP store: frozen, the others can reach neither it nor the store."""
    procs = _start(3, "loop")
    try:
        _ready(procs)
        os.kill(procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for r, p in enumerate(procs[1:], start=1):
            rc, lines = _ended(p, 60)
            assert rc == 1 and len(lines) == 1, (rc, lines)
            assert lines[0].startswith(f"moe-dist train: rank {r}: the job's rendezvous store at 127.0.0.1:") and \
                lines[0].endswith(f"has not answered for {HEARTBEAT_S} s (parallel.heartbeat_timeout_s): this node "
                                  f"({os.uname().nodename}) is cut off from the others, or 127.0.0.1 is lost; the "
                                  "job was stopped (resume=auto continues from the last checkpoint)"), lines
            assert time.monotonic() - t0 < HEARTBEAT_S + 20
    finally:
        _cleanup(procs)


def test_ranks_that_wait_for_a_slow_peer_or_finish_first_are_not_taken_for_lost():
    """Rank 0 stays away from the shutdown barrier for twice the heartbeat timeout while the others
    wait in it, then all end normally: waiting is not silence, and a rank that is done is not lost."""
    procs = _start(3, "finish:3")
    try:
        for p in procs:
            rc, lines = _ended(p, 120)
            assert rc == 0 and lines == [], (rc, lines)
            assert p.stdout.read().split() == ["ready", "done"]
    finally:
        _cleanup(procs)


def test_silent_ranks_are_named_by_node():
    from moe_dist.distributed.roll_call import name_ranks

    hosts = ["node0", "node0", "node1", "node1"]
    assert name_ranks(hosts, [2, 3]) == "node node1 (ranks 2, 3)"
    assert name_ranks(hosts, [3]) == "rank 3"
    assert name_ranks(hosts, [1, 2, 3]) == "node node1 (ranks 2, 3); rank 1"
    assert name_ranks(["vm"] * 3, [1, 2]) == "ranks 1, 2 on vm"


def _read_reports(directory, rc: int) -> tuple[str, str, str]:
    """launch/lib.sh's read_reports, as the batch script runs it (bash, no Python): (exit status, lost
    nodes, reports read)."""
    lib = os.path.join(ROOT, "launch", "lib.sh")
    out = subprocess.run(["bash", "-c", f'. "{lib}"; read_reports "$1" {rc}; '
                          'printf "%s|%s|%s" "$REPORTS_RC" "$REPORTS_LOST" "$REPORTS_READ"', "_", str(directory)],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and not out.stderr, out
    return tuple(out.stdout.split("|"))


def test_a_launcher_reads_the_lost_nodes_from_the_ranks_reports(tmp_path):
    """What the Slurm batch script relaunches without (launch/lib.sh's read_reports, in bash with no
    Python on the PATH): the nodes whose ranks are all gone, from the lines of the ranks that failed; not
    a node with some ranks left, not a cut-off rank's own node, not a rank that ended well; a line that
    quotes a report's keys inside its text changes nothing."""
    from moe_dist.distributed.roll_call import name_ranks, named_nodes
    from moe_dist.exits import write_report

    hosts = ["node0", "node0", "node1", "node1", "node2", "node2"]
    assert named_nodes(name_ranks(hosts, [1, 2, 3])) == ["node1"]
    assert named_nodes(name_ranks(hosts, [2, 3, 4, 5])) == ["node1", "node2"]
    assert named_nodes("this node (node1) is cut off from the others, or node0 is lost") == []
    reports = {
        0: (1, "moe-dist train: rank 0: no heartbeat from node node2 (ranks 4, 5) for 8 s (parallel.heartbeat_timeout_s)"),
        1: (1, "moe-dist train: rank 1: the collective all_reduce failed: another rank went away; lost node node1 "
               "(ranks 2, 3): none of its ranks answered a roll call within 10 s"),
        3: (1, "moe-dist train: rank 3: ...: this node (node1) is cut off from the others, or node0 is lost"),
        5: (0, "lost node node5 (rank 9)"),  # ended well: names nothing
        10: (1, 'a line that quotes "code": 2, "lost": "node7" and a \\ backslash'),
    }
    for rank, (code, line) in reports.items():
        write_report(str(tmp_path), rank, {"rank": rank, "code": code, "kind": "lost_peer", "line": line})
    (tmp_path / "rank_11.json.tmp").write_text("not a report")
    assert _read_reports(tmp_path, 1) == ("1", "node2 node1", "5")
    # the job's exit status: the launcher's, 2 when a rank had bad input, 75 when the ranks that reported
    # were preempted (or done)
    for codes, launcher_rc, expected in [([0, 75, 75], 1, "75"), ([75, 1], 1, "1"), ([0, 2, 1], 1, "2"),
                                         ([0, 0], 0, "0"), ([], 137, "137"), ([1, 1], 3, "3")]:
        d = tmp_path / f"case{len(codes)}-{launcher_rc}-{expected}"
        d.mkdir()
        for rank, code in enumerate(codes):
            write_report(str(d), rank, {"rank": rank, "code": code, "kind": "x", "line": ""})
        assert _read_reports(d, launcher_rc) == (expected, "", str(len(codes))), (codes, launcher_rc)


_ROLL_CALL = """
import datetime, sys, time
import torch.distributed as dist
from moe_dist.distributed import roll_call
rank, port, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) if rank == 0 else None
roll_call._hosts, roll_call._store_at, roll_call._rank = ["a", "a", "b"], ("127.0.0.1", port), rank
time.sleep(delay)  # rank 1's collective fails later than rank 0's
print(roll_call.lost_nodes_line(2.0), flush=True)
"""


def test_a_rank_that_fails_later_still_finds_the_store_of_rank_0():
    """Under srun rank 0's process holds the job's store: its roll call ends after 2 s (rank 2, on host b,
    never answers), but it keeps the store until rank 1, on its own host, has finished a roll call that
    starts 3 s later; rank 1 names node b too instead of calling its own node cut off."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _ROLL_CALL, str(r), str(port), str(d)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, d in ((0, 0.0), (1, 3.0))]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lost = "lost node b (rank 2): none of its ranks answered a roll call within 2 s\n"
    assert [o for o, _ in outs] == [lost, lost], outs
