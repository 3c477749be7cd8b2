from __future__ import annotations

import random

import pytest
import torch
import zmq

from protocol.channels import PullChannel, PushChannel
from protocol.messages import (
    Abort,
    ChatMessage,
    Chunk,
    Deltas,
    Done,
    Error,
    Generate,
    Heartbeat,
    NewRequest,
    NodeHello,
    NodeHosts,
    Output,
    Ping,
    Pong,
    Proxy,
    Reqs,
    RequestDelta,
    RingError,
    RingReady,
    Share,
    Shutdown,
    StageHello,
    StopServing,
    Submit,
)
from protocol.sampling import SamplingParams


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def link(ctx):
    """A ring link over loopback TCP on a port the OS picks."""
    pull = PullChannel("tcp://127.0.0.1:*", ctx=ctx)
    push = PushChannel(pull.addr, ctx=ctx)
    yield push, pull
    push.close(linger_ms=0)
    pull.close(linger_ms=0)


def sample_messages() -> list:
    """One or more instances of every kind, with non-default values in every field."""
    sampling = SamplingParams(
        max_new_tokens=7,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"0": -100.0, "12": 2.5},
        seed=2**62,
        stop_token_ids=[2, 3],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
    )
    return [
        Reqs(
            slot=1,
            step=5,
            new=[NewRequest(rid="r1", input_ids=[1, 2, 3], sampling=sampling, num_generated=1)],
            aborts=["r0"],
        ),
        Reqs(slot=0, step=0),
        Proxy(
            slot=2,
            step=9,
            digest="d1",
            hidden_states=torch.randn(5, 8),
            residual=torch.randn(5, 8),
        ),
        Output(slot=3, step=11, digest="d2", token_ids=[4, 5], logprobs=[-0.5, -1.25]),
        Output(
            slot=3,
            step=12,
            digest="d3",
            token_ids=[4, 5],
            logprobs=[-0.5, -1.25],
            epoch=2,
            top_ids=[[4, 9], []],
            top_logprobs=[[-0.5, -1.5], []],
        ),
        Output(slot=0, step=0, digest="", token_ids=[]),
        Share(
            slot=1,
            step=7,
            digest="d3",
            hidden=torch.randn(3, 8),
            logits=torch.empty(0),
            best_logit=torch.randn(3),
            best_token=torch.tensor([7, 9, 11]),
        ),
        Share(
            slot=0,
            step=4,
            digest="d4",
            hidden=torch.randn(2, 8, dtype=torch.bfloat16),
            logits=torch.randn(2, 12, dtype=torch.bfloat16),
            best_logit=torch.empty(0),
            best_token=torch.empty(0, dtype=torch.int64),
        ),
        Heartbeat(rank=2, seq=17),
        StageHello(
            rank=0,
            num_kv_blocks=9,
            config_hash="h",
            pp_loop_size=2,
            context_length=64,
            split_lm_head=True,
            max_running_requests=8,
            pp_max_micro_batch_size=4,
            chunked_prefill_size=128,
        ),
        RingReady(rank=0, num_kv_blocks=9),
        Shutdown(rank=0, step=3),
        RingError(rank=1, message="stage 1 failed"),
        NodeHello(
            rank=1,
            host="10.0.0.2",
            config_hash="h",
            partition=[15, 15],
            nnodes=2,
            port=30000,
            ring_flags={"addrs": ["tcp://a:1"], "n": 3, "x": None},
        ),
        NodeHosts(rank=0, hosts=["10.0.0.1", "10.0.0.2"]),
        Submit(seq=4, new=[NewRequest(rid="r2", input_ids=[7], sampling=sampling)], aborts=["r1"]),
        StopServing(),
        Deltas(
            step=4,
            deltas=[
                RequestDelta(rid="a", token_id=5, logprob=-0.5, finish_reason=""),
                RequestDelta("c", 5, -0.5, "", "", top_ids=[5, 1], top_logprobs=[-0.5, -2.0]),
                RequestDelta(
                    rid="b", token_id=None, logprob=None, finish_reason="error", error="x"
                ),
            ],
        ),
        Generate(rid="g1", prompt="héllo ✓", sampling=sampling, stop=["\n\n"]),
        Generate(rid="g2", messages=[ChatMessage(role="user", content="hi")]),
        Generate(rid="g3", input_ids=[10, 11]),
        Abort(rid="g1"),
        Ping(rid="p1"),
        Pong(rid="p1"),
        Chunk(rid="g1", text="wörld", token_ids=[7, 8], logprobs=[-0.1, -0.2]),
        Chunk("g1", "!", [7], [-0.1], top_ids=[[7, 3, 2]], top_logprobs=[[-0.1, -3.0, -4.5]]),
        Done(
            rid="g1",
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=7,
            ttft_s=0.25,
            tpot_s=0.05,
            e2e_s=0.6,
        ),
        Error(rid="", code="bad_request", message="the prompt is empty"),
    ]


def random_proxy(rng: random.Random, step: int = 0, loop_size: int = 4) -> Proxy:
    num_tokens = rng.randint(0, 6)
    return Proxy(
        slot=step % loop_size,
        step=step,
        digest=f"{rng.getrandbits(64):016x}",
        hidden_states=torch.randn(num_tokens, 4),
        residual=torch.randn(num_tokens, 4),
    )
