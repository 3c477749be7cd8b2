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
        frontend = Frontend(
            tokenizer,
            client_addr="tcp://127.0.0.1:*",
            intake_addr=ring.addr,
            deltas_addr="tcp://127.0.0.1:*",
            context_length=2048,
            max_held_requests=2,
        )
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
