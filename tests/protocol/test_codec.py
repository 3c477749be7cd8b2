from __future__ import annotations

import dataclasses

import pytest
import torch

from protocol.codec import DTYPES, decode, decode_many, encode, encode_many
from protocol.errors import ProtocolError
from protocol.messages import ALL_KINDS, Deltas, Output, Proxy, Reqs, RequestDelta, RingError
from tests.protocol.conftest import sample_messages


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            # Bit-exact: compare the raw bytes, so NaN payloads and -0.0 count too.
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        else:
            assert x == y, f.name


def test_every_kind_round_trips_over_a_real_socket(link):
    push, pull = link
    messages = sample_messages()
    assert {type(m).kind for m in messages} == set(ALL_KINDS)
    for msg in messages:
        push.send(msg)
    for msg in messages:
        assert_same(msg, pull.recv(timeout_s=5))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("num_tokens", [0, 1, 64, 3000])
def test_tensors_of_every_dtype_and_size_are_bit_exact(link, dtype_name, num_tokens):
    push, pull = link
    dtype = getattr(torch, dtype_name)
    if dtype.is_floating_point:
        hidden = torch.randn(num_tokens, 24).to(dtype)
        if num_tokens:
            hidden[0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    else:
        hidden = torch.randint(-(2**30), 2**30, (num_tokens, 24), dtype=dtype)
    msg = Proxy(slot=0, step=0, digest="x", hidden_states=hidden, residual=hidden[:, :5])
    push.send(msg)
    out = pull.recv(timeout_s=5)
    assert_same(msg, out)


def test_non_contiguous_tensors_are_sent_as_their_values(link):
    push, pull = link
    base = torch.randn(8, 6)
    msg = Proxy(slot=0, step=0, digest="x", hidden_states=base.t(), residual=base[::2])
    push.send(msg)
    out = pull.recv(timeout_s=5)
    assert torch.equal(out.hidden_states, base.t()) and torch.equal(out.residual, base[::2])


def test_decoded_tensors_are_views_over_the_received_frame():
    hidden = torch.randn(64, 576)
    frames = [bytes(f) for f in encode(Proxy(0, 0, "x", hidden, hidden))]
    out = decode(frames)
    # torch.frombuffer shares memory with the frame: no copy on the receiving side.
    assert out.hidden_states.untyped_storage().nbytes() == len(frames[1])
    assert torch.equal(out.hidden_states, hidden)


def test_encode_refuses_what_the_schema_cannot_carry():
    with pytest.raises(ProtocolError):
        encode(object())
    with pytest.raises(ProtocolError, match="dtype"):
        encode(Proxy(0, 0, "x", torch.zeros(2, dtype=torch.float64), torch.zeros(2)))
    with pytest.raises(ProtocolError, match="torch.Tensor"):
        encode(Proxy(0, 0, "x", [1.0], torch.zeros(2)))


def test_decode_names_the_bad_field():
    frames = encode(Output(slot=0, step=0, digest="x", token_ids=[1]))
    import msgpack

    header = msgpack.unpackb(frames[0])
    header["token_ids"] = ["one"]
    with pytest.raises(ProtocolError, match=r"token_ids\[0\]"):
        decode([msgpack.packb(header)])
    header["token_ids"] = [True]
    with pytest.raises(ProtocolError, match="integer"):
        decode([msgpack.packb(header)])
    del header["token_ids"]
    with pytest.raises(ProtocolError, match="missing field 'token_ids'"):
        decode([msgpack.packb(header)])
    header["token_ids"], header["extra"] = [1], 1
    with pytest.raises(ProtocolError, match="unknown field 'extra'"):
        decode([msgpack.packb(header)])


def test_a_steps_deltas_keep_their_checks_on_the_fast_paths():
    """`X | None` fields take None and their exact type as they are, and a list of maps goes
    to its dataclass directly: what a wrong value meets there is still one named error."""
    import msgpack

    deltas = [
        RequestDelta(rid="a", token_id=5, logprob=-0.25, finish_reason=""),
        RequestDelta(rid="b", token_id=None, logprob=None, finish_reason="stop"),
    ]
    header = msgpack.unpackb(encode(Deltas(step=3, deltas=deltas))[0])
    got = decode([msgpack.packb(header)])
    assert got == Deltas(step=3, deltas=deltas)
    header["deltas"][0]["logprob"] = -1  # an int where a float may be: a float after decode
    got = decode([msgpack.packb(header)]).deltas[0].logprob
    assert got == -1.0 and type(got) is float
    for field, bad, words in (
        ("token_id", True, r"deltas\[1\]\.token_id must be an integer"),
        ("token_id", 1.5, "must be an integer"),
        ("logprob", "x", r"deltas\[1\]\.logprob must be a number"),
        ("top_ids", [1, False], "integer"),
    ):
        broken = msgpack.unpackb(msgpack.packb(header))
        broken["deltas"][1][field] = bad
        with pytest.raises(ProtocolError, match=words):
            decode([msgpack.packb(broken)])
    broken = msgpack.unpackb(msgpack.packb(header))
    broken["deltas"][1] = [1, 2]
    with pytest.raises(ProtocolError, match=r"deltas\[1\] must be a map"):
        decode([msgpack.packb(broken)])


def test_a_bundle_round_trips_and_decode_refuses_one():
    msgs = [
        Reqs(slot=0, step=3, aborts=["a"]),
        Output(slot=0, step=1, digest="d", token_ids=[1, 2]),
        Proxy(0, 3, "d", torch.randn(3, 8), torch.randn(3, 8)),
    ]
    frames = [bytes(f) for f in encode_many(msgs)]
    back = decode_many(frames)
    assert [m.kind for m in back] == ["reqs", "output", "proxy"]
    assert back[0] == msgs[0] and back[1] == msgs[1]
    assert torch.equal(back[2].residual, msgs[2].residual)
    with pytest.raises(ProtocolError, match="reqs needs 1 frames, got 5"):
        decode(frames)
    with pytest.raises(ProtocolError, match="more than 2 messages in one bundle"):
        decode_many(frames, max_messages=2)
    with pytest.raises(ProtocolError, match="proxy needs 3 frames, got 2"):
        decode_many(frames[:-1])


def test_a_control_message_is_told_apart_by_its_op():
    import msgpack

    frames = encode(RingError(rank=2, message="stage 2 failed"))
    header = msgpack.unpackb(frames[0])
    assert header["kind"] == "ctrl" and header["op"] == "error"
    assert decode(frames) == RingError(rank=2, message="stage 2 failed")
    header["op"] = "heartbeat"  # a heartbeat has no message field
    with pytest.raises(ProtocolError, match="Heartbeat has unknown field"):
        decode([msgpack.packb(header)])
    for op in ("reboot", None, 3):
        header["op"] = op
        with pytest.raises(ProtocolError, match="unknown message kind 'ctrl'"):
            decode([msgpack.packb(header)])
    reqs = msgpack.unpackb(encode(Reqs(slot=0, step=0))[0])
    reqs["op"] = "hello"  # only a control message carries an op
    with pytest.raises(ProtocolError, match="reqs has unknown field 'op'"):
        decode([msgpack.packb(reqs)])
