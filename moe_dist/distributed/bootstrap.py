"""Start torch.distributed from whatever launched us: torchrun, Slurm's srun, or mpirun.

    rt = init_distributed(ep=2, num_experts=8)   # every rank calls it
    rt.groups, rt.device, rt.dp_mesh, rt.mesh     # ParallelGroups, torch.device, FSDP2 mesh, named mesh

Rank, world size, local rank and rendezvous address are read from the environment in
this order: torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), a Slurm job step
(``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``/``SLURM_LOCALID``, master =
first host of the node list), Open MPI (``OMPI_COMM_WORLD_*``), PMIx (``PMIX_RANK``), MPICH /
Hydra (``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``), MVAPICH (``MV2_COMM_WORLD_*``).
``MOE_DIST_MPI4PY=1`` asks mpi4py instead of the MPI variables (after torchrun and Slurm);
then rank 0's host and a free port are broadcast over MPI. Nothing found means one process.
``MASTER_ADDR`` / ``MASTER_PORT`` always win when set.
"""
from __future__ import annotations

import datetime
import gc
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import heartbeat
from .groups import ParallelGroups, build_parallel_groups, set_group_timeout
from .interfaces import SocketInterface, pick_socket_interface
from .roll_call import hosts, remember_hosts
from .topology import node_of_ranks
from ..checks import check_choice
from ..errors import ConfigError, UserError
from ..hardware import default_allocator_settings

DEFAULT_PORT = 29517


@dataclass
class LaunchInfo:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = "single"  # torchrun | local | slurm | openmpi | pmix | mpich | mvapich | mpi4py | single | external

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UserError(f"{self.launcher}: rank {self.rank} is outside a world of size {self.world_size}")


def first_host(nodelist: str) -> str:
    """First host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    nodelist = nodelist.strip()
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = nodelist[:end]
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], entry)
    if not host or "[" in host or "]" in host:
        raise UserError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return host


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        if env.get(name, "").strip():
            try:
                return int(env[name])
            except ValueError:
                raise UserError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def _tasks_on_first_node(spec: str) -> Optional[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` looks like ``2(x3),1``; the first count."""
    m = re.match(r"\s*(\d+)", spec or "")
    return int(m.group(1)) if m else None


def _port(env: Mapping[str, str], fallback: int) -> int:
    return _int(env, "MASTER_PORT") or fallback


def _from_mpi_env(env: Mapping[str, str]) -> Optional[LaunchInfo]:
    flavours = (
        ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
         ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
        ("pmix", ("PMIX_RANK",), ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"), ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
         ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")),
        ("mpich", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
        ("mvapich", ("MV2_COMM_WORLD_RANK",), ("MV2_COMM_WORLD_SIZE",), ("MV2_COMM_WORLD_LOCAL_RANK",),
         ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    )
    for name, rank_v, size_v, lrank_v, lsize_v in flavours:
        rank = _int(env, *rank_v)
        if rank is None:
            continue
        size = _int(env, *size_v)
        if size is None:
            raise UserError(f"{name} launch: {rank_v[0]} is set but not the world size ({' / '.join(size_v)})")
        local_size = _int(env, *lsize_v)
        return LaunchInfo(rank=rank, world_size=size, local_rank=_int(env, *lrank_v) or 0,
                          local_world_size=local_size or size, master_addr=env.get("MASTER_ADDR", ""),
                          master_port=_port(env, DEFAULT_PORT), launcher=name)
    return None


def _mpi4py_info() -> tuple[int, int, int, int]:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError("MOE_DIST_MPI4PY=1 needs mpi4py with an MPI runtime: pip install mpi4py mpich") from e
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    return comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size()


def _mpi4py_rendezvous(info: LaunchInfo) -> None:
    """Rank 0 publishes its host name and a free port over MPI (when MASTER_ADDR is unset)."""
    from mpi4py import MPI

    payload = None
    if info.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            payload = (socket.gethostname(), s.getsockname()[1])
    info.master_addr, info.master_port = MPI.COMM_WORLD.bcast(payload, root=0)


def detect_launch(environ: Optional[Mapping[str, str]] = None, use_mpi4py: Optional[bool] = None) -> LaunchInfo:
    """Read this process's place in the job from the launcher's environment."""
    env = os.environ if environ is None else environ
    if use_mpi4py is None:
        use_mpi4py = env.get("MOE_DIST_MPI4PY", "0") not in ("", "0", "false")

    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:  # torchrun or a hand-set env
        size = _int(env, "WORLD_SIZE")
        return LaunchInfo(rank=_int(env, "RANK"), world_size=size, local_rank=_int(env, "LOCAL_RANK") or 0,
                          local_world_size=_int(env, "LOCAL_WORLD_SIZE") or size,
                          master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_port(env, DEFAULT_PORT),
                          launcher=env.get("MOE_DIST_LAUNCHER", "torchrun"))  # "local": moe-dist --nproc

    # a Slurm job *step* (srun); a batch script alone also has SLURM_PROCID=0 but is one process
    in_step = any(env.get(v) for v in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_TASKS"))
    if _int(env, "SLURM_PROCID") is not None and in_step:
        size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        if size is None:
            raise UserError("Slurm launch: SLURM_PROCID is set but not SLURM_STEP_NUM_TASKS / SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = env.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
        job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0
        local_size = (_tasks_on_first_node(env.get("SLURM_STEP_TASKS_PER_NODE", "")) or
                      _tasks_on_first_node(env.get("SLURM_TASKS_PER_NODE", "")) or size)
        return LaunchInfo(rank=_int(env, "SLURM_PROCID"), world_size=size, local_rank=_int(env, "SLURM_LOCALID") or 0,
                          local_world_size=local_size, master_addr=addr,
                          master_port=_port(env, 15000 + job % 20000), launcher="slurm")

    if use_mpi4py:  # asked for explicitly: MPI itself says who we are and carries the rendezvous
        rank, size, lrank, lsize = _mpi4py_info()
        info = LaunchInfo(rank=rank, world_size=size, local_rank=lrank, local_world_size=lsize,
                          master_addr=env.get("MASTER_ADDR", ""), master_port=_port(env, DEFAULT_PORT), launcher="mpi4py")
        if not info.master_addr and size > 1:
            _mpi4py_rendezvous(info)
        return info
    info = _from_mpi_env(env)
    if info is not None:
        if not info.master_addr:
            if info.world_size == info.local_world_size:  # one node: no need to ask anyone
                info.master_addr = "127.0.0.1"
            else:
                raise UserError(f"{info.launcher} launch over several nodes: set MASTER_ADDR (and MASTER_PORT) to the "
                                 "host of rank 0, or set MOE_DIST_MPI4PY=1 to exchange it with mpi4py")
        return info
    return LaunchInfo()


def device_type(kind: str) -> str:
    """``"cuda"`` or ``"cpu"``: what ``run.device`` (``auto``: CUDA when present) gives on this machine."""
    check_choice("run.device", kind, ("auto", "cpu", "cuda"))
    return "cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu"


def pick_device(kind: str, local_rank: int) -> torch.device:
    """``auto``: this rank's CUDA device when CUDA is present, else the CPU."""
    if device_type(kind) == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device='cuda' but torch sees no CUDA device; allowed here: 'cpu' or 'auto'")
        default_allocator_settings()  # before anything is allocated on the device
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)  # before the process group: NCCL binds this rank to its own GPU
        return dev
    return torch.device("cpu")


def pick_backend(kind: str, device: torch.device) -> str:
    check_choice("parallel.backend", kind, ("auto", "gloo", "nccl"))
    if kind == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if kind == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend='nccl' needs CUDA devices; allowed on CPU: 'gloo' (or 'auto')")
    return kind


@dataclass
class Runtime:
    """The distributed state of one process."""

    launch: LaunchInfo
    device: torch.device
    backend: Optional[str]
    groups: ParallelGroups = field(default_factory=ParallelGroups.single)
    dp_mesh: Optional[object] = None  # 1-D DeviceMesh ("dp",) over every rank: FSDP2 for dense weights
    mesh: Optional[object] = None  # 2-D DeviceMesh ("edp", "ep"): the expert layout, by name
    edp_mesh: Optional[object] = None  # mesh["edp"]: FSDP2's mesh for the experts (sliced with the mesh)
    owns_process_group: bool = False
    socket_interface: Optional[SocketInterface] = None  # this host's, on a job over several hosts

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    @property
    def distributed(self) -> bool:
        return self.launch.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _meshes(groups: ParallelGroups, device: torch.device, world: int):
    """Name the existing groups as device meshes (no new communicators)."""
    from torch.distributed.device_mesh import DeviceMesh

    with torch.device("cpu"):  # a mesh's rank table is host data, whatever the default device
        dp_mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("dp",))
        layout = torch.arange(world).view(world // groups.ep_size, groups.ep_size)
        mesh = DeviceMesh.from_group([groups.edp, groups.ep], device.type, mesh=layout, mesh_dim_names=("edp", "ep"))
        # sliced here, once: slicing reads the rank table with tensor ops, which under fake tensors
        # (moe-dist plan --dry-run) would have no values
        edp_mesh = mesh["edp"]
    return dp_mesh, mesh, edp_mesh


def init_distributed(ep: Union[int, Callable[[list[str]], int]] = 1, num_experts: Optional[int] = None, *,
                     backend: str = "auto", device: str = "auto", timeout_s: float = 600,
                     ranks_per_node: Optional[int] = None, dispatch: str = "flat",
                     environ: Optional[Mapping[str, str]] = None, heartbeat_timeout_s: float = 0,
                     on_lost_peer: Optional[Callable[[str], None]] = None) -> Runtime:
    """Initialise the default process group (unless one exists) and build the parallel groups.

    Expert-parallel size ``ep`` must divide the world size and ``num_experts``. It may be given as
    a function of every rank's host name (in rank order) that returns it: called on every rank
    with the same list once the process group exists, before the groups are made.
    ``ranks_per_node``: nodes are blocks of this many consecutive ranks (None: the ranks' host names;
    :mod:`~moe_dist.distributed.topology`). ``dispatch``: ``parallel.dispatch``, carried by the groups.
    ``heartbeat_timeout_s``: each rank's heartbeat (:mod:`~moe_dist.distributed.heartbeat`) when this
    function makes the process group over several ranks (0: none); ``on_lost_peer(line)`` ends the
    rank when it finds a peer silent.
    """
    if dist.is_available() and dist.is_initialized():  # started by someone else (tests, a notebook)
        world, rank = dist.get_world_size(), dist.get_rank()
        env = os.environ if environ is None else environ
        local_rank = _int(env, "LOCAL_RANK")
        launch = LaunchInfo(rank=rank, world_size=world, local_rank=rank if local_rank is None else local_rank,
                            local_world_size=_int(env, "LOCAL_WORLD_SIZE") or world, launcher="external")
        dev = pick_device(device, launch.local_rank)
        be, owns, iface = dist.get_backend(), False, None
    else:
        launch = detect_launch(environ)
        dev = pick_device(device, launch.local_rank)
        be, owns, iface = None, False, None
        set_group_timeout(timeout_s)  # every group of this job, not only the default one
        if launch.world_size > 1:
            be = pick_backend(backend, dev)
            iface = pick_socket_interface(launch)  # GLOO_/NCCL_SOCKET_IFNAME on a job over several hosts
            dist.init_process_group(be, init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                                    rank=launch.rank, world_size=launch.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
            owns = True
    try:
        groups, dp_mesh, mesh, edp_mesh = _layout(launch, dev, ep, num_experts, ranks_per_node, dispatch, owns)
        if owns:
            heartbeat.start(heartbeat_timeout_s, on_lost_peer)
    except BaseException:
        # a layout refused (parallel.ep against the world size, found only once every host is known):
        # the group made here goes now, not in interpreter teardown (after the one-line error)
        if owns and dist.is_initialized():
            _destroy_groups()
        raise
    return Runtime(launch=launch, device=dev, backend=be, groups=groups, dp_mesh=dp_mesh, mesh=mesh, edp_mesh=edp_mesh,
                   owns_process_group=owns,
                   socket_interface=iface)


def _layout(launch: LaunchInfo, dev: torch.device, ep, num_experts: Optional[int], ranks_per_node: Optional[int],
            dispatch: str, owns: bool):
    """The parallel groups and device meshes of the job, once its process group exists."""
    if launch.world_size > 1:
        # every rank's host name: to name a lost node after a failed collective (through the store the
        # group was made with), and for an ep chosen by where the ranks run
        remember_hosts(*((launch.master_addr, launch.master_port) if owns else (None, None)))
        node_of = node_of_ranks(hosts(), ranks_per_node)
        if callable(ep):  # by host name, or by the declared nodes
            ep = ep(hosts() if ranks_per_node is None else [f"node{n}" for n in node_of])
        if launch.world_size % ep:
            raise ConfigError(f"parallel.ep={ep} must divide the world size {launch.world_size}")
        groups = build_parallel_groups(ep, num_experts, node_of, dispatch)
        return (groups, *_meshes(groups, dev, launch.world_size))
    if callable(ep):
        ep = ep([socket.gethostname()])
    return build_parallel_groups(ep, num_experts, dispatch=dispatch), None, None, None  # raises for ep > 1 on one process


def shutdown(rt: Runtime) -> None:
    """Destroy the process group if :func:`init_distributed` created it.

    On a normal exit every rank first meets the others, so no rank tears its connections
    down while a peer still uses them (a gloo rank that went ahead while rank 0 was still
    writing its report was seen to abort in teardown). While an exception is propagating
    there is no meeting: the peers may never arrive, and the launcher stops them anyway.

    The runtime's device meshes are dropped first (a DeviceMesh keeps its process groups alive),
    then :func:`_destroy_groups`.
    """
    if not (rt.owns_process_group and dist.is_initialized()):
        return
    normal = sys.exc_info()[0] is None
    if normal and dist.get_world_size() > 1:
        dist.barrier()
    heartbeat.stop(wait_for_all=normal)
    rt.dp_mesh = rt.mesh = rt.edp_mesh = None
    _destroy_groups()


def _destroy_groups() -> None:
    """Destroy every process group now and collect what still referred to them: a gloo group first
    destroyed during interpreter teardown can abort the process ("terminate called without an
    active exception"), as a device mesh kept to the end, or a launch refused before its layout was
    built, used to show."""
    dist.destroy_process_group()
    gc.collect()
