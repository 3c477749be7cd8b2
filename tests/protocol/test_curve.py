"""CURVE on the wire (protocol/curve.py): known keys get through encrypted; a peer with no key
or an unknown key is refused inside ZeroMQ, logged once with its address, and nothing it sends
reaches the receiver."""

from __future__ import annotations

import contextlib
import logging
import socket
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.channels import (
    ChannelTimeout,
    DealerChannel,
    PullChannel,
    PushChannel,
    RouterChannel,
)
from protocol.curve import (
    CurveError,
    NodeKeys,
    _peer_of,
    is_loopback,
    keygen,
    load_pair,
    secure,
    warn_if_exposed,
)
from protocol.messages import Ping, Pong

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def ring_keys(tmp_path):
    """A two-node key folder, one client (alice) admitted, one (mallory) not."""
    for rank in range(2):
        keygen(tmp_path / "keys", f"node{rank}")
    keygen(tmp_path / "keys" / "clients", "alice")
    keygen(tmp_path / "outsider", "mallory")
    return tmp_path


def _bound(channel) -> str:
    return channel.addr  # the port the OS picked


def test_a_ring_link_carries_messages_between_known_nodes(ring_keys):
    node0 = NodeKeys.load(ring_keys / "keys", 0, 2)
    node1 = NodeKeys.load(ring_keys / "keys", 1, 2)
    pull = PullChannel("tcp://127.0.0.1:*", security=node1.ring_server())
    push = PushChannel(_bound(pull), security=node0.client_of(1))
    try:
        push.send(Ping(rid="through"))
        assert pull.recv(timeout_s=5) == Ping(rid="through")
    finally:
        push.close(0)
        pull.close(0)


# What a refused peer sees: its handshake failed (a keyless one may instead see the receiver
# hang up on it, which is all a refusal shows it then).
REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_DISCONNECTED,
}


def refused_push(addr: str, security) -> zmq.Socket:
    """A PUSH that connects to `addr`, sends raw bytes (the handshake fails before any is
    read), and returns once its receiver has refused it: its monitor, attached before it
    connects, sees the refusal (libzmq does not retry one). Asserts it never got in."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.linger = 0
    secure(sock, security)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(addr)
        with contextlib.suppress(zmq.Again):
            sock.send(b"x", zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        while True:
            assert monitor.poll(max(deadline - time.monotonic(), 0) * 1000), "never refused"
            event = recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED  # nobody gets in
            if event in REFUSED:
                return sock
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_no_key_and_an_unknown_key_are_refused_and_logged_once(ring_keys, caplog):
    node1 = NodeKeys.load(ring_keys / "keys", 1, 2)
    mallory = load_pair(ring_keys / "outsider" / "mallory.key_secret")
    pull = PullChannel("tcp://127.0.0.1:*", security=node1.ring_server())
    from protocol.curve import CurveClient

    unknown = CurveClient(mallory, node1.pair.public)
    senders: list[zmq.Socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="protocol.curve"):
            # One after another, each once the receiver has refused the one before: no CURVE
            # at all, twice (logged once), then an unknown key, twice (logged once). The
            # receiver's watcher thread answers the unknown keys' ZAP requests itself, after
            # the keyless refusals it was told of earlier: once the last is refused, every
            # line the four could have caused is there.
            for security in (None, None, unknown, unknown):
                senders.append(refused_push(_bound(pull), security))
            assert not pull.poll(0)  # nothing reached the receiver
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2, messages
        assert any(
            f"to {_bound(pull)} from" in m and "did not complete a CURVE handshake" in m
            for m in messages
        )
        assert any(
            "is not admitted" in m and "127.0.0.1" in m and mallory.public.decode() in m
            for m in messages
        )
    finally:
        for sender in senders:
            sender.close(0)
        pull.close(0)


def test_the_client_domain_admits_clients_and_the_ring_domain_does_not(ring_keys):
    node0 = NodeKeys.load(ring_keys / "keys", 0, 2)
    alice = load_pair(ring_keys / "keys" / "clients" / "alice.key_secret")
    from protocol.curve import CurveClient

    as_alice = CurveClient(alice, node0.pair.public)
    frontend = RouterChannel("tcp://127.0.0.1:*", security=node0.clients_server())
    rendezvous = RouterChannel("tcp://127.0.0.1:*", security=node0.ring_server())
    to_frontend = DealerChannel(_bound(frontend), security=as_alice)
    to_rendezvous = DealerChannel(_bound(rendezvous), security=as_alice)
    try:
        to_frontend.send(Ping(rid="a"), timeout_s=5)
        identity, msg = frontend.recv(timeout_s=5)
        assert msg == Ping(rid="a")
        frontend.send(identity, Pong(rid="a"))
        assert to_frontend.recv(timeout_s=5) == Pong(rid="a")
        # A client key is not a node key: refused (the send may wait for a peer that never
        # comes, or go out and never arrive).
        with contextlib.suppress(ChannelTimeout):
            to_rendezvous.send(Ping(rid="b"), timeout_s=1.0)
        with pytest.raises(ChannelTimeout):
            rendezvous.recv(timeout_s=1.0)
    finally:
        for channel in (to_frontend, to_rendezvous, frontend, rendezvous):
            channel.close(0)


def test_node_keys_name_what_is_missing(tmp_path):
    keygen(tmp_path, "node0")
    with pytest.raises(CurveError, match=r"node1.key_secret is missing.*ppring keygen"):
        NodeKeys.load(tmp_path, 1, 2)
    with pytest.raises(CurveError, match=r"lacks the public keys of nodes \[1\]"):
        NodeKeys.load(tmp_path, 0, 2)
    with pytest.raises(CurveError, match="is not a folder"):
        NodeKeys.load(tmp_path / "nowhere", 0, 1)
    with pytest.raises(CurveError, match="exists"):
        keygen(tmp_path, "node0")  # never overwrites a pair
    assert (tmp_path / "node0.key_secret").stat().st_mode & 0o077 == 0


def test_binding_beyond_loopback_in_clear_warns(caplog):
    assert is_loopback("tcp://127.0.0.1:5") and is_loopback("inproc://x")
    assert is_loopback("tcp://[::1]:5") and is_loopback("tcp://localhost:5")
    assert not is_loopback("tcp://198.18.0.1:5") and not is_loopback("tcp://*:5")
    with caplog.at_level(logging.WARNING, logger="protocol.curve"):
        warn_if_exposed("tcp://127.0.0.1:5", None, "x")
        assert not caplog.records
        warn_if_exposed("tcp://0.0.0.0:5", None, "the rendezvous")
    (record,) = caplog.records
    assert "the rendezvous binds tcp://0.0.0.0:5 in clear text" in record.getMessage()
    assert "--curve-dir" in record.getMessage()


def test_a_refusal_watch_reads_no_address_for_a_unix_socket(tmp_path) -> None:
    # An ipc:// endpoint's accepted connection is a Unix socket: its local name is the path
    # and its peer has none. The watch must answer None, not fail on the peer's empty name.
    path = str(tmp_path / "ring-stage1")
    with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as client:
        listener.bind(path)
        listener.listen(1)
        client.connect(path)
        accepted, _ = listener.accept()
        with accepted:
            assert _peer_of(accepted.fileno(), f"ipc://{path}") is None
