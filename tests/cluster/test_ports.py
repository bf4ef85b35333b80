"""The sandbox's ports for servers that another process starts."""

from __future__ import annotations

import socket
from pathlib import Path

from memops import sandbox


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound() -> None:
    """Outgoing connections and port-0 binds take ports from the ephemeral range: a port chosen
    there could be gone before the operator binds it (it happened: "address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [sandbox.free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), ports
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_ports_already_chosen_are_not_chosen_again() -> None:
    first = sandbox.free_port()
    assert all(sandbox.free_port(first) != first for _ in range(200))
