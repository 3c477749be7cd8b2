from __future__ import annotations

import random
import time

import pytest
import torch

from protocol.channels import ChannelTimeout
from protocol.demux import DemuxReceiver, SequenceError
from protocol.messages import Heartbeat, Output, Proxy, Reqs, Shutdown

LOOP_SIZE = 3


def ring_messages(num_steps: int) -> dict[str, list]:
    return {
        "reqs": [Reqs(slot=s % LOOP_SIZE, step=s) for s in range(num_steps)],
        "proxy": [
            Proxy(s % LOOP_SIZE, s, f"{s}", torch.full((2, 4), float(s)), torch.zeros(2, 4))
            for s in range(num_steps)
        ],
        "output": [
            Output(slot=s % LOOP_SIZE, step=s, digest=f"{s}", token_ids=[s])
            for s in range(num_steps)
        ],
        "ctrl": [Heartbeat(rank=0, seq=s) for s in range(num_steps)],
    }


def shuffled_interleaving(per_kind: dict[str, list], rng: random.Random) -> list:
    """A random merge that keeps each kind's own order (what one sender can produce)."""
    queues = {kind: list(msgs) for kind, msgs in per_kind.items()}
    merged = []
    while any(queues.values()):
        kind = rng.choice([k for k, q in queues.items() if q])
        merged.append(queues[kind].pop(0))
    return merged


@pytest.mark.parametrize("seed", range(5))
def test_each_kind_comes_back_in_its_own_order(link, seed):
    push, pull = link
    rng = random.Random(seed)
    per_kind = ring_messages(20)
    for msg in shuffled_interleaving(per_kind, rng):
        push.send(msg)
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    # Ask for kinds in a different random order from the one they were sent in.
    wanted = shuffled_interleaving({k: [k] * len(v) for k, v in per_kind.items()}, rng)
    got: dict[str, list] = {kind: [] for kind in per_kind}
    for kind in wanted:
        got[kind].append(receiver.recv(kind, timeout_s=5))
    for kind, msgs in per_kind.items():
        if kind == "ctrl":
            assert [m.seq for m in got[kind]] == [m.seq for m in msgs]
        else:
            assert [m.step for m in got[kind]] == [m.step for m in msgs]
    assert got["proxy"][7].hidden_states[0, 0].item() == 7.0


def test_a_missing_step_is_reported(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    msgs = ring_messages(4)["output"]
    for msg in (msgs[0], msgs[1], msgs[3]):  # step 2 lost
        push.send(msg)
    assert receiver.recv("output", timeout_s=5).step == 0
    assert receiver.recv("output", timeout_s=5).step == 1
    with pytest.raises(SequenceError, match="expected step 2, got step 3.*lost"):
        receiver.recv("output", timeout_s=5)


def test_a_gap_in_another_kind_is_reported_while_waiting(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.send(ring_messages(2)["proxy"][1])  # proxy step 0 never sent
    push.send(Reqs(slot=0, step=0))
    with pytest.raises(SequenceError, match="proxy step gap"):
        receiver.recv("reqs", timeout_s=5)


def test_a_repeated_step_is_reported(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.send(Reqs(slot=0, step=0))
    push.send(Reqs(slot=0, step=0))
    receiver.recv("reqs", timeout_s=5)
    with pytest.raises(SequenceError, match="repeated"):
        receiver.recv("reqs", timeout_s=5)


def test_a_slot_that_does_not_match_the_step_is_reported(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.send(Reqs(slot=1, step=0))
    with pytest.raises(SequenceError, match="expected slot 0"):
        receiver.recv("reqs", timeout_s=5)


def test_junk_is_dropped_and_the_receiver_keeps_working(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.sock.send_multipart([b"\xc1garbage"])
    push.sock.send_multipart([b"\x80", b"extra frame"])
    push.send(Reqs(slot=0, step=0))
    assert receiver.recv("reqs", timeout_s=5).step == 0
    assert receiver.num_dropped == 2


def test_recv_times_out_with_a_clear_error(link):
    _, pull = link
    receiver = DemuxReceiver(pull)
    with pytest.raises(ChannelTimeout, match="no output message on .* within"):
        receiver.recv("output", timeout_s=0.05)
    assert receiver.poll("output", 0.01) is None


def test_a_zero_timeout_still_reads_what_is_queued(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.send(Reqs(slot=0, step=0))
    push.send(Heartbeat(rank=0))
    deadline = time.monotonic() + 5
    while not pull.poll(0.01) and time.monotonic() < deadline:
        pass
    time.sleep(0.05)  # both messages are in the socket now
    assert receiver.poll("ctrl", 0).op == "heartbeat"  # reads past the reqs, stashing it
    assert receiver.pending("reqs") == 1
    assert receiver.poll("ctrl", 0) is None


# -- bundles: a ring stage queues its step's messages and flushes them as one ---------------------


def test_a_flushed_bundle_is_one_zmq_message_and_comes_apart_in_order(link):
    push, pull = link
    per_kind = ring_messages(2)
    for msg in (per_kind["output"][0], per_kind["reqs"][0], per_kind["proxy"][0]):
        push.queue(msg)
    assert not pull.poll(0.05)  # nothing leaves before the flush
    push.flush()
    push.flush()  # an empty flush sends nothing
    got = pull.recv_many(timeout_s=5)
    assert [m.kind for m in got] == ["output", "reqs", "proxy"]
    assert torch.equal(got[2].hidden_states, per_kind["proxy"][0].hidden_states)
    assert not pull.poll(0.05)


def test_demux_hands_out_a_bundle_by_kind(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    per_kind = ring_messages(3)
    for step in range(3):
        for kind in ("output", "reqs", "proxy"):
            push.queue(per_kind[kind][step])
        push.flush()
    assert [receiver.recv("proxy", timeout_s=5).step for _ in range(3)] == [0, 1, 2]
    assert [receiver.recv("reqs", timeout_s=5).step for _ in range(3)] == [0, 1, 2]
    assert [receiver.recv("output", timeout_s=5).step for _ in range(3)] == [0, 1, 2]


def test_send_goes_after_what_is_queued_and_a_ctrl_does_not_jump_the_bundle(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.queue(Reqs(slot=0, step=0))
    push.send(Shutdown(rank=0))
    assert receiver.recv("reqs", timeout_s=5, also=("ctrl",)).kind == "reqs"
    assert receiver.recv("reqs", timeout_s=5, also=("ctrl",)).op == "shutdown"


def test_a_bundle_with_a_bad_part_is_dropped_whole_and_the_gap_is_caught(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    push.queue(Reqs(slot=0, step=0))
    push.flush()
    good = Reqs(slot=1, step=1)
    push.queue(good)
    push.queued.append(b"\xc1not msgpack")  # a corrupted second message in the bundle
    push.flush()
    push.send(Reqs(slot=2, step=2))
    assert receiver.recv("reqs", timeout_s=5).step == 0
    with pytest.raises(SequenceError, match="expected step 1, got step 2"):
        receiver.recv("reqs", timeout_s=5)
    assert receiver.num_dropped == 1


def test_prefetch_decodes_what_arrives_before_the_deadline_and_then_returns(link):
    push, pull = link
    receiver = DemuxReceiver(pull, loop_size=LOOP_SIZE)
    per_kind = ring_messages(1)
    push.queue(per_kind["output"][0])
    push.queue(per_kind["proxy"][0])
    push.flush()
    started = time.monotonic()
    receiver.prefetch(started + 0.2)
    took = time.monotonic() - started
    assert 0.15 <= took < 1.0  # it waited for more until the deadline, then gave up
    assert receiver.pending("output") == 1 and receiver.pending("proxy") == 1
    assert not pull.poll(0)  # everything was read off the socket
    assert receiver.recv("proxy", timeout_s=0).step == 0
    receiver.prefetch(time.monotonic() - 1)  # a deadline in the past returns at once
