"""The network interface through which a job over several hosts talks: ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME``.

gloo listens on the address that the host's own name resolves to, and NCCL takes the first
interface whose name it likes; on a host with several interfaces either may be one that the other
hosts cannot reach (a management network; a name that resolves to another interface's address),
and the job then hangs at its start until ``parallel.timeout_s``. :func:`pick_socket_interface`,
called by the bootstrap before the process group starts, applies this rule on every rank. The
*meeting point* is the rendezvous that every node reached: ``MASTER_ADDR:MASTER_PORT`` as given to
``launch/torchrun.sh`` (it passes them on as ``MOE_DIST_RENDEZVOUS``, since torchrun hands its
workers the first rank's host name instead), else the process's ``MASTER_ADDR`` and ``MASTER_PORT``.

* every rank on this host (the world size is the launcher's local world size, or the meeting point
  is a loopback address): nothing is set, nothing is checked;
* ``GLOO_SOCKET_IFNAME`` set (a comma-separated list, as gloo reads it): each interface named must
  exist, hold an address of the meeting point's family and reach the meeting point from it (a TCP
  connection from that address is answered, accepted or refused, within :data:`PROBE_TIMEOUT_S`);
  otherwise one line, exit code 2. ``NCCL_SOCKET_IFNAME`` set: kept as it is (NCCL reads prefixes
  and exclusions, and checks it itself);
* each of the two that is unset is set to the interface through which this host reaches the
  meeting point: the kernel's route lookup (the local address of a UDP socket connected to it;
  connecting a UDP socket sends nothing) and the interface that holds that address. On the meeting
  point's own host that is the interface holding the address its name resolves to there. A name
  that does not resolve, or no route: one line naming both variables, exit code 2.

A :class:`HostNetworkError` is said by the first process of every host (each host has its own
settings). The choice is returned (:class:`SocketInterface`) and rank 0's ``parallel:`` line names it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

from ..errors import HostError

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
RENDEZVOUS_ENV = "MOE_DIST_RENDEZVOUS"  # HOST:PORT, set by launch/torchrun.sh: the rendezvous every node reached
PROBE_TIMEOUT_S = 5.0  # a SYN and two retransmissions


class HostNetworkError(HostError):
    """This host's network settings cannot carry the job."""


@dataclass
class SocketInterface:
    """The interface this host's collectives use, and why."""

    name: str
    address: str
    reason: str  # "route to MASTER_ADDR ..." or "GLOO_SOCKET_IFNAME"

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


# ---- the interfaces of this host (getifaddrs, as gloo itself reads them) ----
class _Sockaddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_ubyte * 4)]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("flowinfo", ctypes.c_uint32),
                ("addr", ctypes.c_ubyte * 16), ("scope_id", ctypes.c_uint32)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_Sockaddr)), ("netmask", ctypes.POINTER(_Sockaddr)),
                     ("ifu", ctypes.POINTER(_Sockaddr)), ("data", ctypes.c_void_p)]


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 and IPv6 addresses} of this host (network namespace), from getifaddrs."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs: {os.strerror(err)}")
    out: dict[str, list[str]] = {}
    try:
        node = head
        while node:
            ifa = node.contents
            addrs = out.setdefault(ifa.name.decode(errors="replace"), [])
            if ifa.addr:
                family = ifa.addr.contents.family
                if family == socket.AF_INET:
                    raw = bytes(ctypes.cast(ifa.addr, ctypes.POINTER(_SockaddrIn)).contents.addr)
                    addrs.append(socket.inet_ntop(socket.AF_INET, raw))
                elif family == socket.AF_INET6:
                    raw = bytes(ctypes.cast(ifa.addr, ctypes.POINTER(_SockaddrIn6)).contents.addr)
                    addrs.append(socket.inet_ntop(socket.AF_INET6, raw))
            node = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


def interface_holding(address: str, table: Mapping[str, list[str]]) -> Optional[str]:
    """The interface that holds ``address`` (a loopback address: the loopback interface), or None."""
    for name, addrs in table.items():
        if address in addrs:
            return name
    if ipaddress.ip_address(address).is_loopback:
        return next((n for n, a in table.items() if any(ipaddress.ip_address(x).is_loopback for x in a)), None)
    return None


# ---- the kernel's view of MASTER_ADDR ----
def resolve(host: str) -> tuple[int, str]:
    """(address family, address) of ``host``, the first that getaddrinfo gives (as torch's store takes it)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[0]


def route_source(family: int, address: str, port: int) -> str:
    """The local address the kernel's route lookup gives for ``address`` (nothing is sent)."""
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        return s.getsockname()[0]


def probe(source: str, family: int, address: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when a TCP connection from ``source`` to ``address:port`` is answered (accepted, or
    refused: the reply came back), else why not."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.bind((source, 0))
            s.connect((address, port))
        except ConnectionRefusedError:
            return None
        except socket.timeout:
            return f"no answer within {timeout_s:g} s"
        except OSError as e:
            return os.strerror(e.errno) if e.errno else str(e)
    return None


# ---- the rule ----
def _one_host(launch) -> bool:
    return launch.world_size <= launch.local_world_size


def _where() -> str:
    return f"on {socket.gethostname()}"


def _address_of(host: str) -> tuple[int, str]:
    try:
        return resolve(host)
    except (socket.gaierror, UnicodeError) as e:
        raise HostNetworkError(f"MASTER_ADDR={host} does not resolve {_where()} ({e}); give the first node's address "
                               "or a name that every node resolves") from None


def _checked(names: str, master: str, port: int, table: Mapping[str, list[str]], timeout_s: float) -> SocketInterface:
    """The first of the user's GLOO_SOCKET_IFNAME interfaces, each checked; HostNetworkError otherwise."""
    family, address = _address_of(master)
    chosen = None
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in table:
            raise HostNetworkError(
                f"GLOO_SOCKET_IFNAME={names}: there is no interface {name!r} {_where()} (its interfaces: "
                f"{', '.join(sorted(table))}); name the one that reaches MASTER_ADDR={master}, or unset it")
        mine = [a for a in table[name] if (":" in a) == (family == socket.AF_INET6)]
        if not mine:
            raise HostNetworkError(
                f"GLOO_SOCKET_IFNAME={names}: interface {name} {_where()} has no "
                f"{'IPv6' if family == socket.AF_INET6 else 'IPv4'} address to reach MASTER_ADDR={master} ({address})")
        why = probe(mine[0], family, address, port, timeout_s)
        if why:
            raise HostNetworkError(
                f"GLOO_SOCKET_IFNAME={names}: interface {name} ({mine[0]}) {_where()} cannot reach "
                f"MASTER_ADDR={master} ({address}:{port}): {why}; name the interface that reaches it, or unset "
                "GLOO_SOCKET_IFNAME to have it found by the route to MASTER_ADDR")
        chosen = chosen or SocketInterface(name, mine[0], "GLOO_SOCKET_IFNAME")
    return chosen


def _routed(host: str, table: Mapping[str, list[str]]) -> SocketInterface:
    """The interface of the kernel's route to ``host``; HostNetworkError naming both variables otherwise."""
    family, address = _address_of(host)
    fix = "set GLOO_SOCKET_IFNAME (gloo) / NCCL_SOCKET_IFNAME (NCCL) to the interface that reaches the other nodes"
    try:
        source = route_source(family, address, 9)
    except OSError as e:
        raise HostNetworkError(f"no route {_where()} to MASTER_ADDR={host} ({address}): "
                               f"{os.strerror(e.errno) if e.errno else e}; {fix}") from None
    name = interface_holding(source, table)
    if name is None:
        raise HostNetworkError(f"the route {_where()} to MASTER_ADDR={host} ({address}) leaves from {source}, "
                               f"which no interface holds; {fix}")
    return SocketInterface(name, source, f"route to {host}")


def meeting_point(launch, env: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) that every node of the job reaches: torchrun's rendezvous endpoint when
    launch/torchrun.sh says it (``MOE_DIST_RENDEZVOUS``; torchrun hands its workers the first
    rank's host name as MASTER_ADDR instead), else MASTER_ADDR and MASTER_PORT."""
    given = env.get(RENDEZVOUS_ENV, "").strip()
    if given and ":" in given:
        host, port = given.rsplit(":", 1)
        if port.isdigit():
            return host.strip("[]"), int(port)
    return launch.master_addr, launch.master_port


def pick_socket_interface(launch, environ: Optional[MutableMapping[str, str]] = None,
                          timeout_s: float = PROBE_TIMEOUT_S) -> Optional[SocketInterface]:
    """Apply the rule of this module for a job described by ``launch`` (a bootstrap ``LaunchInfo``):
    check a user's GLOO_SOCKET_IFNAME, set the unset variables in ``environ`` (default: this
    process's environment, which gloo and NCCL read). None on one host."""
    env = os.environ if environ is None else environ
    if _one_host(launch) or not launch.master_addr:
        return None
    host, port = meeting_point(launch, env)
    if ipaddress.ip_address(_address_of(host)[1].split("%")[0]).is_loopback:
        return None  # every node is this machine
    table = interface_addresses()
    user = env.get("GLOO_SOCKET_IFNAME", "").strip()
    chosen = _checked(user, host, port, table, timeout_s) if user else _routed(host, table)
    for var in IFNAME_VARIABLES:
        if not env.get(var, "").strip():
            env[var] = chosen.name
    return chosen
