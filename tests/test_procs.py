"""launch/procs.py's port choice: free ports, and none an outgoing connection can be handed."""

from __future__ import annotations

import socket

from launch import procs


def test_a_base_port_lies_below_the_ephemeral_range_and_its_ports_are_free():
    low = procs._ephemeral_low()
    bases = {procs.find_free_base_port(16) for _ in range(20)}
    assert len(bases) > 1  # drawn, not the first free one each time
    for base in bases:
        assert procs.EXPLICIT_PORTS_FROM <= base and base + 16 <= low
    base = bases.pop()
    for port in range(base, base + 16):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_in_the_range_returned(monkeypatch):
    # Both ranges lie inside a block of 48 ports found free below the ephemeral range, where no
    # outgoing connection of another test can take one (a port bound to 0 lies inside that
    # range, and the 16 after it were once taken by a parallel test's connection).
    block = procs.find_free_base_port(48)
    draws = iter([block, block + 20])  # the first range holds the taken port, the second not
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", block + 3))
        taken.listen()
        monkeypatch.setattr(procs.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        assert procs.find_free_base_port(16) == block + 20
