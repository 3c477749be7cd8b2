"""One OpenAI request's answer, whole or as stream events, in OpenAI's shapes.

A request is one or more choices (`n` samples of each prompt; /v1/completions takes a list of
prompts): choice `index` is sample `index % n` of prompt `index // n`, vLLM's order. Each
choice is a request of its own in the ring; this module only gathers their chunks and shapes
them, and knows nothing of the ring or of HTTP.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Chunk, Done


@dataclass
class ChoiceState:
    """What one choice has received so far."""

    num_prompt_tokens: int  # as tokenized here; its Done's count wins once it arrives
    echo: str = ""  # the prompt's text, before the answer's (completions' `echo`)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # per token, with top_logprobs
    top_logprobs: list[list[float]] = field(default_factory=list)
    done: Done | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.done.prompt_tokens if self.done else self.num_prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.done.completion_tokens if self.done else len(self.token_ids)


class AnswerShape:
    """Builds one request's answer over all its choices."""

    def __init__(
        self,
        chat: bool,
        model: str,
        n: int,
        num_prompt_tokens: list[int],
        want_logprobs: bool,
        include_usage: bool,
        token_text: Callable[[int], str],
    ) -> None:
        """num_prompt_tokens: one per choice (n per prompt)."""
        self.chat, self.model, self.n, self.token_text = chat, model, n, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.choices = [ChoiceState(count) for count in num_prompt_tokens]

    def echo(self, prompt_texts: list[str]) -> None:
        """Start each choice's text with its prompt's (one per prompt, n choices each)."""
        for index, choice in enumerate(self.choices):
            choice.echo = prompt_texts[index // self.n]

    def add(self, index: int, msg: Chunk | Done) -> None:
        choice = self.choices[index]
        if isinstance(msg, Chunk):
            choice.text.append(msg.text)
            choice.token_ids += msg.token_ids
            choice.logprobs += msg.logprobs or []
            choice.top_ids += msg.top_ids or []
            choice.top_logprobs += msg.top_logprobs or []
        else:
            choice.done = msg

    @property
    def all_done(self) -> bool:
        return all(choice.done is not None for choice in self.choices)

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once however many samples it has (OpenAI's and vLLM's); the
        prompt tokens the prefix cache held as OpenAI reports them (of each prompt's first
        choice: its others may find more of it cached)."""
        firsts = self.choices[:: self.n]
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        cached = sum(c.done.cached_tokens for c in firsts if c.done is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def whole(self) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(self.choices):
            logprobs = self._logprobs(c.token_ids, c.logprobs, c.top_ids, c.top_logprobs)
            finish = c.done.finish_reason if c.done else None
            text = c.echo + "".join(c.text)
            choices.append(self._choice(index, text, finish, logprobs, chunk=False))
        return {**self._envelope(False), "choices": choices, "usage": self.usage()}

    def first_chunks(self) -> list[dict[str, Any]]:
        """A chat stream opens each choice with the assistant's role, as OpenAI's does; a
        completion stream with echo, each choice with its prompt."""
        if not self.chat:
            return [
                {**self._envelope(True), "choices": [self._choice(i, c.echo, None, None, True)]}
                for i, c in enumerate(self.choices)
                if c.echo
            ]
        return [
            {
                **self._envelope(True),
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }  # fmt: skip
                ],
            }
            for index in range(len(self.choices))
        ]

    def stream_events(self, index: int, msg: Chunk | Done) -> list[dict[str, Any]]:
        """The events of one message of choice `index`; after the last choice's Done, the usage
        event when the client asked for it."""
        if isinstance(msg, Chunk):
            if not msg.text and not (self.want_logprobs and msg.logprobs):
                return []  # a token with no visible text yet: nothing to show
            logprobs = self._logprobs(
                msg.token_ids, msg.logprobs or [], msg.top_ids or [], msg.top_logprobs or []
            )
            choice = self._choice(index, msg.text, None, logprobs, chunk=True)
            return [{**self._envelope(True), "choices": [choice]}]
        choice = self._choice(index, "", msg.finish_reason, None, chunk=True)
        events = [{**self._envelope(True), "choices": [choice]}]
        if self.include_usage and self.all_done:
            events.append({**self._envelope(True), "choices": [], "usage": self.usage()})
        return events

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float],
        top_ids: list[list[int]],
        top_logprobs: list[list[float]],
    ) -> dict | None:
        """OpenAI's logprobs object of some tokens; top_ids and top_logprobs: per token, the
        most likely tokens at its step (empty lists when the request asked for none)."""
        if not self.want_logprobs or not logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        tops = [
            [(self.token_text(t), lp) for t, lp in zip(ids, lps)]
            for ids, lps in zip(top_ids, top_logprobs)
        ] or [[] for _ in tokens]
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in top]}
                for t, lp, top in zip(tokens, logprobs, tops)
            ]  # fmt: skip
            return {"content": content}
        # OpenAI's legacy shape, as vLLM's: the k best and the sampled token, k + 1 at most
        top_maps = [{**dict(top), t: lp} for t, lp, top in zip(tokens, logprobs, tops)]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_maps,
                "text_offset": None}  # fmt: skip

    def _choice(
        self, index: int, text: str, finish: str | None, logprobs: dict | None, chunk: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if not self.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice
