"""The OpenAI-compatible HTTP API on node 0, next to the ZeroMQ frontend and sharing its path.

    POST /v1/completions, /v1/chat/completions   (streamed as server-sent events or not)
    GET  /v1/models, /health, /metrics            POST /tokenize, /detokenize

FastAPI on uvicorn with uvloop, the stack vLLM and SGLang serve their OpenAI APIs with, run as
one more task of the frontend's asyncio loop: a request here is tokenized by the frontend and
submitted exactly as a ZeroMQ client's is (`Frontend.submit`), its answers arrive on a queue.
The request bodies follow OpenAI's (`presence_penalty`, `frequency_penalty` and `logit_bias`
included), with vLLM's extensions a user of vLLM sends (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids`). `n` samples of a prompt (and /v1/completions' list of
prompts) are that many requests in the ring, answered as one (launch/openai_answers.py).
Anything else, or a value this engine cannot honour (tools, a response format), is
refused with an OpenAI-shaped error and the status a client expects, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from launch.frontend import Frontend
from launch.metrics import CONTENT_TYPE, FrontendMetrics
from launch.openai_answers import AnswerShape
from protocol.errors import ProtocolError
from protocol.messages import ChatMessage, Chunk, Done, Error, Generate
from protocol.sampling import MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a whole context of text is under 100 KB; 4 MiB is generous
# Choices one request may ask for (n x prompts): each is a request in the ring.
MAX_CHOICES = 128
# The ring's error codes and the HTTP status each one is answered with.
ERROR_STATUS = {
    "ring_down": 503,
    "overloaded": 503,  # the ring is re-forming and holds as many requests as it may
    "rejected": 400,
    "bad_request": 400,
    "internal": 500,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; `param` names the
    request field at fault, where one is; `code` is the HTTP status (vLLM's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status)


# -- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """What both endpoints take. Extra fields are refused (a typo must not be ignored), and
    types are strict: "yes" is not a bool, "10" not a count."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatTurn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ChatContentPart]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatTurn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


def _unsupported(req: _Common) -> tuple[str, str] | None:
    """The first field set to something this engine cannot do: (its name, why in a sentence);
    None if none."""
    checks = [
        (not 1 <= req.n <= MAX_CHOICES, "n", f"n must be in [1, {MAX_CHOICES}]"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            (
                req.echo and req.logprobs is not None,
                "echo",
                "echo with logprobs needs the prompt's logprobs, which are not computed here",
            ),
            (
                req.best_of not in (None, req.n),
                "best_of",
                "best_of must equal n: choices are not ranked here",
            ),
            (req.suffix is not None, "suffix", "suffix is not supported"),
            (
                req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS,
                "logprobs",
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
    else:
        checks += [
            (bool(req.tools), "tools", "tools are not supported"),
            (
                req.response_format not in (None, {"type": "text"}),
                "response_format",
                "response_format is not supported",
            ),
        ]
    return next(((param, why) for bad, param, why in checks if bad), None)


# -- the app -----------------------------------------------------------------------------------


def build_app(
    frontend: Frontend, model_name: str, metrics: FrontendMetrics, api_key: str | None = None
) -> FastAPI:
    """The API's routes. With `api_key`, every route but /health and /metrics (a load
    balancer's and Prometheus' probes, open as in vLLM) needs `Authorization: Bearer KEY`."""
    app = FastAPI(title="ppring", docs_url=None, redoc_url=None, openapi_url=None)
    api = OpenAIRoutes(frontend, model_name, metrics)
    guarded = [Depends(bearer_check(api_key))] if api_key else []

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        answer = error_response(exc.status, exc.message, exc.kind, exc.param)
        if exc.status == 401:
            answer.headers["WWW-Authenticate"] = "Bearer"
        return answer

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__})", "internal_error")

    app.post("/v1/completions", dependencies=guarded)(api.completions)
    app.post("/v1/chat/completions", dependencies=guarded)(api.chat_completions)
    app.get("/v1/models", dependencies=guarded)(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics_text)
    app.post("/tokenize", dependencies=guarded)(api.tokenize)
    app.post("/detokenize", dependencies=guarded)(api.detokenize)
    return app


def bearer_check(api_key: str):
    """A route dependency: the request's bearer token must be `api_key` (the scheme's case is
    free, RFC 7235; the token compared in constant time, so a wrong key's timing says nothing
    of the right one)."""
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected):
            raise ApiError(
                401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error"
            )  # the exception handler adds WWW-Authenticate (RFC 6750)

    return check


class OpenAIRoutes:
    def __init__(self, frontend: Frontend, model_name: str, metrics: FrontendMetrics) -> None:
        self.frontend, self.model_name, self.metrics = frontend, model_name, metrics
        self.created = int(time.time())

    # -- small endpoints ---------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "ppring",
            "max_model_len": self.frontend.context_length,
        }
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if self.frontend.ring_error is not None:
            return error_response(
                503, f"the ring is down: {self.frontend.ring_error}", "unavailable"
            )
        if not self.frontend.ring_ready.is_set():
            starting = self.frontend.down_since is None
            why = "the ring is starting" if starting else "the ring is re-forming"
            return error_response(503, why, "unavailable")
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        if body.get("model") is not None:
            self._check_model(body["model"])
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "give a prompt (a string) or messages (a chat)")
        try:
            ids = self.frontend.tokenize(_generate_from_tokenize_body(body))
        except (ProtocolError, ValidationError, TypeError, ValueError) as exc:
            raise ApiError(400, _say(exc)) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.frontend.context_length}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        tokens = body.get("tokens")
        vocab = self.frontend.vocab_size
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < vocab for t in tokens
        ):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab})")
        return {"prompt": self.frontend.tokenizer.decode(tokens)}

    # -- generation --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = _parse(CompletionRequest, await _json_body(request))
        self._check_model(req.model)
        prompts = req.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: text, or token ids
        choices = len(prompts) * req.n
        if len(prompts) > 1 and choices > MAX_CHOICES:  # one prompt: _unsupported words it
            raise ApiError(
                400,
                f"{len(prompts)} prompts x n = {req.n} is {choices} choices, over {MAX_CHOICES}",
            )
        try:
            gens = [
                Generate(rid="http", prompt=p)
                if isinstance(p, str)
                else Generate(rid="http", input_ids=list(p))
                for p in prompts
            ]
        except ProtocolError as exc:
            raise ApiError(400, _say(exc)) from None
        return await self._generate(request, req, gens, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        req = _parse(ChatRequest, await _json_body(request))
        self._check_model(req.model)
        messages = [ChatMessage(role=t.role, content=_text_of(t.content)) for t in req.messages]
        return await self._generate(request, req, [Generate(rid="http", messages=messages)], True)

    async def _generate(self, request: Request, req: _Common, gens: list[Generate], chat: bool):
        """Submit n choices of each prompt of `gens` (choice i: sample i % n of prompt i // n)
        and answer with all of them."""
        if (unsupported := _unsupported(req)) is not None:
            param, why = unsupported
            raise ApiError(400, why, param=param)
        if (reason := self._not_serving()) is not None:
            raise ApiError(503, f"not serving: {reason}", "unavailable")
        try:
            prompt_ids = [self.frontend.tokenize(gen) for gen in gens]
            submitted = [
                self._to_ring_request(req, ids, chat, sample)
                for ids in prompt_ids
                for sample in range(req.n)
            ]
        except (ProtocolError, ValueError, TypeError) as exc:
            raise ApiError(400, _say(exc)) from None
        answers: asyncio.Queue[tuple[int, Chunk | Done | Error | None]] = asyncio.Queue()
        rids = [f"http/{uuid.uuid4().hex}" for _ in submitted]
        for index, (rid, gen) in enumerate(zip(rids, submitted)):

            async def sink(msg: Chunk | Done | Error, index: int = index) -> None:
                answers.put_nowait((index, msg))

            try:
                await self.frontend.submit(rid, gen, sink)
            except BaseException as exc:  # the choices already in the ring must not run on
                self._abort(rids[:index])
                if isinstance(exc, ProtocolError):
                    raise ApiError(400, _say(exc)) from None
                raise
        want_logprobs = submitted[0].sampling.logprobs
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        num_prompt_tokens = [len(ids) for ids in prompt_ids for _ in range(req.n)]
        shape = AnswerShape(
            chat, self.model_name, req.n, num_prompt_tokens, want_logprobs, include_usage,
            self._token_text,
        )  # fmt: skip
        if isinstance(req, CompletionRequest) and req.echo:
            shape.echo([self._prompt_text(gen, ids) for gen, ids in zip(gens, prompt_ids)])
        if req.stream:
            stream = self._stream(rids, answers, shape)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await self._whole(request, rids, answers, shape)

    def _not_serving(self) -> str | None:
        """Why a new request is refused (503) now; None: it is taken. A ring re-forming after a
        stage died is not refusing: the frontend holds what comes until the new ring is ready
        (up to its limit, then `overloaded`), for HTTP clients as for ZeroMQ ones; /health still
        says 503 meanwhile, so a load balancer sends its traffic elsewhere."""
        if self.frontend.ring_error is not None:
            return self.frontend.ring_error
        if not self.frontend.ring_ready.is_set() and self.frontend.down_since is None:
            return "the ring is starting"
        return None

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:  # a finished one is no longer in flight: abort ignores it
            self.frontend.abort(rid)

    def _to_ring_request(
        self, req: _Common, input_ids: list[int], chat: bool, sample: int
    ) -> Generate:
        """The ring request of sample `sample` of one prompt. A seeded request's samples draw
        from seed + sample (vLLM's rule), so n seeded samples differ and repeat run to run."""
        room = self.frontend.context_length - len(input_ids)
        max_tokens = req.max_tokens
        if chat and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if max_tokens is None:
            if room < 1:
                raise ValueError(f"the prompt ({len(input_ids)} tokens) fills the context")
            max_tokens = room
        logprobs = req.logprobs is not None and req.logprobs is not False
        if isinstance(req, CompletionRequest):
            top_logprobs = req.logprobs or 0  # legacy completions: logprobs is the count
        else:
            top_logprobs = req.top_logprobs or 0
        sampling = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logit_bias=dict(req.logit_bias or {}),
            min_tokens=req.min_tokens,
            seed=_sample_seed(req.seed, sample),
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=bool(logprobs),
            top_logprobs=top_logprobs,
        )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return Generate(rid="http", input_ids=input_ids, sampling=sampling, stop=stop)

    def _prompt_text(self, gen: Generate, input_ids: list[int]) -> str:
        """A prompt as echo repeats it: as sent, or its token ids decoded."""
        if gen.prompt is not None:
            return gen.prompt
        return self.frontend.tokenizer.decode(input_ids)

    def _token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id])

    def _check_model(self, model: Any) -> None:
        if model != self.model_name:
            raise ApiError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
            )  # fmt: skip

    async def _whole(
        self, request: Request, rids: list[str], answers: asyncio.Queue, shape: AnswerShape
    ) -> Response:
        """Collect every choice; a client that goes away meanwhile has its requests aborted
        at once (`_client_gone` says so on the queue), and a choice the ring fails fails the
        answer (the others are aborted)."""
        watch = asyncio.ensure_future(_client_gone(request, answers))
        try:
            while True:
                index, msg = await answers.get()
                if msg is None:
                    self._abort(rids)
                    return Response(status_code=499)
                if isinstance(msg, Error):
                    self._abort(rids)
                    return error_response(*_ring_error(msg))
                shape.add(index, msg)
                if shape.all_done:
                    return JSONResponse(shape.whole())
        except asyncio.CancelledError:
            self._abort(rids)
            raise
        finally:
            watch.cancel()

    async def _stream(
        self, rids: list[str], answers: asyncio.Queue, shape: AnswerShape
    ) -> AsyncIterator[str]:
        finished = False
        try:
            for event in shape.first_chunks():
                yield _sse(event)
            while not shape.all_done:
                index, msg = await answers.get()
                if isinstance(msg, Error):  # the shape of a whole answer's error, as an event
                    yield _sse(error_body(*_ring_error(msg)))
                    break
                shape.add(index, msg)
                for event in shape.stream_events(index, msg):
                    yield _sse(event)
            finished = shape.all_done
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream, or a choice failed
                self._abort(rids)


# -- helpers -----------------------------------------------------------------------------------


async def _client_gone(request: Request, answers: asyncio.Queue) -> None:
    """Put (-1, None) on `answers` once the client has closed its connection. The body is read
    already, so ASGI's next message is `http.disconnect`, whenever that comes. (Polling
    `request.is_disconnected()` between answers missed it: a request whose tokens keep coming
    never waited long enough to poll, and ran on to max_tokens for no one.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    answers.put_nowait((-1, None))


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ApiError(422, _say(exc), param=_where(exc) or None) from None


def _generate_from_tokenize_body(body: dict[str, Any]) -> Generate:
    if "prompt" in body:
        return Generate(rid="tokenize", prompt=body["prompt"])
    turns = [ChatTurn.model_validate(turn) for turn in body["messages"]]
    messages = [ChatMessage(role=t.role, content=_text_of(t.content)) for t in turns]
    return Generate(rid="tokenize", messages=messages)


def _sample_seed(seed: int | None, sample: int) -> int | None:
    """Sample `sample`'s seed: seed + sample, wrapping past the largest seed so any valid seed
    takes any n; a seed beyond it stays so, for SamplingParams to refuse in one sentence."""
    if seed is None or seed > MAX_SEED:
        return seed
    return (seed + sample) % (MAX_SEED + 1)


def _text_of(content: str | list[ChatContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _ring_error(msg: Error) -> tuple[int, str, str]:
    """The HTTP status, message and OpenAI error type of an error from the frontend."""
    status = ERROR_STATUS.get(msg.code, 500)
    if status == 503:
        kind = "unavailable"
    else:
        kind = "invalid_request_error" if status < 500 else "internal_error"
    return status, msg.message, kind


def _where(exc: ValidationError) -> str:
    """The field a validation error is about, dotted (`messages.0.role`); "" for the body."""
    return ".".join(str(part) for part in exc.errors()[0]["loc"])


def _say(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return f"{_where(exc) or 'body'}: {exc.errors()[0]['msg']}"
    return str(exc)


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


# -- serving -----------------------------------------------------------------------------------


class QuietServer(uvicorn.Server):
    """The launcher owns SIGINT and SIGTERM: uvicorn must not install its own handlers."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield


class HttpServer:
    """uvicorn on a socket bound here, so a port in use is one clear error at start-up (uvicorn
    itself would exit the process), run as a task of the frontend's loop."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"--http-port {port} on {host}: {exc.strerror}") from None
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self.server = QuietServer(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await asyncio.wait([self.task], timeout=5)
        self.sock.close()
