"""Random and mutated bytes through the decoder and through live sockets: only ProtocolError."""

from __future__ import annotations

import random
import tracemalloc

import msgpack
import pytest

from protocol.channels import BadClientMessage, DealerChannel, RouterChannel
from protocol.codec import PROTOCOL_VERSION, decode, encode
from protocol.errors import ProtocolError
from protocol.messages import ALL_KINDS, Abort, Reqs
from tests.protocol.conftest import random_proxy, sample_messages

WRONG_VALUES = [
    None,
    True,
    -1,
    2**63 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    b"\x00",
    [],
    [1, "a"],
    {},
    {"a": 1},
    {1: 2},
    [[[[[]]]]],
]


def valid_frames(rng: random.Random) -> list[bytes]:
    msg = rng.choice(sample_messages() + [random_proxy(rng)])
    return [bytes(f) for f in encode(msg)]


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One of the ways a peer (or a broken link) can get a message wrong."""
    frames = list(frames)
    how = rng.randrange(9)
    if how == 0:  # flip bits anywhere
        i = rng.randrange(len(frames))
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 8)):
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(data)
    elif how == 1:  # truncate a frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif how == 2:  # extra frames
        frames += [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 3))]
    elif how == 3:  # missing frames
        frames = frames[: rng.randrange(len(frames))]
    else:  # edit the header
        header = msgpack.unpackb(frames[0])
        key = rng.choice(sorted(header))
        if how == 4:  # wrong type in a field
            header[key] = rng.choice(WRONG_VALUES)
        elif how == 5 and header.get("tensors"):  # huge or bad declared shape / dtype
            meta = header["tensors"][rng.randrange(len(header["tensors"]))]
            meta[rng.choice(["shape", "dtype", "name"])] = rng.choice(
                [[2**40, 2**40], [2**62] * 8, [-1, 4], [1] * 40, "float64", "object", 7, None]
            )
        elif how == 6:  # drop a field, or add an unknown one
            if rng.random() < 0.5:
                del header[key]
            else:
                header[f"x{rng.randrange(9)}"] = 1
        elif how == 7:  # wrong version or kind
            header[rng.choice(["v", "kind"])] = rng.choice(
                [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, "reqs", "pickle", None]
            )
        else:  # an extension type, a deep nest, or a non-map header
            header = rng.choice(
                [msgpack.ExtType(5, b"abc"), [header], {"v": PROTOCOL_VERSION}, "str", 3]
            )
            if rng.random() < 0.3:
                header = {
                    "v": PROTOCOL_VERSION,
                    "kind": "ctrl",
                    "op": "hello",
                    "rank": 0,
                    "seq": 0,
                    "tensors": [],
                    "info": {"a": [[[[[[[[[1]]]]]]]]]},
                }
        frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def random_junk(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.randint(0, 200)) for _ in range(rng.randint(1, 4))]


def check_decode(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert type(msg).kind in ALL_KINDS  # a mutation may still be a valid message


def test_5000_random_and_mutated_messages_raise_only_protocol_error():
    rng = random.Random(1234)
    tracemalloc.start()
    try:
        for n in range(5000):
            frames = random_junk(rng) if n % 5 == 0 else mutate(valid_frames(rng), rng)
            check_decode(frames)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Huge declared shapes are refused before anything is allocated.
    assert peak_bytes < 64 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.timeout(120)
def test_5000_bad_messages_on_a_live_ring_socket_leave_it_working(link):
    push, pull = link
    rng = random.Random(99)
    rss_before = rss_bytes()
    for n in range(5000):
        frames = random_junk(rng) if n % 4 == 0 else mutate(valid_frames(rng), rng)
        if not frames:
            continue  # ZeroMQ cannot send a message with no frames
        push.sock.send_multipart(frames)
        try:
            pull.recv(timeout_s=5)
        except ProtocolError:
            pass
        if n % 100 == 0:  # a correct message still gets through, every time
            push.send(Reqs(slot=0, step=n))
            assert pull.recv(timeout_s=5).step == n
    assert rss_bytes() - rss_before < 200 << 20


@pytest.mark.timeout(60)
def test_a_live_client_socket_names_the_sender_of_a_bad_message(ctx):
    router = RouterChannel("tcp://127.0.0.1:*", ctx=ctx)
    dealers = [DealerChannel(router.addr, ctx=ctx) for _ in range(2)]
    rng = random.Random(7)
    try:
        senders = []  # each dealer's identity as the router sees it, from a good message
        for n, dealer in enumerate(dealers):
            dealer.send(Abort(rid=f"hello{n}"))
            identity, msg = router.recv(timeout_s=5)
            assert msg == Abort(rid=f"hello{n}")
            senders.append(identity)
        assert senders[0] != senders[1]
        bad = 0
        for n in range(500):
            dealers[n % 2].sock.send_multipart(random_junk(rng))
            try:
                router.recv(timeout_s=5)
            except BadClientMessage as exc:
                assert exc.identity == senders[n % 2]  # the one that sent it, not the other
                bad += 1
        assert bad > 450
        for n, dealer in enumerate(dealers):  # the identity reaches its sender
            router.send(senders[n], Abort(rid=f"back{n}"))
            assert dealer.recv(timeout_s=5) == Abort(rid=f"back{n}")
    finally:
        for dealer in dealers:
            dealer.close(0)
        router.close(0)
