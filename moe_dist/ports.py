"""A free TCP port for a job's rendezvous store on this machine.

The port is taken from below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``).
A port the kernel hands out for ``bind(0)`` or an outgoing connection comes from that range: gloo's
listening sockets, every client socket. Chosen from it, a port released by the check here could be
given to one of those before the store binds it, and the job's ranks would then connect to some
other program's socket (a gloo pair of another job on this machine: its mesh breaks with
"Connection closed by peer"). Below the range only another explicit choice can collide, and the
draw is random over several thousand ports.
"""
from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 12000  # ports drawn from [low - _SPAN, low)
_TRIES = 200


def ephemeral_low(path: str = _RANGE_FILE) -> int:
    """The lowest port the kernel hands out by itself (Linux's default 32768 where unreadable)."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds now on ``host`` and that the kernel will not give away by itself."""
    high = ephemeral_low()
    low = max(1024, high - _SPAN)
    rng = random.SystemRandom()
    for _ in range(_TRIES if high > low else 0):
        port = rng.randrange(low, high)
        if _bindable(port, host):
            return port
    with socket.socket() as s:  # every draw taken: any port the kernel has free
        s.bind((host, 0))
        return s.getsockname()[1]
