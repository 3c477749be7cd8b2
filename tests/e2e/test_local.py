"""`ppring local` on the default model, against transformers and under load and failure."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import msgpack
import pytest

from launch.client import AsyncClient, Client, RequestError
from launch.procs import ROOT
from protocol.channels import ChannelTimeout
from protocol.codec import PROTOCOL_VERSION, encode
from protocol.messages import Chunk, Done, Error, Generate
from protocol.sampling import SamplingParams
from protocol.schema import to_wire
from stages.backend.switches import AMX_ROWS_ENV
from tests.e2e.conftest import PROMPTS


async def greedy_all(addr: str, prompts: list[str]) -> dict[str, list[int]]:
    async with AsyncClient(addr, timeout_s=120) as client:
        results = await asyncio.gather(
            *(client.complete(p, max_new_tokens=32, temperature=0) for p in prompts)
        )
    return {p: r.token_ids for p, r in zip(prompts, results)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("pp_size", "partition"),
    # PP=3 is long; its short form is tests/ring/test_real_ring.py's PP=3 ring of real stages.
    [(1, None), (2, None), pytest.param(3, None, marks=pytest.mark.long), (2, "10,20")],
)
def test_greedy_tokens_equal_transformers(start_local, hf_greedy, pp_size, partition, monkeypatch):
    if partition:
        monkeypatch.setenv("PPRING_LAYER_PARTITION", partition)
    # float32 explicitly: `auto` is bf16 on a CPU with native bf16, and parity with
    # transformers' fp32 tokens is an fp32 promise (bf16 has its own tolerance tests)
    server = start_local("--pp-size", str(pp_size), "--dtype", "float32")
    got = asyncio.run(greedy_all(server.addr, PROMPTS))
    for prompt in PROMPTS:
        assert got[prompt] == hf_greedy[prompt], prompt
    if pp_size == 2 and partition is None:  # and through the command a user types
        from transformers import AutoTokenizer

        from launch.prepare_model import prepare_default_model

        tokenizer = AutoTokenizer.from_pretrained(prepare_default_model(quiet=True))
        cli = subprocess.run(
            [sys.executable, "-m", "launch", "generate", "--addr", server.addr,
             "--temperature", "0", "--max-new-tokens", "32", PROMPTS[0]],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        expected = tokenizer.decode(hf_greedy[PROMPTS[0]], skip_special_tokens=True)
        assert cli.stdout == expected + "\n"


@pytest.mark.timeout(400)
def test_32_concurrent_clients_get_what_they_get_alone(start_local, monkeypatch):
    # the default dtype, batch-invariant: a sequence's tokens must not depend on its batch in
    # fp32 or in bf16 (where `auto` picks bf16, its matmuls are ppring's vector kernels, whose
    # row sums run in one order whatever the batch; oneDNN chooses its kernel by the row count).
    # On a CPU with AMX the default moves large calls to the tiles, whose sums differ by a bf16
    # rounding: PPRING_AMX_ROWS=0 is the mode that promises this (docs/engine.md).
    monkeypatch.setenv(AMX_ROWS_ENV, "0")
    server = start_local("--pp-size", "2")
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(32)]
    with Client(server.addr) as client:
        alone = {p: client.complete(p, max_new_tokens=8, temperature=0).text for p in prompts}
        seeded_alone = client.complete(PROMPTS[2], max_new_tokens=8, temperature=0.9, seed=7).text

    async def crowd():
        async with AsyncClient(server.addr) as client:
            tasks = [client.complete(p, max_new_tokens=8, temperature=0) for p in prompts]
            tasks.append(client.complete(PROMPTS[2], max_new_tokens=8, temperature=0.9, seed=7))
            return await asyncio.gather(*tasks)

    results = asyncio.run(crowd())
    for prompt, result in zip(prompts, results):
        assert result.text == alone[prompt], prompt
    assert results[-1].text == seeded_alone  # a seeded request is its own, whatever the batch
    assert all(r.done.finish_reason in ("length", "stop") for r in results)
    stage_pids = subprocess.run(
        ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert server.stop() == 0  # SIGTERM: a graceful shutdown round the ring
    for pid in stage_pids:  # and no orphans
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


def raw_generate(**fields) -> list[bytes]:
    """A generate message as a hostile or buggy client might send it: no client-side checks."""
    header = {
        "v": PROTOCOL_VERSION,
        "kind": "generate",
        "rid": "raw",
        "prompt": None,
        "messages": None,
        "input_ids": None,
        "sampling": to_wire(SamplingParams()),
        "stop": [],
        "tensors": [],
    }
    header.update(fields)
    return [msgpack.packb(header)]


@pytest.mark.timeout(300)
def test_bad_requests_get_an_error_and_disturb_nothing(start_local):
    server = start_local("--pp-size", "2")
    bad_sampling = dict(to_wire(SamplingParams()), top_p=0.0)
    with Client(server.addr) as client:
        for frames, words in [
            (raw_generate(prompt=""), "empty"),
            (raw_generate(prompt="hi", colour="red"), "unknown field 'colour'"),
            (raw_generate(prompt="hi", sampling=bad_sampling), "top_p"),
            (raw_generate(prompt=7), "must be a string"),
            ([b"\xc1not msgpack"], "msgpack"),
        ]:
            client.channel.sock.send_multipart(frames)
            answer = client.channel.recv(timeout_s=30)
            assert isinstance(answer, Error) and answer.code == "bad_request"
            assert words in answer.message
        with pytest.raises(RequestError, match="context length"):
            list(client.generate("hi " * 10, max_new_tokens=8190))
        with pytest.raises(RequestError, match="vocabulary"):
            list(client.generate(input_ids=[10**7]))
        ok = client.complete("The capital of France is", max_new_tokens=8, temperature=0)
        assert ok.done.completion_tokens == 8


@pytest.mark.timeout(300)
def test_killing_a_stage_errors_every_client_and_the_launcher_exits_nonzero(start_local):
    """Fail-stop, as vLLM and SGLang: --max-stage-restarts 0 (test_restart.py: the default)."""
    server = start_local("--pp-size", "2", "--max-stage-restarts", "0")
    stage_pids = [
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]
    assert len(stage_pids) == 2

    async def stream_then_kill():
        async with AsyncClient(server.addr, timeout_s=60) as client:

            async def one(i: int):
                try:
                    await client.complete(f"Story {i}:", max_new_tokens=2000, ignore_eos=True)
                except RequestError as exc:
                    return exc.code, time.monotonic()
                return "finished", time.monotonic()

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.sleep(3)
            killed_at = time.monotonic()
            os.kill(stage_pids[1], signal.SIGKILL)
            return killed_at, await asyncio.gather(*tasks)

    killed_at, outcomes = asyncio.run(stream_then_kill())
    for code, at in outcomes:
        assert code == "ring_down"
        assert at - killed_at < 5.0
    assert server.proc.wait(10) != 0


@pytest.mark.timeout(300)
def test_2000_malformed_client_messages_while_serving(start_local):
    from tests.protocol.test_fuzz import mutate, random_junk

    server = start_local("--pp-size", "2")
    rng = random.Random(21)
    valid = [bytes(f) for f in encode(Generate(rid="v", prompt="Hi", sampling=SamplingParams(4)))]
    kinds = [
        lambda: random_junk(rng),
        lambda: mutate(valid, rng),
        lambda: [bytes(f) for f in encode(Done("x", "stop", 1, 1, 0.0, 0.0, 0.0))],  # wrong way
        lambda: raw_generate(prompt="hi", sampling=dict(to_wire(SamplingParams()), top_k=0)),
        lambda: raw_generate(input_ids=[-5]),
    ]
    with Client(server.addr) as client:
        reference = client.complete("The capital of France is", max_new_tokens=6, temperature=0)
        sock = client.channel.sock
        replies = []
        for burst in range(10):  # each burst ends with a 0.3 s drain: few, large bursts
            for _ in range(200):
                frames = rng.choice(kinds)()
                if frames:
                    sock.send_multipart(frames)
            while True:  # drain until the frontend has answered everything it will
                try:
                    replies.append(client.channel.recv(timeout_s=0.3))
                except ChannelTimeout:
                    break
            again = client.complete("The capital of France is", max_new_tokens=6, temperature=0)
            assert again.text == reference.text, burst
        errors = [r for r in replies if isinstance(r, Error)]
        assert len(errors) > 1500
        assert all(e.code == "bad_request" for e in errors)
        # A mutation that happens to be a valid request is served like any other.
        assert all(isinstance(r, (Error, Chunk, Done)) for r in replies)
    assert server.proc.poll() is None
