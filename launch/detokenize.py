"""Incremental detokenization with stop strings, one object per request.

Token by token, `add(token_id)` returns the text that may be shown now:
- never half a character: a byte-level BPE token can end inside a multi-byte UTF-8 sequence,
  which decodes to U+FFFD until the next token completes it, so text ending in U+FFFD is held;
- never part of a stop string: text that could be the start of one is held until it is clear;
- never the stop string itself: at a match the text is cut before it and `stopped` is set;
- with min_tokens, a stop string counts only if it ends in text of a later token (vLLM's rule:
  it checks from token min_tokens + 1 on, the new text and a stop string's length back).

Decoding re-reads only a short window of recent tokens (vLLM's prefix/read offsets), so the cost
per token does not grow with the length of the answer.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded before the new ones, so spacing and merges at the seam come out right.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        prompt_ids: list[int] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # The prompt's last tokens are context only: a SentencePiece tokenizer drops the leading
        # space of a first token decoded alone.
        self.token_ids: list[int] = list((prompt_ids or [])[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # decode window: ids[prefix_offset:read_offset] is already text
        self.read_offset = len(self.token_ids)
        self.text = ""  # all text decoded so far (complete characters only)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False
        self.min_tokens = min_tokens
        self.num_added = 0
        self.stop_floor = 0  # characters of `text` a stop string may not end within

    def add(self, token_id: int) -> str:
        """Text that became safe to show with this token (may be empty)."""
        if self.stopped:
            return ""
        self.num_added += 1
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # inside a multi-byte character, or nothing visible yet
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.num_added <= self.min_tokens:
            self.stop_floor = len(self.text)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back that is not a stop string."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            search_from = max(self.sent - self.hold, 0)
            hits = [
                i
                for s in self.stop
                if (i := self.text.find(s, max(search_from, self.stop_floor - len(s) + 1))) >= 0
            ]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(len(self.text) - self.hold, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
