"""Structured outputs: a request's `StructuredOutput` compiled to a grammar and matched token by
token with llguidance, the grammar library (`ragspeed bench grammar` measures it beside
xgrammar: compile time, mask time per token, correctness).

Terms: a *grammar* is llguidance's serialized definition of what the output may be (compiled
once per `StructuredOutput` and kept); a *matcher* follows one request's output through it; its
*mask* is the set of tokens that keep the output a prefix of some string the grammar accepts,
as a bitmask of 32 tokens a word. EOS is in the mask only where the output is complete.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np

from ragspeed.engine.protocol import EngineError, StructuredOutput

if TYPE_CHECKING:  # a TypedDict of the library's stubs only
    from llguidance._lib import JsonCompileOptions

# JSON as OpenAI writes it, on one line: the library's default, any whitespace between tokens,
# lets a small model wander into runs of blank lines inside an object.
JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar of `structured`; raises ValueError for a spec of the wrong form."""
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    if kind == "json_schema":
        schema = json.loads(spec)
        if not isinstance(schema, dict):
            raise ValueError("a JSON Schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
    if kind == "choice":
        choices = json.loads(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return llguidance.grammar_from("choice", spec)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    assert kind == "grammar", f"unknown structured output kind {kind!r}"
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles and keeps grammars for one tokenizer; builds matchers. The tokenizer's byte
    table (about half a second) is built by `warm()` or the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's size)
        self._eos_token_ids = list(eos_token_ids)

    def warm(self) -> None:
        """Build the tokenizer's table now rather than at the first constrained request."""
        self._tokenizer  # noqa: B018 - a cached property, built here

    @functools.cached_property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(
            self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
        )

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one compiler per engine, kept for its life
    def compile(self, structured: StructuredOutput) -> str:
        """The grammar of `structured`, checked; EngineError (a 400) naming the problem."""
        param = (
            "response_format" if structured.kind in ("json_schema", "json_object") else "structured_outputs"
        )
        try:
            grammar = grammar_text(structured)
        except (ValueError, TypeError) as exc:
            raise EngineError(
                f"the {structured.kind} constraint cannot be compiled: {exc}", param=param
            ) from None
        # The library's default limits bound a grammar's size and each mask's work.
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise EngineError(
                f"the {structured.kind} constraint cannot be compiled: {'; '.join(messages)}", param=param
            )
        return grammar

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        grammar = self.compile(structured)
        return GrammarMatcher(llguidance.LLMatcher(self._tokenizer, grammar), self.vocab_size)


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self._words = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)  # the mask

    def mask_logits(self, logits: np.ndarray) -> None:
        """Set to -inf, in place, the logits [vocab] of every token the grammar forbids next."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: logits.shape[0]]
        np.putmask(logits, allowed == 0, -np.inf)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return self._matcher.is_stopped()
