"""Streaming a step at a time when the frontend is behind the ring (launch/frontend.py): the
ring's Deltas messages already waiting are still answered one client message each, so a fast
ring's tokens do not reach the client as one burst (whose TPOT would read 0)."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import zmq

from launch.frontend import Frontend
from protocol.channels import CLIENT_LIMITS, PullChannel
from protocol.codec import decode_many, encode
from protocol.messages import Chunk, Deltas, Done, Generate, RequestDelta
from protocol.sampling import SamplingParams


class WaitingDeltas:
    """Stage 0's deltas link with every message already there once `arrived` is set: recv then
    returns without yielding to the event loop, as pyzmq's does for a message that is waiting
    (what a frontend behind a fast ring meets)."""

    def __init__(self) -> None:
        self.messages: deque[Deltas] = deque()
        self.arrived = asyncio.Event()

    async def recv(self) -> Deltas:
        await self.arrived.wait()  # yields only until the first arrives
        if self.messages:
            return self.messages.popleft()
        await asyncio.Event().wait()  # nothing more comes; cancelled with the frontend

    def close(self, linger_ms: int | None = None) -> None:
        pass


def test_a_frontend_behind_the_ring_sends_each_step_as_its_own_message(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    ring = PullChannel("tcp://127.0.0.1:*")  # stands in for stage 0's intake
    ctx = zmq.Context()

    async def scenario() -> list[list]:
        frontend = Frontend(
            tokenizer,
            client_addr="tcp://127.0.0.1:*",
            intake_addr=ring.addr,
            deltas_addr="tcp://127.0.0.1:*",
            context_length=2048,
        )
        frontend.deltas.close(0)
        frontend.deltas = deltas = WaitingDeltas()
        client = ctx.socket(zmq.DEALER)
        serving = asyncio.create_task(frontend.serve())
        try:
            client.connect(frontend.addr)
            sampling = SamplingParams(max_new_tokens=3)
            client.send_multipart(encode(Generate(rid="a", prompt="Hi", sampling=sampling)))
            deadline = time.monotonic() + 10
            while not ring.poll(0):  # the frontend took the request and sent it to the ring
                assert time.monotonic() < deadline, "the request never reached the ring"
                await asyncio.sleep(0.01)
            (new,) = ring.recv().new
            # Three steps' deltas, all waiting before the frontend reads the first.
            for step, (token, finish) in enumerate([(11, ""), (12, ""), (13, "length")]):
                delta = RequestDelta(new.rid, token, None, finish)
                deltas.messages.append(Deltas(step=step, deltas=[delta]))
            deltas.arrived.set()
            received: list[list] = []
            while not received or not isinstance(received[-1][-1], Done):
                assert time.monotonic() < deadline, received
                if client.poll(0):
                    received.append(decode_many(client.recv_multipart(), CLIENT_LIMITS))
                else:
                    await asyncio.sleep(0.01)
            return received
        finally:
            serving.cancel()
            client.close(0)
            frontend.close()

    try:
        received = asyncio.run(scenario())
    finally:
        ring.close(0)
        ctx.term()
    shapes = [[(type(m).__name__, getattr(m, "token_ids", None)) for m in msg] for msg in received]
    assert shapes == [
        [("Chunk", [11])],
        [("Chunk", [12])],
        [("Chunk", [13]), ("Done", None)],
    ]
    assert all(isinstance(m, Chunk | Done) and m.rid == "a" for msg in received for m in msg)
