"""The frontend while the ring re-forms (launch/frontend.py), driven directly: requests wait up
to the limit and then get `overloaded`, an abort of a waiting request is answered at once, and
the replay resumes each request where its client's stream stopped."""

from __future__ import annotations

import asyncio

from launch.frontend import Frontend
from protocol.channels import PullChannel
from protocol.messages import Done, Error, Generate, RequestDelta, Submit
from protocol.sampling import SamplingParams


def test_requests_wait_for_a_reforming_ring_and_are_replayed_from_their_last_token(
    default_model,
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    ring = PullChannel("tcp://127.0.0.1:*")  # stands in for stage 0's intake

    async def scenario() -> None:
        frontend = _frontend(tokenizer, ring, max_held_requests=2)
        answers: dict[str, list] = {}

        def sink(name: str):
            async def send(msg) -> None:
                answers.setdefault(name, []).append(msg)

            return send

        try:
            sampling = SamplingParams(max_new_tokens=10, temperature=0.7, seed=3, min_tokens=5)
            await frontend.submit(
                "a", Generate(rid="a", prompt="Hello", sampling=sampling), sink("a")
            )
            first: Submit = ring.recv(timeout_s=5)
            prompt = first.new[0].input_ids
            for token in (11, 12, 13):  # three tokens streamed before the ring fails
                await frontend._apply(RequestDelta("a", token, None, ""))
            frontend.restartable = True
            frontend._ring_failed("stage 1 exited with code -9")
            assert frontend.ring_failure and frontend.ring_error is None  # waits, fails nothing
            frontend.reform(frontend.ring_failure)
            for rid in ("b", "c"):
                await frontend.submit(rid, Generate(rid=rid, prompt="Hi"), sink(rid))
            (refused,) = answers["c"]  # "a" and "b" wait: the limit of 2
            assert isinstance(refused, Error) and refused.code == "overloaded"
            frontend.abort("b")
            await asyncio.sleep(0)
            assert isinstance(answers["b"][-1], Done) and answers["b"][-1].finish_reason == "abort"
            assert not ring.poll(0.2)  # nothing goes to a ring that is not there

            frontend.epoch = 1  # the launcher started ring epoch 1; it is ready
            frontend._replay()
            replay: Submit = ring.recv(timeout_s=5)
            assert replay.epoch == 1
            (again,) = replay.new
            assert again.rid == "a" and again.input_ids == prompt + [11, 12, 13]
            assert again.num_generated == 3  # the penalties count them as its output
            assert again.sampling.min_tokens == 2  # 3 of the 5 are out
            assert again.sampling.max_new_tokens == 7 and again.sampling.seed == 3
            await frontend._apply(RequestDelta("a", 14, None, "length"))
            done = answers["a"][-1]
            assert isinstance(done, Done) and done.completion_tokens == 4
            assert done.prompt_tokens == len(prompt)
        finally:
            frontend.close()

    try:
        asyncio.run(scenario())
    finally:
        ring.close(0)


def test_one_ring_step_reaches_each_client_as_one_zeromq_message(default_model):
    """The frontend bundles what one Deltas message produced for a client: two streams' tokens
    and one stream's Done reach a raw DEALER as a single ZeroMQ message, in order, and another
    client gets its own."""
    import zmq
    from transformers import AutoTokenizer

    from protocol.channels import CLIENT_LIMITS, PushChannel
    from protocol.codec import decode_many, encode
    from protocol.messages import Deltas

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    ring = PullChannel("tcp://127.0.0.1:*")  # stands in for stage 0's intake
    ctx = zmq.Context()

    async def scenario() -> list[list]:
        frontend = _frontend(tokenizer, ring)
        deltas = PushChannel(frontend.deltas.addr)
        clients = [ctx.socket(zmq.DEALER) for _ in range(2)]
        serving = asyncio.create_task(frontend.serve())
        try:
            for client in clients:
                client.connect(frontend.addr)
            sampling = SamplingParams(max_new_tokens=4)
            for rid in ("a", "b"):
                clients[0].send_multipart(encode(Generate(rid=rid, prompt="Hi", sampling=sampling)))
            clients[1].send_multipart(encode(Generate(rid="c", prompt="Hi", sampling=sampling)))
            ring_rids = []
            while len(ring_rids) < 3:
                await asyncio.sleep(0.01)
                while ring.poll(0):
                    ring_rids += [r.rid for r in ring.recv().new]
            by_client = {rid.split("/")[1]: rid for rid in ring_rids}
            deltas.send(
                Deltas(
                    step=0,
                    deltas=[
                        RequestDelta(by_client["a"], 11, None, ""),
                        RequestDelta(by_client["c"], 12, None, ""),
                        RequestDelta(by_client["b"], 13, None, "length"),
                    ],
                )
            )
            received = []
            for client in clients:
                for _ in range(500):
                    if client.poll(0):
                        break
                    await asyncio.sleep(0.01)
                received.append(decode_many(client.recv_multipart(), CLIENT_LIMITS))
                assert not client.poll(200)  # and nothing more
            return received
        finally:
            serving.cancel()
            deltas.close(0)
            for client in clients:
                client.close(0)
            frontend.close()

    try:
        first, second = asyncio.run(scenario())
    finally:
        ring.close(0)
        ctx.term()
    assert [(type(m).__name__, m.rid) for m in first] == [
        ("Chunk", "a"), ("Chunk", "b"), ("Done", "b"),
    ]  # fmt: skip
    assert first[0].token_ids == [11] and first[1].token_ids == [13]
    assert [(type(m).__name__, m.rid, m.token_ids) for m in second] == [("Chunk", "c", [12])]


def _frontend(tokenizer, ring: PullChannel, **kwargs) -> Frontend:
    """A frontend on loopback whose stage 0 is `ring` (a PullChannel the test reads)."""
    return Frontend(
        tokenizer,
        client_addr="tcp://127.0.0.1:*",
        intake_addr=ring.addr,
        deltas_addr="tcp://127.0.0.1:*",
        context_length=2048,
        **kwargs,
    )
