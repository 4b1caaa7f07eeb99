"""Engine `TokenLogprob`s in OpenAI's wire shapes: chat's `logprobs.content` and the legacy
completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists.

A token is named by the tokenizer's decoding of that one id (special tokens included, so an
end-of-sequence token reads as such); `bytes` is that string's UTF-8. A byte-level BPE token
that holds part of a multi-byte character decodes to U+FFFD, so its `bytes` are those of U+FFFD,
as in vLLM. The numbers are the engine's raw logprobs (engine.native.core.logprobs), clamped at -9999 as
vLLM does, since JSON has no -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragspeed.engine.protocol import TokenLogprob

_MIN_LOGPROB = -9999.0


def _number(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


class LogprobsFormatter:
    """One per response: decodes each token id once, and keeps the legacy `text_offset`
    running across stream chunks."""

    def __init__(self, tokenizer: Any, *, chat: bool):
        self._tokenizer = tokenizer
        self._chat = chat
        self._text: dict[int, str] = {}
        self._offset = 0  # characters of output named so far (legacy text_offset)

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = text
        return text

    def __call__(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._chat_shape(logprobs) if self._chat else self._completion_shape(logprobs)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": _number(logprob), "bytes": list(text.encode("utf-8"))}

    def _chat_shape(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(lp.token_id, lp.logprob),
                    "top_logprobs": [self._entry(t, v) for t, v in lp.top],
                }
                for lp in logprobs
            ]
        }

    def _completion_shape(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self.token(lp.token_id) for lp in logprobs]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        # The sampled token is always listed, so a dict holds up to `logprobs` + 1 entries.
        top = [
            {
                **{self.token(t): _number(v) for t, v in lp.top},
                **(
                    {}
                    if any(t == lp.token_id for t, _ in lp.top)
                    else {self.token(lp.token_id): _number(lp.logprob)}
                ),
            }
            for lp in logprobs
        ]
        return {
            "tokens": tokens,
            "token_logprobs": [_number(lp.logprob) for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }
