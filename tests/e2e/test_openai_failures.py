"""The OpenAI API's failure paths, with the official `openai` package as the client: a ring not
ready yet or gone down answers 503, a ring that fails mid-stream ends the stream with an error, a
client that drops a request has it aborted in the ring, refused fields get 400 in OpenAI's error
shape, max_completion_tokens is honoured, and the latency histograms count what was served.

Simulated stages (ring/sim_stage.py) stand behind the API: the HTTP layer does not depend on the
model, their steps burn no CPU, and they never sample EOS, so a request runs to its token limit
unless something ends it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import local
from launch.frontend import Frontend
from launch.metrics import FrontendMetrics
from launch.openai_api import HttpServer, build_app
from launch.procs import ProcessGroup, find_free_base_port
from ring.topology import RingAddresses
from tests.e2e.conftest import PROMPTS, LocalServer
from tests.e2e.test_orphans import alive, children_of

SIM = ["--stage-impl", "sim", "--sim-t0-ms", "20"]
CHAT = [{"role": "user", "content": "Name three colors."}]
LONG = 4000  # tokens: minutes of a simulated ring's steps, so only an abort or a failure ends it
TTFT = "ppring:time_to_first_token_seconds"
ITL = "ppring:inter_token_latency_seconds"
E2E = "ppring:e2e_request_latency_seconds"


# -- helpers -------------------------------------------------------------------------------------


def scrape(http_url: str) -> list:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def total(samples: list, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def delta(before: list, after: list, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.05)


def health(http_url: str) -> httpx.Response:
    return httpx.get(f"{http_url}/health", timeout=10)


def openai_client(http_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="none", max_retries=0, timeout=120)


def assert_unavailable(exc: openai.APIStatusError, says: str) -> None:
    """A 503 in OpenAI's error shape whose message holds `says`."""
    assert exc.status_code == 503
    assert set(exc.response.json()) == {"error"}
    message = exc.body["message"]
    assert exc.body == {"message": message, "type": "unavailable", "param": None, "code": 503}
    assert says in message, exc.body


class Call:
    """One blocking client call in a thread: its result or its exception, once it returns."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the call did not return within {timeout_s:.0f} s"


# -- one ring for the module (restarts on, as by default) -----------------------------------------


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    server = LocalServer(
        ["--pp-size", "2", *SIM, "--served-model-name", "smol"],
        tmp_path_factory.mktemp("openai-failures"),
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(ring):
    with openai_client(ring.http_url) as c:
        yield c


@pytest.mark.timeout(60)
def test_refused_fields_get_400_in_openai_error_shape(ring, client):
    before = scrape(ring.http_url)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    refused = {
        "tools": lambda: client.chat.completions.create(
            model="smol", messages=CHAT, max_tokens=4, tools=[tool]
        ),
        "response_format": lambda: client.chat.completions.create(
            model="smol", messages=CHAT, max_tokens=4, response_format={"type": "json_object"}
        ),
        "suffix": lambda: client.completions.create(
            model="smol", prompt=PROMPTS[0], max_tokens=4, suffix="!"
        ),
    }
    for param, call in refused.items():
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        exc = caught.value
        assert exc.status_code == 400
        assert set(exc.response.json()) == {"error"}
        assert exc.body == {
            "message": f"{param} {'are' if param == 'tools' else 'is'} not supported",
            "type": "invalid_request_error",
            "param": param,
            "code": 400,
        }
    # Refused before the ring: nothing was admitted.
    assert delta(before, scrape(ring.http_url), "ppring:prompt_tokens_total") == 0


@pytest.mark.timeout(120)
def test_max_completion_tokens_is_honoured(ring, client):
    whole = client.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=5)
    assert whole.usage.completion_tokens == 5 and whole.choices[0].finish_reason == "length"
    # It is max_tokens' successor: given both, it wins (OpenAI's and vLLM's rule).
    both = client.chat.completions.create(
        model="smol", messages=CHAT, max_completion_tokens=3, max_tokens=9
    )
    assert both.usage.completion_tokens == 3
    events = list(
        client.chat.completions.create(
            model="smol",
            messages=CHAT,
            max_completion_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="beyond the context length"):
        client.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=9000)


@pytest.mark.timeout(120)
def test_latency_histograms_count_what_was_served(ring, client):
    before = scrape(ring.http_url)
    served: list[int] = []  # completion tokens of each request in the ring
    for max_tokens in (4, 6, 8):
        answer = client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=max_tokens)
        served.append(answer.usage.completion_tokens)
    events = list(
        client.completions.create(
            model="smol",
            prompt=PROMPTS[2],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    served.append(events[-1].usage.completion_tokens)
    pair = client.chat.completions.create(model="smol", messages=CHAT, n=2, max_tokens=3)
    served += [3, 3]  # two requests in the ring; usage adds their tokens
    assert pair.usage.completion_tokens == 6
    assert served == [4, 6, 8, 5, 3, 3]
    # Each answer's last token was counted before its answer went out: no wait is needed.
    after = scrape(ring.http_url)
    assert delta(before, after, f"{TTFT}_count") == len(served)  # one first token each
    assert delta(before, after, f"{ITL}_count") == sum(served) - len(served)  # the gaps
    assert delta(before, after, f"{E2E}_count") == len(served)
    assert delta(before, after, "ppring:generation_tokens_total") == sum(served)
    assert delta(before, after, "ppring:request_success_total", finished_reason="length") == 6
    # One timeline: a request's first token and the gaps after it add up to no more than its
    # end to end, so the sums do too.
    ttft, itl, e2e = (delta(before, after, f"{name}_sum") for name in (TTFT, ITL, E2E))
    assert 0 < ttft and 0 < itl
    assert ttft + itl <= e2e + 1e-6
    for name in (TTFT, ITL, E2E):  # every observation fell in some bucket
        assert delta(before, after, f"{name}_bucket", le="+Inf") == delta(
            before, after, f"{name}_count"
        )


@pytest.mark.timeout(120)
def test_a_dropped_whole_request_is_aborted_in_the_ring(ring):
    before = scrape(ring.http_url)

    def generated() -> float:
        return delta(before, scrape(ring.http_url), "ppring:generation_tokens_total")

    def aborted() -> float:
        now = scrape(ring.http_url)
        return delta(before, now, "ppring:request_success_total", finished_reason="abort")

    async def drop() -> None:
        base = f"{ring.http_url}/v1"
        async with openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0) as c:
            call = asyncio.create_task(
                c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=LONG)
            )
            # In the ring and generating, then dropped (as a client's own timeout would).
            await asyncio.to_thread(wait_until, lambda: generated() >= 3, 60, "tokens flowing")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # Still inside the client: the cancelled call closed its connection by itself.
            await asyncio.to_thread(wait_until, lambda: aborted() == 1, 30, "aborted in the ring")

    asyncio.run(drop())
    after = scrape(ring.http_url)
    assert total(after, "ppring:num_requests_inflight") == 0
    tokens = delta(before, after, "ppring:generation_tokens_total")
    assert 3 <= tokens < LONG  # aborted, not run out
    # What it was served before the abort is counted as served.
    assert delta(before, after, f"{TTFT}_count") == 1
    assert delta(before, after, f"{ITL}_count") == tokens - 1
    assert delta(before, after, f"{E2E}_count") == 1


@pytest.mark.timeout(180)
def test_a_request_sent_while_the_ring_re_forms_waits_for_it(ring, client):
    """After a stage dies, the launcher starts the ring again. /health says 503 meanwhile, but a
    request is not refused: the frontend holds it and replays it to the new ring, as it does a
    ZeroMQ client's. The new stages are held stopped (SIGSTOP) until the request is in, so it
    surely arrives while the ring re-forms."""
    before = scrape(ring.http_url)
    old = set(children_of(ring.proc.pid))
    assert len(old) == 2  # the two stages
    os.kill(max(old), signal.SIGKILL)
    new: list[int] = []

    def new_stages_started() -> bool:
        new[:] = [pid for pid in children_of(ring.proc.pid) if pid not in old]
        return len(new) == 2

    wait_until(new_stages_started, 60, "the launcher started two new stages")
    for pid in new:
        os.kill(pid, signal.SIGSTOP)
    try:
        answer = health(ring.http_url)
        assert answer.status_code == 503, "the new stages were ready before they were stopped"
        assert answer.json()["error"]["message"] == "the ring is re-forming"
        call = Call(
            lambda: client.completions.create(model="smol", prompt=PROMPTS[3], max_tokens=5)
        )
        wait_until(
            lambda: total(scrape(ring.http_url), "ppring:num_requests_inflight") == 1,
            30,
            "the request held by the frontend",
        )
    finally:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    call.join(120)
    assert call.error is None, call.error
    assert call.result.usage.completion_tokens == 5
    assert delta(before, scrape(ring.http_url), "ppring:replayed_requests_total") == 1
    assert not any(alive(pid) for pid in old)
    assert health(ring.http_url).status_code == 200


# -- the API before its ring, and after it -------------------------------------------------------


class ApiBeforeRing:
    """Node 0's frontend and OpenAI API as `ppring local` wires them, served from a thread of
    this process, with no ring behind them until the test starts one: two simulated stages,
    started and stopped by PID, and no launcher to restart them. A stage that dies is found by
    the ring itself (stage 0 hears nothing from it for --ring-timeout) and reported to the
    frontend, as on node 0 of `ppring serve` when another node's stage dies."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        port = find_free_base_port(16)
        flags = ["--model", str(model_dir), "--pp-size", "2", *SIM, "--ring-timeout", "5"]
        self.args = local.parse_args([*flags, "--port", str(port), "--http-port", str(port + 15)])
        self.model_dir, self.log_dir = model_dir, log_dir
        self.http_url = f"http://127.0.0.1:{port + 15}"
        self.stages = ProcessGroup()
        self.up = threading.Event()
        self.failure: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="api", daemon=True)
        self.thread.start()
        if not self.up.wait(120):
            raise TimeoutError("the API did not start")
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            self.failure = exc
        finally:
            self.up.set()

    async def _serve(self) -> None:
        from transformers import AutoTokenizer

        startup = local.summary(self.args, self.model_dir)
        addrs = RingAddresses(2, hosts=(self.args.host,), base_port=self.args.port)
        metrics = FrontendMetrics("smol")
        frontend = Frontend(
            AutoTokenizer.from_pretrained(self.model_dir),
            client_addr=addrs.frontend(),
            intake_addr=addrs.intake(),
            deltas_addr=addrs.deltas(),
            context_length=startup.context_length,
            metrics=metrics,
        )
        http = HttpServer(build_app(frontend, "smol", metrics), "127.0.0.1", self.args.http_port)
        self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
        http.start()
        serve = asyncio.create_task(frontend.serve())  # ends when the ring does; the API not
        self.up.set()
        try:
            await self.stopping.wait()
        finally:
            await http.stop()
            serve.cancel()
            await asyncio.gather(serve, return_exceptions=True)
            frontend.close()

    def start_ring(self) -> None:
        for rank in range(2):
            argv = local.stage_argv(self.args, rank, self.model_dir)
            self.stages.start(argv, self.log_dir / f"stage{rank}.log")

    def stop(self) -> None:
        try:
            self.stages.stop()
        finally:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.stopping.set)
            self.thread.join(30)


@pytest.fixture
def api_before_ring(default_model, tmp_path):
    api = ApiBeforeRing(default_model, tmp_path)
    try:
        yield api
    finally:
        api.stop()


def assert_new_requests_refused(client: openai.OpenAI, message: str) -> None:
    """A whole completion and a streamed chat are both refused with 503 before admission."""
    for call in (
        lambda: client.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=4),
        lambda: client.chat.completions.create(
            model="smol", messages=CHAT, max_tokens=4, stream=True
        ),
    ):
        with pytest.raises(openai.InternalServerError) as caught:
            call()
        assert_unavailable(caught.value, message)


@pytest.mark.timeout(180)
def test_the_api_answers_503_until_its_ring_is_ready(api_before_ring):
    api = api_before_ring
    answer = health(api.http_url)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "the ring is starting"
    with openai_client(api.http_url) as client:
        assert [m.id for m in client.models.list().data] == ["smol"]  # what it will serve
        assert_new_requests_refused(client, "not serving: the ring is starting")
        assert total(scrape(api.http_url), "ppring:prompt_tokens_total") == 0  # none admitted
        api.start_ring()
        wait_until(lambda: health(api.http_url).status_code == 200, 120, "the ring ready")
        answer = client.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=4)
        assert answer.usage.completion_tokens == 4


@pytest.mark.timeout(180)
def test_a_ring_that_goes_down_fails_what_is_in_flight_and_refuses_what_comes(api_before_ring):
    api = api_before_ring
    api.start_ring()
    wait_until(lambda: health(api.http_url).status_code == 200, 120, "the ring ready")
    with openai_client(api.http_url) as client:
        events: list = []

        def stream() -> None:
            for event in client.completions.create(
                model="smol", prompt=PROMPTS[1], max_tokens=LONG, stream=True
            ):
                events.append(event)

        streamed = Call(stream)
        whole = Call(
            lambda: client.completions.create(model="smol", prompt=PROMPTS[2], max_tokens=LONG)
        )
        wait_until(
            lambda: (
                len(events) >= 3
                and total(scrape(api.http_url), "ppring:num_requests_inflight") == 2
            ),
            60,
            "both requests generating",
        )
        before = scrape(api.http_url)
        os.kill(api.stages.procs[1].pid, signal.SIGKILL)
        # The stream ends with an error event, which the client raises; nothing hangs.
        streamed.join(60)
        assert isinstance(streamed.error, openai.APIError), streamed.error
        message = streamed.error.message
        assert "the ring went down" in message
        shape = {"message": message, "type": "unavailable", "param": None, "code": 503}
        assert streamed.error.body == shape  # a whole answer's error shape
        whole.join(60)
        assert isinstance(whole.error, openai.InternalServerError), whole.error
        assert_unavailable(whole.error, "the ring went down")
        # And from now on: 503, before anything is admitted.
        assert_new_requests_refused(client, "not serving: ")
    answer = health(api.http_url)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"].startswith("the ring is down: ")
    after = scrape(api.http_url)
    assert delta(before, after, "ppring:request_errors_total", code="ring_down") == 2
    assert delta(before, after, "ppring:prompt_tokens_total") == 0
    assert total(after, "ppring:num_requests_inflight") == 0


@pytest.mark.timeout(180)
def test_under_ppring_local_a_dead_stage_ends_the_streams_with_an_error(start_local):
    """Restarts off: the launcher fails every request in flight and exits 1. A stream open at
    that moment ends with the error, not a dropped connection, and the launcher does not wait
    on it."""
    restarts_off = ["--max-stage-restarts", "0", "--served-model-name", "smol"]
    server = start_local("--pp-size", "2", *SIM, *restarts_off)
    with openai_client(server.http_url) as client:
        events: list = []

        def stream() -> None:
            for event in client.chat.completions.create(
                model="smol", messages=CHAT, max_tokens=LONG, stream=True
            ):
                events.append(event)

        streamed = Call(stream)
        wait_until(lambda: len(events) >= 3, 60, "the stream flowing")
        os.kill(max(children_of(server.proc.pid)), signal.SIGKILL)
        streamed.join(60)
    assert isinstance(streamed.error, openai.APIError), streamed.error
    assert re.search(r"the ring went down: stage \d exited with code -9", streamed.error.message)
    assert "restarts are off" in streamed.error.message
    assert server.proc.wait(60) == 1
