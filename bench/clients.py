"""The two ways `ppring bench serve` sends a request: ppring's own ZeroMQ client, or the OpenAI
HTTP API of any server that speaks it (ppring's, vLLM's, SGLang's).

Both send the workload's token ids with greedy sampling and `ignore_eos` (vLLM's and SGLang's
extension too), stream the answer, and record what the client sees: the time to the first
token, the time per output token after it, and the end-to-end time. Output tokens are counted
by the server's own account (ppring's `done`, the OpenAI stream's final `usage`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.workload import Request


def record(request: Request, sent: float, first: float | None, n: int) -> dict[str, Any]:
    finished = time.perf_counter()
    first = first or finished
    return {
        "prompt_tokens": len(request.input_ids),
        "output_tokens": n,
        "ttft_s": first - sent,
        # One token has no time per output token: None, left out of the TPOT percentiles.
        "tpot_s": (finished - first) / (n - 1) if n > 1 else None,
        "e2e_s": finished - sent,
    }


class NativeBackend:
    """ppring's ZeroMQ client (launch/client.py) on the frontend's address."""

    def __init__(self, addr: str) -> None:
        self.addr = addr

    async def __aenter__(self) -> NativeBackend:
        from launch.client import AsyncClient

        self.client = await AsyncClient(self.addr, timeout_s=600).__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    async def request(self, request: Request, progress) -> dict[str, Any]:
        sent, first, done = time.perf_counter(), None, None
        async for msg in self.client.generate(
            input_ids=request.input_ids,
            max_new_tokens=request.max_new_tokens,
            temperature=0.0,
            ignore_eos=True,
        ):
            if getattr(msg, "token_ids", None):
                first = first or time.perf_counter()
                progress.update(len(msg.token_ids))
            if msg.kind == "done":
                done = msg
        return record(request, sent, first, done.completion_tokens)


class OpenAIBackend:
    """`POST /v1/completions` with `stream: true` on an OpenAI-compatible server."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def __aenter__(self) -> OpenAIBackend:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            base_url=self.base_url, timeout=600, limits=limits, headers=self.headers
        )
        if self.model is None:
            models = (await self.http.get("/models")).raise_for_status().json()
            self.model = models["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def request(self, request: Request, progress) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": request.input_ids,
            "max_tokens": request.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, first, usage = time.perf_counter(), None, None
        async for event in self.events("/completions", body):
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0].get("text"):
                first = first or time.perf_counter()
                progress.update(1)
        if usage is None:
            raise RuntimeError(f"{self.base_url} sent no usage: it ignores stream_options")
        return record(request, sent, first, usage["completion_tokens"])

    async def events(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The events of a streamed answer to `body` posted to `path`, as JSON."""
        async with self.http.stream("POST", path, json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                raise RuntimeError(f"{self.base_url}: {answer.status_code} {answer.text[:300]}")
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
