"""Prometheus metrics of node 0's frontend, served at the HTTP server's `GET /metrics`.

Names follow vLLM's (`vllm:time_to_first_token_seconds` is `ppring:time_to_first_token_seconds`)
so a dashboard built for vLLM needs only its prefix changed. One registry per frontend, not
prometheus_client's global one, so two frontends in one process (the tests) never mix counts.
The frontend calls `request_started`, `token` and `request_finished`; nothing here blocks.

What only a pipeline can report comes from the stages' own `StageStats` (ring/report.py), about
once a second, labelled by `stage`: where each stage's time goes (its forward, waiting for the
previous stage's seam, waiting for sampled tokens coming round the ring), its steps and tokens,
and the ring's round trip; the scheduler's running and waiting requests and KV usage come from
stage 0's (every stage's scheduler is the same replica).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.messages import StageStats

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
        # vLLM's names: prompt tokens looked up in the prefix cache, and those found there
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again)."
        )
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
        # A stage that died and the ring that re-formed without it (launch/local.py).
        self.ring_restarts = counter("ring_restarts", "Times the ring re-formed after a failure.")
        self.replayed_requests = counter(
            "replayed_requests", "Requests resubmitted to a re-formed ring."
        )
        self.replayed_prompt_tokens = counter(
            "replayed_prompt_tokens",
            "Tokens resubmitted as prompts to a re-formed ring (prompt and tokens already sent).",
        )
        self.ring_down_seconds = counter(
            "ring_down_seconds", "Time from a stage failing to its ring serving again."
        )
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.inflight,
            self.ring_restarts,
            self.replayed_requests,
            self.replayed_prompt_tokens,
            self.ring_down_seconds,
        ):
            metric.labels(**self.model)  # present (at 0) before the first request
        self.stages = StageMetrics(self.registry, labels)
        self.last_reports: dict[int, StageStats] = {}

    def ring_reformed(self, down_s: float, num_requests: int, num_tokens: int) -> None:
        self.ring_restarts.labels(**self.model).inc()
        self.ring_down_seconds.labels(**self.model).inc(down_s)
        self.replayed_requests.labels(**self.model).inc(num_requests)
        self.replayed_prompt_tokens.labels(**self.model).inc(num_tokens)

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

    def prefix_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's first token: its prompt was looked up, this much of it found."""
        self.prefix_cache_queries.labels(**self.model).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(**self.model).inc(num_cached_tokens)

    def request_finished(self, reason: str, e2e_s: float) -> None:
        self.inflight.labels(**self.model).dec()
        self.request_success.labels(**self.model, finished_reason=reason).inc()
        self.e2e.labels(**self.model).observe(e2e_s)

    def request_failed(self, code: str) -> None:
        self.inflight.labels(**self.model).dec()
        self.request_errors.labels(**self.model, code=code).inc()

    def stage_report(self, report: StageStats) -> None:
        """A stage's cumulative statistics: counters move by what changed since its last report."""
        last = self.last_reports.get(report.rank)
        if last is None or report.steps < last.steps:  # the first, or the stage started again
            last = dataclasses.replace(report, **dict.fromkeys(STAGE_FIELDS, 0))
        self.last_reports[report.rank] = report
        self.stages.update(self.model, last, report)

    def render(self) -> bytes:
        return generate_latest(self.registry)


STAGE_FIELDS = [f.name for f in dataclasses.fields(StageStats) if f.name != "rank"]
# Cumulative StageStats field -> (counter name, help); counters move by the change.
STAGE_COUNTERS = {
    "steps": ("stage_steps", "Steps a stage has run (one per micro-batch slot turn)."),
    "busy_s": ("stage_busy_seconds", "Time in the stage's forward."),
    "proxy_wait_s": ("stage_proxy_wait_seconds", "Time waiting for the previous stage's seam."),
    "output_wait_s": (
        "stage_output_wait_seconds",
        "Time waiting for sampled tokens coming round the ring.",
    ),
    "tokens": ("stage_tokens", "Tokens through the stage's forwards."),
}


@dataclass
class StageMetrics:
    registry: CollectorRegistry
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        stage = (*self.labels, "stage")

        def gauge(name: str, doc: str, labels: tuple[str, ...] = stage) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        self.counters = {
            field: Counter(PREFIX + name, doc, stage, registry=self.registry)
            for field, (name, doc) in STAGE_COUNTERS.items()
        }
        # Since the stage started, as its log says at the end (rate() of the counters gives any
        # window's).
        self.busy_fraction = gauge(
            "stage_busy_fraction", "Share of the stage's time in its forward."
        )
        self.tokens_per_batch = gauge("stage_tokens_per_micro_batch", "Mean tokens per forward.")
        self.round_trip = gauge(
            "ring_round_trip_seconds",
            "Stage 0's mean time from a step's seam sent to its sampled tokens back.",
            self.labels,
        )
        self.running = gauge("num_requests_running", "Requests in a micro-batch.", self.labels)
        self.waiting = gauge("num_requests_waiting", "Requests queued.", self.labels)
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "Share of the KV blocks in use (0 to 1).", self.labels
        )
        self.kv_blocks_used = gauge(
            "stage_kv_blocks_used", "KV blocks in use, as the stage's own scheduler replica has it."
        )

    def update(self, model: dict[str, str], last: StageStats, now: StageStats) -> None:
        stage = {**model, "stage": str(now.rank)}
        for field, counter in self.counters.items():
            counter.labels(**stage).inc(max(getattr(now, field) - getattr(last, field), 0))
        if now.wall_s > 0:
            self.busy_fraction.labels(**stage).set(min(now.busy_s / now.wall_s, 1.0))
        if now.batches:
            self.tokens_per_batch.labels(**stage).set(now.tokens / now.batches)
        if now.round_trips:
            self.round_trip.labels(**model).set(now.round_trip_s / now.round_trips)
        self.kv_blocks_used.labels(**stage).set(now.kv_blocks_used)
        if now.rank == 0:
            self.running.labels(**model).set(now.num_running)
            self.waiting.labels(**model).set(now.num_waiting)
            self.kv_usage.labels(**model).set(now.kv_blocks_used / max(now.kv_blocks_total, 1))
