"""Rendezvous ports come from below the kernel's ephemeral range (moe_dist/ports.py), so that no
socket the kernel numbers by itself (another job's gloo listener, a client) can take one between
the check and the store's bind."""
import socket

from moe_dist.ports import ephemeral_low, free_port


def test_a_free_port_binds_and_lies_below_the_ephemeral_range():
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1  # drawn, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_the_range_is_read_from_the_kernel_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ephemeral_low(str(f)) == 40000
    assert ephemeral_low(str(tmp_path / "missing")) == 32768


def test_a_port_the_kernel_hands_out_is_never_chosen():
    """A gloo-style listener (bind to port 0) holds an ephemeral port: free_port never returns it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        assert taken >= ephemeral_low()
        assert all(free_port() != taken for _ in range(50))
