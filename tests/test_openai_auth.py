"""--api-key: the API's routes need the bearer key, /health and /metrics stay open; checked on
the app itself with a stand-in frontend (no ring: auth is decided before a route runs)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from launch.local import API_KEY_ENV, add_http_args
from launch.metrics import FrontendMetrics
from launch.openai_api import build_app

KEY = "sk-test-0123456789"


def frontend() -> SimpleNamespace:
    """What /v1/models and /health read of a Frontend, ring up."""
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(context_length=8192, ring_error=None, ring_ready=ready)


def call(app, method: str, path: str, headers: dict[str, str] | None = None, **kw):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
            return await c.request(method, path, headers=headers or {}, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY} "}],
)  # fmt: skip
def test_without_the_key_every_api_route_is_401(headers):
    app = build_app(frontend(), "smol", FrontendMetrics("smol"), api_key=KEY)
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize")]:  # fmt: skip
        answer = call(app, method, path, headers, json={"model": "smol", "prompt": "hi"})
        assert answer.status_code == 401, path
        error = answer.json()["error"]
        assert error["type"] == "authentication_error" and "Bearer" in error["message"]
        assert KEY not in answer.text
        assert answer.headers["WWW-Authenticate"] == "Bearer"  # RFC 6750


def test_with_the_key_routes_answer_and_health_and_metrics_stay_open():
    app = build_app(frontend(), "smol", FrontendMetrics("smol"), api_key=KEY)
    models = call(app, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smol"
    assert call(app, "GET", "/v1/models", {"Authorization": f"bearer {KEY}"}).status_code == 200
    assert call(app, "GET", "/health").status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_without_a_key_the_api_is_open():
    app = build_app(frontend(), "smol", FrontendMetrics("smol"))
    assert call(app, "GET", "/v1/models").status_code == 200


def parse_key(argv: list[str]) -> str | None:
    """--api-key as the launchers' parsers read it (the environment read when built)."""
    parser = argparse.ArgumentParser()
    add_http_args(parser)
    return parser.parse_args(argv).api_key


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse_key([]) is None
    assert parse_key(["--api-key", KEY]) == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_key([]) == "from-env"
    assert parse_key(["--api-key", KEY]) == KEY


@pytest.mark.parametrize(
    ("key", "words"),
    [("", "is empty"), ("  ", "is empty"), ("clé", "printable ASCII"), ("a\tb", "printable"),
     (" key", "surrounding spaces")],
)  # fmt: skip
def test_a_key_that_cannot_lock_the_api_is_one_sentence(monkeypatch, capsys, key, words):
    with pytest.raises(SystemExit):
        parse_key(["--api-key", key])
    assert words in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, key)  # from the environment alike: never open by mistake
    with pytest.raises(SystemExit):
        parse_key([])
