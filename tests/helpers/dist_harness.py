"""Run a function on R real gloo processes and collect what each rank returns.

    results = run_ranks(fn, world_size=2, args=(...,))   # list, one entry per rank

``fn(rank, world_size, *args)`` runs inside an initialised gloo process group; its
return value (tensors, dicts, lists) is saved with torch.save and loaded back with
weights_only=True. A rank that raises makes the whole call raise with its traceback; a
rank that hangs is killed after ``timeout`` seconds (collective timeout too).
"""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_dist.ports import free_port  # noqa: F401 - tests take it from here


def _worker(rank, world_size, out_dir, fn, args, timeout, environ):
    os.environ.clear()  # the caller's environment now, not the one the fork server started with
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        # a file rendezvous cannot race for a port with other tests starting at the same time
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # every rank has finished connecting before any may leave: a rank whose fn returns at once
        # (a refused setting) would otherwise close its sockets while a slower rank still connects
        dist.barrier()
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CTX = None


def _context():
    """Rank processes forked from one server process that has imported torch and the project once
    (``forkserver``): a fresh interpreter per rank (``spawn``) spends seconds importing them again for
    every call. The server holds no threads and no process group, so each fork starts clean; it
    receives the caller's environment (``_worker``). ``MOE_DIST_TEST_START_METHOD=spawn``: a fresh
    interpreter per rank."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context(os.environ.get("MOE_DIST_TEST_START_METHOD", "forkserver"))
        if _CTX.get_start_method() == "forkserver":
            _CTX.set_forkserver_preload(["torch", "torch.distributed", "moe_dist.train.loop.trainer", "helpers.dist_harness"])
    return _CTX


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0):
    timeout = float(os.environ.get("MOE_DIST_TEST_TIMEOUT", timeout))
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = _context()
        procs = [ctx.Process(target=_worker, args=(r, world_size, out_dir, fn, args, timeout, dict(os.environ))) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout + 60)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed after {timeout}s?)")
                continue
            rec = torch.load(path, weights_only=True)
            if rec["ok"]:
                results.append(rec["result"])
            else:
                errors.append(f"rank {r}:\n{rec['error']}")
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
