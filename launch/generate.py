"""`ppring generate [--addr ...] [--chat] PROMPT`: stream one completion to stdout."""

from __future__ import annotations

import argparse
import sys

from launch.client import DEFAULT_ADDR, Client, FrontendUnreachable, RequestError
from protocol.curve import client_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ppring generate", description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--addr", default=DEFAULT_ADDR)
    parser.add_argument("--chat", action="store_true", help="send as a user chat message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--usage", action="store_true", help="print usage and timings after")
    parser.add_argument(
        "--server-key", help="CURVE: the frontend node's public key file (node0.key)"
    )
    parser.add_argument("--curve-key", help="CURVE: this client's key pair (NAME.key_secret)")
    args = parser.parse_args(argv)
    if bool(args.server_key) != bool(args.curve_key):
        parser.error("--server-key and --curve-key go together: CURVE needs both")
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    request = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    try:
        security = client_keys(args.server_key, args.curve_key) if args.server_key else None
        with Client(args.addr, timeout_s=args.timeout, security=security) as client:
            for chunk in client.generate(**request, stop=args.stop, **sampling):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            done = client.last_done
    except (RequestError, TimeoutError, ValueError, FrontendUnreachable) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    if args.usage and done is not None:
        print(
            f"[{done.finish_reason}] prompt {done.prompt_tokens} tokens "
            f"({done.cached_tokens} cached), completion "
            f"{done.completion_tokens} tokens, TTFT {done.ttft_s * 1000:.0f} ms, "
            f"TPOT {done.tpot_s * 1000:.1f} ms",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
