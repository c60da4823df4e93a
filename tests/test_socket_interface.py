"""moe_dist/distributed/interfaces.py without root: this machine's own interfaces and routes (nothing is sent
anywhere but to this machine's own addresses), and the rule's decisions for launches over several hosts.
On the namespace cluster, with an interface that cannot reach the other node: tests/test_multinode_interfaces.py."""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from moe_dist.distributed.bootstrap import LaunchInfo
from moe_dist.distributed.interfaces import (HostNetworkError, interface_addresses, interface_holding, meeting_point,
                                      pick_socket_interface, probe, route_source)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _own_address() -> tuple[str, str]:
    """(interface, IPv4 address) of a non-loopback interface of this machine, or skip."""
    for name, addrs in sorted(interface_addresses().items()):
        for a in addrs:
            if ":" not in a and not ipaddress.ip_address(a).is_loopback:
                return name, a
    pytest.skip("this machine has no non-loopback IPv4 address")


def _two_hosts(master: str, port: int = 29599) -> LaunchInfo:
    return LaunchInfo(rank=1, world_size=2, local_rank=0, local_world_size=1, master_addr=master, master_port=port,
                      launcher="torchrun")


def test_the_interfaces_and_their_addresses_are_the_kernel_s():
    table = interface_addresses()
    assert set(table) <= set(os.listdir("/sys/class/net"))
    lo = interface_holding("127.0.0.1", table)
    assert lo is not None and "127.0.0.1" in table[lo]
    assert interface_holding("127.0.0.53", table) == lo  # the whole loopback range
    assert interface_holding("198.51.100.7", table) is None


def test_the_route_to_an_address_leaves_from_the_interface_that_holds_it():
    assert route_source(socket.AF_INET, "127.0.0.1", 9) == "127.0.0.1"
    name, address = _own_address()
    assert route_source(socket.AF_INET, address, 9) == address  # one of this host's: delivered locally
    assert interface_holding(address, interface_addresses()) == name


def test_a_probe_is_answered_by_a_listener_and_by_a_refusal():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert probe("127.0.0.1", socket.AF_INET, "127.0.0.1", port) is None
    assert probe("127.0.0.1", socket.AF_INET, "127.0.0.1", port) is None  # closed now: refused, so reachable


def test_one_host_needs_nothing():
    env: dict = {}
    one = LaunchInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="127.0.0.1")
    assert pick_socket_interface(one, env) is None and env == {}
    # several "nodes" that meet at a loopback address are all this machine
    assert pick_socket_interface(_two_hosts("127.0.0.1"), env) is None and env == {}


def test_both_variables_are_set_to_the_interface_of_the_route():
    name, address = _own_address()
    env: dict = {}
    chosen = pick_socket_interface(_two_hosts(address), env)
    assert (chosen.name, chosen.address, chosen.reason) == (name, address, f"route to {address}")
    assert str(chosen) == f"{name} (route to {address})"
    assert env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}
    # a variable the user set is kept (NCCL's syntax is NCCL's to check)
    env = {"NCCL_SOCKET_IFNAME": "^docker"}
    pick_socket_interface(_two_hosts(address), env)
    assert env == {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": "^docker"}


def test_launch_torchrun_s_rendezvous_is_the_meeting_point():
    launch = _two_hosts("node7", 41000)  # torchrun's MASTER_ADDR for its workers: the first rank's host
    assert meeting_point(launch, {"MOE_DIST_RENDEZVOUS": "node1:29500"}) == ("node1", 29500)
    assert meeting_point(launch, {"MOE_DIST_RENDEZVOUS": "[fd00::1]:29500"}) == ("fd00::1", 29500)
    assert meeting_point(launch, {}) == ("node7", 41000)
    env = {"MOE_DIST_RENDEZVOUS": "127.0.0.1:29500"}
    assert pick_socket_interface(launch, env) is None  # the rendezvous is on this machine


def test_a_user_s_interface_is_checked():
    name, address = _own_address()
    with socket.create_server((address, 0)) as server:
        launch = _two_hosts(address, server.getsockname()[1])
        env = {"GLOO_SOCKET_IFNAME": name}
        chosen = pick_socket_interface(launch, env)
        assert (chosen.name, chosen.reason) == (name, "GLOO_SOCKET_IFNAME") and env["NCCL_SOCKET_IFNAME"] == name
        with pytest.raises(HostNetworkError, match=rf"^GLOO_SOCKET_IFNAME={name},nosuch0: there is no interface "
                                                   r"'nosuch0' on \S+ \(its interfaces: .*\); name the one that "
                                                   rf"reaches MASTER_ADDR={address}, or unset it$"):
            pick_socket_interface(launch, {"GLOO_SOCKET_IFNAME": f"{name},nosuch0"})


def test_the_cli_says_it_in_one_line_on_every_host_before_the_process_group():
    """Rank 1, the first process of its host: a bad GLOO_SOCKET_IFNAME ends it with one line and exit
    code 2 at once (rank 0 never started: nothing waits for it)."""
    _, address = _own_address()
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env.update(PYTHONPATH=ROOT, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=address,
               MASTER_PORT="29598", GLOO_SOCKET_IFNAME="nosuch0")
    r = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", "run.dir=/nonexistent/x"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert lines[0].startswith("moe-dist train: error: GLOO_SOCKET_IFNAME=nosuch0: there is no interface 'nosuch0' on ")
