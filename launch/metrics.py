"""Prometheus metrics of node 0's frontend, served at the HTTP server's `GET /metrics`.

Names follow vLLM's (`vllm:time_to_first_token_seconds` is `ppring:time_to_first_token_seconds`)
so a dashboard built for vLLM needs only its prefix changed. One registry per frontend, not
prometheus_client's global one, so two frontends in one process (the tests) never mix counts.
The frontend calls `request_started`, `token` and `request_finished`; nothing here blocks.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "ppring:"
# Latency buckets (seconds), vLLM's for TTFT and end-to-end, extended down for a CPU ring.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FrontendMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name",)
        self.model = {"model_name": model_name}

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + extra, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests finished, by finish reason.", ("finished_reason",)
        )
        self.request_errors = counter(
            "request_errors", "Requests that ended in an error, by code.", ("code",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS
        )
        self.inflight = Gauge(
            PREFIX + "num_requests_inflight",
            "Requests admitted by the frontend and not yet answered.",
            labels,
            registry=self.registry,
        )
        for metric in (self.prompt_tokens, self.generation_tokens, self.inflight):
            metric.labels(**self.model)  # present (at 0) before the first request

    def request_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(**self.model).inc(num_prompt_tokens)
        self.inflight.labels(**self.model).inc()

    def token(self, since_previous_s: float | None, ttft_s: float | None) -> None:
        """One generated token: `ttft_s` for the first, `since_previous_s` for the others."""
        self.generation_tokens.labels(**self.model).inc()
        if ttft_s is not None:
            self.ttft.labels(**self.model).observe(ttft_s)
        if since_previous_s is not None:
            self.itl.labels(**self.model).observe(since_previous_s)

    def request_finished(self, reason: str, e2e_s: float) -> None:
        self.inflight.labels(**self.model).dec()
        self.request_success.labels(**self.model, finished_reason=reason).inc()
        self.e2e.labels(**self.model).observe(e2e_s)

    def request_failed(self, code: str) -> None:
        self.inflight.labels(**self.model).dec()
        self.request_errors.labels(**self.model, code=code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
