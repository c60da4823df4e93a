"""A real Slurm cluster for tests: munged, slurmctld and one slurmd per node, configured in a directory.

Test infrastructure, not part of the installed package: used by ``tests/test_launch_slurm.py`` and
``tests/test_multinode_slurm.py``; never imported by the trainer or the launchers.

    with SlurmCluster(root) as s:                       # this machine as its only node (127.0.0.1)
        job = s.submit(["-n", "2"], "launch/slurm/train.sbatch", ["configs/test.yaml"], env, cwd=REPO)
        s.wait(job, lambda info: info["JobState"] == "COMPLETED", 300, "COMPLETED")

    with Cluster(2) as c, SlurmCluster(root, on=c) as s:  # the nodes of a namespace cluster
        ...                                              # slurmctld and munged on node0, a slurmd on each

Needs root (the daemons run as root; munged as the ``munge`` user) and Debian's ``slurm-wlm`` and
``munge`` (:func:`install_slurm` installs them with apt-get when missing). Everything lives under
``root``: the configuration (``slurm.conf``, ``SLURM_CONF`` for every command), munge's socket, key
and seed, the controller's state, each node's spool directory, pid and log file (``%n`` in the
configuration: the node's name), so several clusters never share anything but the binaries.

On a namespace cluster (``on=``, :class:`helpers.cluster.Cluster`) every daemon and every
command runs through the cluster (its node's network namespace, hosts file and host name):
``NodeName`` is the node's host name and ``NodeAddr`` its address, the first node is the head node
(slurmctld, munged and the client commands ``sbatch``, ``squeue``, ``scontrol``, since the root
namespace has no route to the nodes), and each node's ``slurmd -N NAME`` runs on its node. munged's
socket is a file, which the other nodes' commands reach through the shared file system, as if the
key were copied to every node. Without ``on``, this machine is the only node, at 127.0.0.1.

:meth:`SlurmCluster.stop` cancels the jobs, waits for them and stops the daemons it started, by
their pid files (also after a failed start).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from moe_dist.ports import free_port

if TYPE_CHECKING:
    from .cluster import Cluster

NEEDS = ("slurmctld", "slurmd", "sbatch", "munged")
ENDED = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def install_slurm() -> str:
    """'' when slurmctld, slurmd, sbatch and munged are there (installing Debian's slurm-wlm and munge
    with apt-get if needed), else the reason they are not."""
    if all(shutil.which(t) for t in NEEDS):
        return ""
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(t for t in NEEDS if not shutil.which(t))} missing) and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-qq"],
             ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"])
    for cmd in steps:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            return f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-400:]}"
    missing = [t for t in NEEDS if not shutil.which(t)]
    return f"still missing after apt-get install: {missing}" if missing else ""


@dataclass
class SlurmNode:
    name: str  # NodeName, and the host name its slurmd runs under
    addr: str  # NodeAddr


class SlurmCluster:
    """munged + slurmctld on the head node (the first) + one slurmd per node, configured under ``root``."""

    def __init__(self, root: str, on: Optional["Cluster"] = None, slurmd_timeout: int = 300, kill_wait: int = 30):
        self.root = root
        self.cluster = on
        self.slurmd_timeout = slurmd_timeout  # seconds without an answer before slurmctld sets a node DOWN
        self.kill_wait = kill_wait  # seconds between SIGTERM and SIGKILL when Slurm ends a job's processes
        self.conf = os.path.join(root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.munge_dir = os.path.join(root, "munge")
        if on is None:
            self.nodes = [SlurmNode(_local_node_name(), "127.0.0.1")]
        else:
            self.nodes = [SlurmNode(nd.hostname, nd.address) for nd in on.nodes]
        self.head = self.nodes[0].name

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- where things run ----
    def command(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs on ``node`` (through the namespace cluster, if any)."""
        return list(argv) if self.cluster is None else self.cluster.command(node, argv)

    def slurmd_pid_file(self, node: str) -> str:
        return os.path.join(self.root, f"slurmd-{node}.pid")

    def pid_files(self) -> list[str]:
        """Every daemon's pid file, in stop order: slurmds, slurmctld, munged."""
        return ([self.slurmd_pid_file(nd.name) for nd in self.nodes] + [os.path.join(self.root, "slurmctld.pid"),
                os.path.join(self.munge_dir, "munged.pid")])

    # ---- life cycle ----
    def _write_conf(self) -> None:
        probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        cpus = re.search(r"CPUs=(\d+)", probe).group(1)
        mem = int(re.search(r"RealMemory=(\d+)", probe).group(1)) * 8 // 10
        head = self.nodes[0]
        r = self.root
        nodes = "".join(f"NodeName={nd.name} NodeAddr={nd.addr} CPUs={cpus} RealMemory={mem} State=UNKNOWN\n"
                        for nd in self.nodes)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=moetest
SlurmctldHost={head.name}({head.addr})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_dir}/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
KillWait={self.kill_wait}
SchedulerParameters=sched_interval=2
{nodes}PartitionName=debug Nodes={','.join(nd.name for nd in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        for d in ("state", "log", *(os.path.join("spool", nd.name) for nd in self.nodes)):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.makedirs(self.munge_dir, exist_ok=True)
        shutil.chown(self.munge_dir, "munge", "munge")
        os.chmod(self.munge_dir, 0o755)  # munged wants a socket directory everyone may enter
        self._write_conf()
        m = self.munge_dir
        key = os.path.join(m, "munge.key")  # this cluster's own key (the machine's may not exist)
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        os.chmod(key, 0o400)
        self._daemon(self.head, ["runuser", "-u", "munge", "--", "munged", f"--key-file={key}",
                                 f"--socket={m}/munge.socket", f"--pid-file={m}/munged.pid",
                                 f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        self._daemon(self.head, ["slurmctld", "-f", self.conf])
        for nd in self.nodes:
            self.start_slurmd(nd.name)
        self.wait_idle(len(self.nodes), 90)

    def start_slurmd(self, node: str) -> None:
        """(Re)start ``node``'s slurmd (as a machine that rebooted does)."""
        argv = ["slurmd", "-f", self.conf]
        if self.cluster is not None:
            # `ip netns exec` mounts a sysfs of the namespace over /sys, which hides the machine's cgroup
            # file systems; slurmd refuses to start without them
            argv = ["sh", "-c", _cgroup_mounts() + 'exec "$@"', "slurmd", *argv, "-N", node]
        self._daemon(node, argv)

    def _daemon(self, node: str, argv: list[str]) -> None:
        """Start a daemon that forks into the background on ``node``."""
        r = subprocess.run(self.command(node, argv), env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode:
            raise RuntimeError(f"`{' '.join(argv)}` on {node} failed ({r.returncode}): {r.stderr.strip()}\n{self.logs()}")

    def wait_idle(self, count: int, timeout: float) -> None:
        """Wait until ``count`` nodes are idle."""
        deadline, states = time.time() + timeout, ""
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
            if sum(1 for line in states.splitlines() if line.split()[1:2] == ["idle"]) >= count:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{count} Slurm node(s) did not become idle within {timeout:.0f} s: {states!r}\n{self.logs()}")

    def cancel_all(self, timeout: float = 60) -> None:
        """Cancel every job and wait (up to ``timeout`` s) until none is left."""
        self.run("scancel", "--user", "root", check=False)
        deadline = time.time() + timeout
        while time.time() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(1)

    def stop(self) -> None:
        """Cancel the jobs, wait for them to end, then stop the daemons started here (by pid)."""
        if os.path.exists(os.path.join(self.root, "slurmctld.pid")):
            self.cancel_all()
        for path in self.pid_files():
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            for _ in range(50):  # up to 5 s for a clean exit
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    # ---- commands ----
    def run(self, *cmd: str, check: bool = True, node: Optional[str] = None) -> subprocess.CompletedProcess:
        """A client command (``squeue``, ``scontrol`` ...) on ``node`` (default: the head node)."""
        return subprocess.run(self.command(node or self.head, cmd), env=self.env, capture_output=True, text=True,
                              check=check, timeout=60)

    def logs(self, lines: int = 30) -> str:
        """The last lines of every daemon's log."""
        out = []
        where = os.path.join(self.root, "log")
        for name in sorted(os.listdir(where)) if os.path.isdir(where) else []:
            with open(os.path.join(where, name), errors="replace") as f:
                out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)

    def submit(self, sbatch_args: Sequence[str], script: str, script_args: Sequence[str], env: Mapping[str, str],
               cwd: str) -> str:
        """``sbatch`` on the head node; the job id."""
        r = subprocess.run(self.command(self.head, ["sbatch", "--parsable", *sbatch_args, script, *script_args]),
                           env={**self.env, **env}, capture_output=True, text=True, cwd=cwd, timeout=60)
        if r.returncode:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: str, done: Callable[[dict], bool], timeout: float, what: str, out_file: str = "") -> dict:
        """Poll the job until ``done(info)``; AssertionError with its state, output and the logs when it
        ends otherwise or ``timeout`` passes."""
        deadline, info = time.time() + timeout, {}
        while time.time() < deadline:
            info = self.job(job_id)
            if done(info):
                return info
            if info.get("JobState") in ENDED:
                break
            time.sleep(0.5)
        out_file = out_file.replace("%j", job_id)
        output = ""
        if out_file and os.path.exists(out_file):
            with open(out_file, errors="replace") as f:
                output = f.read()[-4000:]
        raise AssertionError(f"job {job_id}: waiting for {what}; last state {info.get('JobState')} "
                             f"(reason {info.get('Reason')}, exit {info.get('ExitCode')})\n--- job output\n{output}\n"
                             f"{self.logs()}")


def _cgroup_mounts() -> str:
    """Shell commands that mount the machine's cgroup file systems again under /sys/fs/cgroup, as
    they are mounted here (a tmpfs with one directory per hierarchy, or one cgroup2)."""
    cmds = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, where, kind, options = line.split()[:4]
            if where == "/sys/fs/cgroup" or where.startswith("/sys/fs/cgroup/"):
                if kind in ("tmpfs", "cgroup", "cgroup2"):
                    cmds.append(f"mkdir -p {where} && mount -t {kind} -o {options} {kind} {where} && ")
    return "".join(cmds)


def _local_node_name() -> str:
    probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return re.search(r"NodeName=(\S+)", probe).group(1)
