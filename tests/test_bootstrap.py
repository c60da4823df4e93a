"""Distributed bootstrap: launcher environments, host lists, devices, and real rendezvous from
Slurm-style and Open MPI-style environments in separate processes, and a real mpirun when the
mpi extra is installed."""
import json
import os
import re
import sys

import pytest
import torch
import torch.multiprocessing as mp

from helpers.dist_harness import free_port
from moe_dist.distributed.bootstrap import LaunchInfo, detect_launch, first_host, init_distributed, pick_backend, pick_device


@pytest.mark.parametrize("nodelist,host", [
    ("vm", "vm"),
    ("node[07-09,12],gpu1", "node07"),
    ("node[001-004]", "node001"),
    ("gpu5,node[1-2]", "gpu5"),
    ("rack[2-3]-n[10-11]", "rack2-n10"),
    ("a[5,7]", "a5"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_torchrun_env():
    info = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                          "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "SLURM_PROCID": "0"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 1234)


def test_slurm_step_env():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "cn[003-006]", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 8, 1, 2)
    assert info.master_addr == "cn003" and info.master_port == 15000 + 4242
    info = detect_launch({**env, "MASTER_ADDR": "head", "MASTER_PORT": "999"})
    assert (info.master_addr, info.master_port) == ("head", 999)


def test_slurm_batch_script_alone_is_one_process():
    # inside sbatch but outside srun: SLURM_PROCID=0 and SLURM_NTASKS=N, but only one process runs
    info = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"})
    assert (info.launcher, info.world_size) == ("single", 1)


@pytest.mark.parametrize("env,launcher", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "openmpi"),
    ({"PMIX_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "pmix"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "mpich"),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"}, "mvapich"),
])
def test_mpi_envs(env, launcher):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == (launcher, 1, 2, 1)
    assert info.master_addr == "127.0.0.1"  # one node: no exchange needed


def test_launcher_errors():
    with pytest.raises(ValueError, match="PMI_RANK is set but not the world size"):
        detect_launch({"PMI_RANK": "0"})
    with pytest.raises(ValueError, match="SLURM_PROCID is set but not SLURM_STEP_NUM_TASKS / SLURM_NTASKS"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_STEP_ID": "1"})
    with pytest.raises(ValueError, match="several nodes: set MASTER_ADDR"):
        detect_launch({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="rank 4 is outside a world of size 4"):
        detect_launch({"RANK": "4", "WORLD_SIZE": "4"})
    assert detect_launch({}) == LaunchInfo()


def test_device_and_backend_choice():
    assert pick_device("cpu", 0).type == "cpu"
    assert pick_backend("auto", torch.device("cpu")) == "gloo"
    if not torch.cuda.is_available():
        assert pick_device("auto", 0).type == "cpu"
        with pytest.raises(ValueError, match="run.device='cuda' but torch sees no CUDA device"):
            pick_device("cuda", 0)
        with pytest.raises(ValueError, match="parallel.backend='nccl' needs CUDA"):
            pick_backend("nccl", torch.device("cpu"))
    with pytest.raises(ValueError, match="run.device='tpu' is not allowed"):
        pick_device("tpu", 0)


def test_single_process_rejects_expert_parallel():
    with pytest.raises(ValueError, match=r"parallel.ep=2 needs torch.distributed"):
        init_distributed(ep=2, num_experts=8, environ={})
    rt = init_distributed(ep=1, num_experts=8, environ={})
    assert (rt.world_size, rt.groups.ep_size, rt.backend, rt.is_main) == (1, 1, None, True)


def _launched(rank: int, env: dict, out: str, ep: int):
    """A process started 'by a launcher': only environment variables say who it is."""
    os.environ.update({k: v.replace("{rank}", str(rank)) for k, v in env.items()})
    torch.set_num_threads(1)
    import torch.distributed as dist

    result = {}
    try:
        rt = init_distributed(ep=ep, num_experts=4, timeout_s=60)
        t = torch.tensor([float(rt.rank + 1)])
        dist.all_reduce(t)
        e = torch.tensor([float(rt.rank)])
        dist.all_reduce(e, group=rt.groups.ep)
        result = {"launcher": rt.launch.launcher, "rank": rt.rank, "world": rt.world_size, "sum": t.item(),
                  "ep_sum": e.item(), "ep_rank": rt.groups.ep_rank, "dims": list(rt.mesh.mesh_dim_names),
                  "mesh_shape": list(rt.mesh.mesh.shape), "dp_dims": list(rt.dp_mesh.mesh_dim_names),
                  "backend": rt.backend}
        try:  # the expert-parallel size must divide the world size: every rank fails the same way
            init_distributed(ep=3, num_experts=6)
        except ValueError as err:
            result["ep_error"] = str(err)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result = {"error": repr(err)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def test_real_rendezvous_from_launcher_env(tmp_path):
    """Two 2-rank jobs at once, one described by Slurm variables, one by Open MPI's."""
    jobs = {
        "slurm": {"SLURM_PROCID": "{rank}", "SLURM_LOCALID": "{rank}", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                  "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "1", "MASTER_PORT": str(free_port())},
        "openmpi": {"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "{rank}",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": str(free_port())},
    }
    ctx = mp.get_context("spawn")
    procs = []
    for name, env in jobs.items():
        (tmp_path / name).mkdir()
        procs += [ctx.Process(target=_launched, args=(r, env, str(tmp_path / name), 2)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
    for name in jobs:
        for rank in range(2):
            with open(tmp_path / name / f"rank{rank}.json") as f:
                res = json.load(f)
            assert "error" not in res, res
            assert (res["launcher"], res["rank"], res["world"], res["backend"]) == (name, rank, 2, "gloo")
            assert res["sum"] == 3.0 and res["ep_sum"] == 1.0 and res["ep_rank"] == rank
            assert res["dims"] == ["edp", "ep"] and res["mesh_shape"] == [1, 2] and res["dp_dims"] == ["dp"]
            assert "parallel.ep=3 must divide the world size 2" in res["ep_error"]


MPI_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from moe_dist.distributed.bootstrap import init_distributed, shutdown
rt = init_distributed(ep=2, num_experts=4, timeout_s=60)
t = torch.tensor([float(rt.rank + 1)])
dist.all_reduce(t)
print(json.dumps({"launcher": rt.launch.launcher, "rank": rt.rank, "world": rt.world_size, "sum": t.item(),
                  "addr": rt.launch.master_addr}), flush=True)
shutdown(rt)
"""


def _mpirun():
    path = os.path.join(os.path.dirname(sys.executable), "mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_mpirun() is None, reason="needs the mpi extra (pip install mpi4py mpich)")
def test_real_mpirun(tmp_path):
    """MPICH's mpirun: ranks from PMI variables, then the same through mpi4py (MOE_DIST_MPI4PY=1)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    for flag, launcher in (("0", "mpich"), ("1", "mpi4py")):
        res = subprocess.run([_mpirun(), "-n", "2", sys.executable, "-c", MPI_SCRIPT], capture_output=True, text=True,
                             timeout=180, env={**env, "MOE_DIST_MPI4PY": flag, "MASTER_PORT": str(free_port())})
        assert res.returncode == 0, res.stdout + res.stderr
        # mpirun forwards both ranks' output through one pipe: lines may run together
        rows = sorted((json.loads(m) for m in re.findall(r"\{[^{}]*\}", res.stdout)), key=lambda r: r["rank"])
        assert [(r["launcher"], r["rank"], r["world"], r["sum"]) for r in rows] == [(launcher, 0, 2, 3.0), (launcher, 1, 2, 3.0)]
