"""ZeroMQ CURVE for every socket that crosses a network: keys on disk, what each socket needs,
and the gatekeeper that admits only known keys.

CURVE (RFC 26, CurveZMQ) encrypts and authenticates a connection with Curve25519 key pairs. A
bound socket is the CURVE *server*: it holds its own key pair and asks its context's ZAP handler
(the `Gatekeeper` here) whether the connecting peer's public key is admitted. A connecting
socket is the CURVE *client*: its own key pair plus the server's public key, so it talks only to
the peer it meant to. A peer with no key, or a key not admitted, fails the handshake inside
ZeroMQ: nothing it sends ever reaches a socket's receive queue, so nothing reaches the loop.

A node's keys live in one folder (`--curve-dir`), made with `ppring keygen`:

    DIR/node0.key        public keys of every node of the ring (the same files on every node)
    DIR/node1.key
    DIR/node1.key_secret this node's own key pair (node 1 here): on this node only
    DIR/clients/*.key    public keys of the clients allowed to send requests

Two admission domains: `ring` (ring links and the rendezvous: node keys only) and `clients`
(node 0's client socket: client keys, and node keys, so an operator on a node can send too).
pyzmq's `zmq.auth` reads and writes the key files; the ZAP handler is this module's own (a
blocking loop in one thread per context: pyzmq's runs an asyncio loop per context and logs
refusals at debug level only), with the domains and one log line per refused peer.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

RING_DOMAIN = "ring"
CLIENTS_DOMAIN = "clients"
CLIENTS_FOLDER = "clients"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks, in each context (RFC 27)
ZAP_VERSION = b"1.0"


class CurveError(ValueError):
    """Keys are missing, unreadable or CURVE is unavailable; the text says which and how to fix."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError(
            f"this pyzmq's libzmq ({zmq.zmq_version()}) was built without CURVE (libsodium): "
            "install pyzmq from its wheel (`pip install --force-reinstall pyzmq`), which bundles it"
        )


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes  # Z85, 40 bytes


@dataclass(frozen=True)
class CurveServer:
    """A bound socket: its key pair; the ZAP domain and public keys it admits."""

    pair: KeyPair
    domain: str
    admitted: frozenset[bytes]


@dataclass(frozen=True)
class CurveClient:
    """A connecting socket: its key pair and the public key of the server it expects."""

    pair: KeyPair
    server_key: bytes


Security = CurveServer | CurveClient | None


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (both keys, mode 0600); refuse to
    overwrite an existing pair. Returns both paths."""
    require_curve()
    directory = Path(directory)
    public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"--name {name!r} must be a plain file name, like node0 or alice")
    for path in (public, secret):
        if path.exists():
            raise CurveError(f"{path} exists; remove it first or choose another --name")
    directory.mkdir(parents=True, exist_ok=True)
    public_made, secret_made = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_made, 0o600)
    return Path(public_made), Path(secret_made)


def load_pair(path: str | Path) -> KeyPair:
    """A key pair from a `.key_secret` file."""
    public, secret = _load(path)
    if secret is None:
        raise CurveError(f"{path} holds no secret key: give the .key_secret file of a pair")
    return KeyPair(public, secret)


def load_public(path: str | Path) -> bytes:
    return _load(path)[0]


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read a CURVE key from {path}: {exc}") from None
    return public, secret


@dataclass(frozen=True)
class NodeKeys:
    """What `--curve-dir` holds for the node of `rank`: its pair, every node's public key by
    rank, and the admitted client keys."""

    rank: int
    pair: KeyPair
    nodes: tuple[bytes, ...]
    clients: frozenset[bytes]

    @classmethod
    def load(cls, directory: str | Path, rank: int, nnodes: int) -> NodeKeys:
        require_curve()
        directory = Path(directory)
        if not directory.is_dir():
            raise CurveError(f"--curve-dir {directory} is not a folder")
        own = directory / f"node{rank}{SECRET_SUFFIX}"
        if not own.exists():
            raise CurveError(
                f"{own} is missing: run `ppring keygen {directory} --name node{rank}` on this "
                "node, and copy its node{rank}.key (never the secret) to the other nodes"
            )
        missing = [r for r in range(nnodes) if not (directory / f"node{r}{PUBLIC_SUFFIX}").exists()]
        if missing:
            raise CurveError(
                f"{directory} lacks the public keys of nodes {missing} (node<R>.key): copy each "
                "node's .key file into every node's --curve-dir"
            )
        nodes = tuple(load_public(directory / f"node{r}{PUBLIC_SUFFIX}") for r in range(nnodes))
        clients_dir = directory / CLIENTS_FOLDER
        clients = frozenset(
            load_public(path) for path in sorted(clients_dir.glob(f"*{PUBLIC_SUFFIX}"))
        )
        return cls(rank, load_pair(own), nodes, clients)

    def ring_server(self) -> CurveServer:
        """Ring links and the rendezvous: only the ring's nodes get in."""
        return CurveServer(self.pair, RING_DOMAIN, frozenset(self.nodes))

    def clients_server(self) -> CurveServer:
        """Node 0's client socket: the clients' keys, and the nodes' own."""
        return CurveServer(self.pair, CLIENTS_DOMAIN, self.clients | frozenset(self.nodes))

    def client_of(self, rank: int) -> CurveClient:
        """Connecting to the node of `rank` (its ring link, or node 0's rendezvous)."""
        return CurveClient(self.pair, self.nodes[rank])


def client_keys(server_key: str | Path, own_pair: str | Path) -> CurveClient:
    """A client's side: the frontend node's public key file (node0.key) and its own pair."""
    require_curve()
    return CurveClient(load_pair(own_pair), load_public(server_key))


def secure(sock: zmq.Socket, security: Security) -> None:
    """Set CURVE on `sock` before it binds or connects; a server also gets its context's
    gatekeeper, told which keys the domain admits."""
    if security is None:
        return
    sock.curve_secretkey = security.pair.secret
    sock.curve_publickey = security.pair.public
    if isinstance(security, CurveClient):
        sock.curve_serverkey = security.server_key
        return
    sock.curve_server = True
    sock.zap_domain = security.domain.encode()
    Gatekeeper.of(sock.context).admit(security.domain, security.admitted)


def watch_refusals(sock: zmq.Socket, security: Security) -> None:
    """After a CURVE server binds: log the peers its handshakes refuse (keyless ones never
    reach the ZAP handler, so only the socket's own events show them)."""
    if isinstance(security, CurveServer):
        Gatekeeper.of(sock.context).watch(sock)


def is_loopback(addr: str) -> bool:
    """True for inproc/ipc and for tcp on 127.0.0.0/8, ::1 or localhost."""
    if not addr.startswith("tcp://"):
        return True
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("*"): reachable from elsewhere


def warn_if_exposed(addr: str, security: Security, what: str) -> None:
    if security is None and not is_loopback(addr):
        logger.warning(
            "%s binds %s in clear text with no authentication: anyone who can reach it can read "
            "prompts and answers and send messages that take the ring down; run with "
            "--curve-dir (ppring keygen) across networks you do not fully trust",
            what,
            addr,
        )


class _Admissions:
    """The ZAP handler's decisions (RFC 27): one admitted-key set per domain, one log line per
    refused (address, key). CURVE only; any other mechanism a socket of this context asks
    about (none does: only CURVE servers set a ZAP domain) is allowed, as libzmq would without
    a handler."""

    def __init__(self) -> None:
        self.domains: dict[str, frozenset[bytes]] = {}
        self.refused: set[tuple[str, bytes]] = set()

    def reply(self, request: list[bytes]) -> list[bytes]:
        """ZAP request frames (version, id, domain, address, identity, mechanism,
        credentials...) -> reply frames (version, id, status code, status text, user, meta)."""
        if len(request) < 6:
            return [ZAP_VERSION, request[1] if len(request) > 1 else b"", b"400", b"bad", b"", b""]
        version, request_id, domain, address, _identity, mechanism = request[:6]
        if version != ZAP_VERSION:
            return [ZAP_VERSION, request_id, b"400", b"bad version", b"", b""]
        if mechanism != b"CURVE":
            return [ZAP_VERSION, request_id, b"200", b"OK", b"anonymous", b""]
        if len(request) != 7 or len(request[6]) != 32:
            return [ZAP_VERSION, request_id, b"400", b"bad credentials", b"", b""]
        key = z85.encode(request[6])
        if key in self.domains.get(domain.decode("utf-8", "replace"), frozenset()):
            return [ZAP_VERSION, request_id, b"200", b"OK", key, b""]
        host = address.decode("utf-8", "replace")
        if (host, key) not in self.refused:
            self.refused.add((host, key))
            logger.warning(
                "refused a %s connection from %s: its CURVE key %s is not admitted",
                domain.decode("utf-8", "replace"),
                host,
                key.decode(),
            )
        return [ZAP_VERSION, request_id, b"400", b"unknown key", b"", b""]


class Gatekeeper:
    """One per ZeroMQ context (ZAP handlers are per context): admits keys by domain, and logs
    each refused peer once. Started by the first CURVE server socket of the context."""

    _by_context: dict[int, Gatekeeper] = {}
    _lock = threading.Lock()

    def __init__(self, context: zmq.Context) -> None:
        self.admissions = _Admissions()
        # One thread answers ZAP requests and reads the monitors (plain blocking ZeroMQ, no
        # event loop). It gets new monitor sockets from this queue, woken by a byte on the
        # pipe (os.write is safe from any thread, a ZeroMQ socket is not).
        self.sync_context = zmq.Context.shadow(context.underlying)
        self.zap = self.sync_context.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        self.new_monitors: queue.SimpleQueue[tuple[zmq.Socket, int]] = queue.SimpleQueue()
        self.wake_read, self.wake_write = os.pipe()
        self.thread = threading.Thread(target=self._watch_loop, name="curve-watch", daemon=True)
        self.thread.start()

    @classmethod
    def of(cls, context: zmq.Context) -> Gatekeeper:
        with cls._lock:
            key = context.underlying
            if key not in cls._by_context:
                cls._by_context[key] = cls(context)
            return cls._by_context[key]

    def admit(self, domain: str, keys: frozenset[bytes]) -> None:
        domains = self.admissions.domains
        self.admissions.domains = {**domains, domain: domains.get(domain, frozenset()) | keys}

    def watch(self, sock: zmq.Socket) -> None:
        """Follow `sock`'s handshakes (call before it binds; its port is read from the events)."""
        endpoint = f"inproc://ppring-curve-monitor-{id(sock)}"
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
        events |= zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        # A keyless peer may hang up first on seeing CURVE: the server then sees no detail.
        events |= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        sock.monitor(endpoint, events)
        monitor = self.sync_context.socket(zmq.PAIR)
        monitor.connect(endpoint)
        self.new_monitors.put(monitor)
        os.write(self.wake_write, b"w")

    def _watch_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.wake_read, zmq.POLLIN)
        poller.register(self.zap, zmq.POLLIN)
        watch = _Refusals()
        while True:
            for ready, _ in poller.poll():
                if ready is self.zap:
                    self.zap.send_multipart(self.admissions.reply(self.zap.recv_multipart()))
                    continue
                if ready == self.wake_read:
                    os.read(self.wake_read, 4096)
                    while not self.new_monitors.empty():
                        monitor = self.new_monitors.get()
                        poller.register(monitor, zmq.POLLIN)
                        watch.pending[monitor] = deque()
                    continue
                event = parse_monitor_message(ready.recv_multipart())
                if watch.on_event(ready, event):  # the socket is closed: its monitor goes too
                    poller.unregister(ready)
                    ready.close(linger=0)


class _Refusals:
    """Handshakes that fail because the peer does not speak CURVE: one log line per socket.
    ZeroMQ's failure event names no connection, so it is matched to the oldest accepted one
    still pending, whose address was read when it was accepted; by then ZeroMQ has often closed
    it already (the refusal takes microseconds), so the address is given where it was read.
    A refused peer retries every 100 ms or so: one line per socket, not per retry."""

    def __init__(self) -> None:
        self.pending: dict[zmq.Socket, deque[tuple[int, str | None]]] = {}
        self.logged: set[str] = set()  # endpoints

    def on_event(self, monitor: zmq.Socket, event: dict) -> bool:
        """Follow one event; True when the monitor has stopped."""
        kind, value = event["event"], event["value"]
        endpoint = event["endpoint"].decode()
        waiting = self.pending[monitor]
        if kind == zmq.EVENT_ACCEPTED:
            waiting.append((value, _peer_of(value, endpoint)))
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and waiting:
            waiting.popleft()
        elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            peer = waiting.popleft()[1] if waiting else None
            if endpoint not in self.logged:
                self.logged.add(endpoint)
                logger.warning(
                    "refused a connection to %s from %s: it did not complete a CURVE handshake "
                    "(no keys, or a ppring without --curve-dir); further refusals there are not "
                    "logged",
                    endpoint,
                    peer or "an address ZeroMQ did not report",
                )
        elif kind == zmq.EVENT_DISCONNECTED:
            self.pending[monitor] = deque(p for p in waiting if p[0] != value)
        elif kind == zmq.EVENT_MONITOR_STOPPED:
            del self.pending[monitor]
            return True
        return False


def _peer_of(fd: int, endpoint: str) -> str | None:
    """host:port at the other end of a just-accepted connection, read from a duplicate of
    ZeroMQ's descriptor (its own is never closed here). The connection may already be closed
    and its number reused; the local port must be the endpoint's, or the answer is None. An
    ipc:// endpoint's peers (Unix sockets, this host) have no address: None."""
    if not endpoint.startswith("tcp://"):
        return None
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            local_port = conn.getsockname()[1]
            host, port = conn.getpeername()[:2]
    except (OSError, IndexError, TypeError):
        return None
    if str(local_port) != endpoint.rsplit(":", 1)[-1]:
        return None
    return f"{host}:{port}"
