"""The run-directory locks (moe_dist/train/setup/run_lock.py) on real flock files: one run per directory,
readers (`moe-dist eval`) beside a run that trains, and no run starting or pruning under a reader.
End to end with real processes: tests/test_reliability.py."""
import os
import shutil
import subprocess

import pytest

from moe_dist.train.setup.run_lock import RunDirLock, RunDirReadLock, readers_excluded


def test_a_starting_run_keeps_readers_out_until_it_admits_them(tmp_path):
    run = RunDirLock(str(tmp_path))
    assert run.acquire() is None
    try:
        refusal = RunDirReadLock(str(tmp_path)).acquire(wait_s=0.2)
        assert refusal.startswith(f"run.dir={str(tmp_path)!r}: the run there (pid {os.getpid()} on host ")
        assert refusal.endswith("is starting, resuming or removing old checkpoints (waited 0.2 s for it); try again "
                                "in a moment")
        run.admit_readers()
        readers = [RunDirReadLock(str(tmp_path)), RunDirReadLock(str(tmp_path))]
        assert [r.acquire(wait_s=0) for r in readers] == [None, None]  # readers share the directory with the run
        with readers_excluded(str(tmp_path)) as alone:
            assert not alone  # the run deletes nothing now
        for r in readers:
            r.release()
        with readers_excluded(str(tmp_path)) as alone:
            assert alone
            assert RunDirReadLock(str(tmp_path)).acquire(wait_s=0) is not None  # none comes in while it prunes
    finally:
        run.release()


def test_no_run_starts_while_a_reader_reads(tmp_path):
    reader = RunDirReadLock(str(tmp_path))
    assert reader.acquire(wait_s=0) is None
    refusal = RunDirLock(str(tmp_path)).acquire()
    assert refusal.startswith(f"run.dir={str(tmp_path)!r} is being read by `moe-dist eval` (pid {os.getpid()} on host ")
    assert refusal.endswith("a run would move or delete what it reads: start once it ends, or choose another run.dir")
    assert "\n" not in refusal
    reader.release()
    run = RunDirLock(str(tmp_path))
    assert run.acquire() is None  # and the refused attempt left no lock behind
    run.release()


def test_a_second_run_is_refused_and_the_first_keeps_its_locks(tmp_path):
    first = RunDirLock(str(tmp_path))
    assert first.acquire() is None
    second = RunDirLock(str(tmp_path)).acquire()
    assert second.startswith(f"run.dir={str(tmp_path)!r} is in use by a live run (pid {os.getpid()} on host ")
    assert RunDirReadLock(str(tmp_path)).acquire(wait_s=0) is not None  # the first still holds read.lock
    first.release()


def test_a_directory_the_reader_cannot_write_is_read_without_a_lock(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        os.chmod(ro, 0o555)
    elif shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                                         capture_output=True).returncode != 0:
        pytest.skip("cannot make a read-only directory here")
    try:
        reader = RunDirReadLock(str(ro))
        assert reader.acquire(wait_s=0) is None  # no read.lock can exist there, so no run uses it either
        reader.release()
        assert not os.path.exists(ro / "read.lock")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], capture_output=True)
        else:
            os.chmod(ro, 0o755)
