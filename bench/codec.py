"""Micro-benchmark: ppring's codec against pickle, over the same loopback sockets.

    python -m bench.codec [--iters N]

For a decode-sized proxy (T=64, d=576, fp32: two tensors, 288 KiB) and a prefill-sized one
(T=2048: 9 MiB), it times encode + send + recv + decode on a PUSH/PULL pair over loopback TCP,
once with protocol.codec and once with pickle (what SGLang's `send_pyobj` does). pickle lives
here only as the baseline: the project itself never uses it (tests/protocol/test_no_pickle.py).
"""

from __future__ import annotations

import argparse
import pickle  # noqa: S403 - the baseline being measured, never used by ppring itself
import statistics
import time

import torch
import zmq

from protocol.codec import decode, encode
from protocol.messages import Proxy

D_MODEL = 576  # SmolLM2-135M


def make_proxy(num_tokens: int, step: int) -> Proxy:
    return Proxy(
        slot=0,
        step=step,
        digest="0" * 16,
        hidden_states=torch.randn(num_tokens, D_MODEL),
        residual=torch.randn(num_tokens, D_MODEL),
    )


def time_codec(push: zmq.Socket, pull: zmq.Socket, msg: Proxy, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        push.send_multipart(encode(msg), copy=False)
        out = decode(pull.recv_multipart(copy=False))
        out.hidden_states.sum()  # touch the data, as a stage would
        times.append(time.perf_counter() - start)
    return times


def time_pickle(push: zmq.Socket, pull: zmq.Socket, msg: Proxy, iters: int) -> list[float]:
    payload = {
        "slot": msg.slot,
        "step": msg.step,
        "digest": msg.digest,
        "hidden_states": msg.hidden_states,
        "residual": msg.residual,
    }
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        push.send(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
        out = pickle.loads(pull.recv())  # noqa: S301 - baseline only
        out["hidden_states"].sum()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    print(f"{'message':<28}{'bytes':>10}{'ppring µs':>12}{'pickle µs':>12}{'ratio':>8}")
    for label, num_tokens, iters in (
        ("decode proxy T=64", 64, args.iters),
        ("prefill proxy T=2048", 2048, max(args.iters // 10, 5)),
    ):
        msg = make_proxy(num_tokens, 0)
        nbytes = 2 * msg.hidden_states.numel() * 4
        # Warm up both paths, then alternate rounds so drift hits both alike.
        time_codec(push, pull, msg, 3)
        time_pickle(push, pull, msg, 3)
        ours, theirs = [], []
        for _ in range(5):
            ours += time_codec(push, pull, msg, iters // 5)
            theirs += time_pickle(push, pull, msg, iters // 5)
        ours_us = statistics.median(ours) * 1e6
        theirs_us = statistics.median(theirs) * 1e6
        print(
            f"{label:<28}{nbytes:>10}{ours_us:>12.0f}{theirs_us:>12.0f}{ours_us / theirs_us:>7.2f}x"
        )
    print("ratio = ppring time / pickle time (median; below 1 is faster)")
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
