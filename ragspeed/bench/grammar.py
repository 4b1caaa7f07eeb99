"""`ragspeed bench grammar`: structured outputs, the grammar libraries and the engine's cost.

Figures (JSON keys in brackets):
- the two grammar libraries side by side on the model's tokenizer (llguidance, which ragspeed
  uses, and xgrammar), for each schema of SCHEMAS: compile time of a schema seen for the first
  time and of one compiled before (llguidance through the engine's own cache; xgrammar through
  its compiler's) [<library>_compile_cold_ms, <library>_compile_cached_ms], the median time of
  one token's mask along a valid output [<library>_mask_us], and correctness: the share of
  SCHEMAS' valid and invalid instances each library judges as `jsonschema` does, token by token
  [<library>_agreement];
- the native engine, greedy, side by side in one run (medians of `repeats` alternated runs):
  time per output token of free decoding and of decoding constrained by a JSON Schema, at batch
  1 [free_tpot_ms, constrained_tpot_ms, constrained_ratio = constrained / free] and at batch 16
  [batch16_free_tpot_ms: 16 free rows; batch16_mixed_free_tpot_ms: the 8 free rows of a batch
  whose other 8 are constrained; batch16_free_row_ratio = mixed / free].
The table prints each ratio beside its target: constrained_ratio <= 1.15 and
batch16_free_row_ratio <= 1.0 (within the run-to-run spread).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import click
import numpy as np

from ragspeed.bench.common import (
    json_option,
    machine_line,
    model_option,
    prefill_line,
    print_rows,
    quantization_option,
    repeats_option,
    write_json,
)
from ragspeed.engine.protocol import GenerationRequest, SamplingParams, StructuredOutput

# Schemas of the kinds clients send, each with instances valid and not valid under it.
SCHEMAS: dict[str, tuple[dict[str, Any], list[Any], list[Any]]] = {
    "joke": (
        {
            "type": "object",
            "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
            "required": ["setup", "punchline"],
            "additionalProperties": False,
        },
        [{"setup": "Why?", "punchline": "Because."}],
        [{"setup": "Why?"}, {"setup": 1, "punchline": "x"}, {"setup": "a", "punchline": "b", "extra": 1}],
    ),
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        [{"name": "Ann", "age": 31}, {"name": "Bo", "age": 0, "email": "bo@x.io", "tags": ["a", "c"]}],
        [{"name": "Ann", "age": -1}, {"name": "Ann", "age": 3.5}, {"name": "A", "age": 1, "tags": ["d"]}],
    ),
    "tool_calls": (
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": "get_weather"},
                            "arguments": {
                                "type": "object",
                                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                "required": ["city"],
                                "additionalProperties": False,
                            },
                        },
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    }
                ]
            },
        },
        [[{"name": "get_weather", "arguments": {"city": "Paris"}}]],
        [[], [{"name": "get_time", "arguments": {}}], [{"name": "get_weather", "arguments": {"unit": "c"}}]],
    ),
}


def _dump(instance: Any) -> str:
    return json.dumps(instance, separators=(", ", ": "))


class LlguidanceContender:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: tuple[int, ...]):
        from ragspeed.engine.native.core.structured import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos)
        self.compiler.matcher(StructuredOutput("json_object"))  # the tokenizer's table, built once

    def compile(self, schema: dict[str, Any], cached: bool) -> Any:
        if not cached:
            self.compiler.compile.cache_clear()
        return self.compiler.matcher(StructuredOutput("json_schema", json.dumps(schema)))

    def mask_seconds(self, matcher: Any, token_ids: list[int], vocab_size: int) -> list[float]:
        logits = np.zeros(vocab_size, dtype=np.float32)
        times = []
        for token in token_ids:
            start = time.perf_counter()
            matcher.mask_logits(logits)
            times.append(time.perf_counter() - start)
            matcher.accept(token)
        return times

    def accepts(self, matcher: Any, token_ids: list[int]) -> bool:
        inner = matcher._matcher
        return inner.consume_tokens(token_ids) and inner.is_accepting()


class XgrammarContender:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos: tuple[int, ...]):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos)
        )
        self.info = info
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, schema: dict[str, Any], cached: bool) -> Any:
        if not cached:
            self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=1)
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def mask_seconds(self, matcher: Any, token_ids: list[int], vocab_size: int) -> list[float]:
        import torch

        bitmask = self.xgr.allocate_token_bitmask(1, self.info.vocab_size)
        logits = torch.zeros(1, vocab_size)
        times = []
        for token in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            self.xgr.apply_token_bitmask_inplace(logits, bitmask)
            times.append(time.perf_counter() - start)
            matcher.accept_token(token)
        return times

    def accepts(self, matcher: Any, token_ids: list[int]) -> bool:
        # Complete where the stop token is accepted after the output.
        return all(matcher.accept_token(t) for t in token_ids) and matcher.accept_token(
            self.info.stop_token_ids[0]
        )


def library_figures(engine: Any, echo=click.echo) -> dict[str, float]:
    import jsonschema

    tokenizer, vocab, eos = engine.tokenizer, engine.arch.vocab_size, engine.eos_token_ids
    figures: dict[str, float] = {}
    for contender in (LlguidanceContender(tokenizer, vocab, eos), XgrammarContender(tokenizer, vocab, eos)):
        cold: list[float] = []
        cached: list[float] = []
        masks: list[float] = []
        agreed = judged = 0
        for schema, valid, invalid in SCHEMAS.values():
            for is_cached, into in ((False, cold), (True, cached)):
                start = time.perf_counter()
                contender.compile(schema, cached=is_cached)
                into.append(time.perf_counter() - start)
            ids = tokenizer.encode(_dump(valid[0]), add_special_tokens=False)
            masks += contender.mask_seconds(contender.compile(schema, cached=True), ids, vocab)
            for instance in valid + invalid:
                expected = jsonschema.Draft202012Validator(schema).is_valid(instance)
                ids = tokenizer.encode(_dump(instance), add_special_tokens=False)
                agreed += contender.accepts(contender.compile(schema, cached=True), ids) == expected
                judged += 1
        name = contender.name
        figures[f"{name}_compile_cold_ms"] = statistics.median(cold) * 1000
        figures[f"{name}_compile_cached_ms"] = statistics.median(cached) * 1000
        figures[f"{name}_mask_us"] = statistics.median(masks) * 1e6
        figures[f"{name}_agreement"] = agreed / judged
    return figures


def _tpots(engine: Any, requests: list[GenerationRequest]) -> dict[str, float]:
    """Each request's median time between its tokens, running them together."""
    arrivals: dict[str, list[float]] = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.delta.token_ids:
                arrivals[out.request_id].append(now)
    return {
        rid: statistics.median(b - a for a, b in zip(times, times[1:])) for rid, times in arrivals.items()
    }


def engine_figures(engine: Any, repeats: int, max_tokens: int = 48) -> dict[str, float]:
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON: name, age, email and tags."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tuple(tokenizer.encode(text, add_special_tokens=False))
    schema = StructuredOutput(
        "json_schema", json.dumps({"type": "object", "properties": {"description": {"type": "string"}}})
    )
    counter = iter(range(1 << 30))

    def request(constrained: bool) -> GenerationRequest:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if constrained:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=schema)
        return GenerationRequest(f"r{next(counter)}-{'c' if constrained else 'f'}", prompt, params)

    def mean_of(tpots: dict[str, float], kind: str) -> float:
        return statistics.mean(v for k, v in tpots.items() if k.endswith(kind))

    runs: dict[str, list[float]] = {k: [] for k in ("free", "constrained", "batch_free", "batch_mixed_free")}
    _tpots(engine, [request(False), request(True)])  # warm-up: compile, caches
    for _ in range(repeats):  # alternated, so that drift hits every contender alike
        runs["free"].append(mean_of(_tpots(engine, [request(False)]), "f"))
        runs["constrained"].append(mean_of(_tpots(engine, [request(True)]), "c"))
        runs["batch_free"].append(mean_of(_tpots(engine, [request(False) for _ in range(16)]), "f"))
        mixed = [request(i % 2 == 1) for i in range(16)]
        runs["batch_mixed_free"].append(mean_of(_tpots(engine, mixed), "f"))
    median = {k: statistics.median(v) * 1000 for k, v in runs.items()}
    return {
        "free_tpot_ms": median["free"],
        "constrained_tpot_ms": median["constrained"],
        "constrained_ratio": median["constrained"] / median["free"],
        "batch16_free_tpot_ms": median["batch_free"],
        "batch16_mixed_free_tpot_ms": median["batch_mixed_free"],
        "batch16_free_row_ratio": median["batch_mixed_free"] / median["batch_free"],
    }


@click.command("grammar")
@model_option
@quantization_option("the target's weights (serve's default: auto)")
@repeats_option
@json_option
def bench_grammar(model: str, quantization: str, repeats: int, json_path: str | None) -> None:
    """Structured outputs: llguidance beside xgrammar, and constrained decoding's cost."""
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.native.core.factory import build_llm_engine

    engine = build_llm_engine(EngineConfig(model=model, quantization=quantization))
    click.echo(machine_line(engine.num_threads))
    click.echo(prefill_line(engine))  # the CPU's capabilities and the prefill path
    figures: dict[str, Any] = {"model": model, **library_figures(engine), **engine_figures(engine, repeats)}
    targets = {"constrained_ratio": "<= 1.15", "batch16_free_row_ratio": "<= 1.0"}
    print_rows(
        [
            (key, f"{value:.3f}" + (f"   (target {targets[key]})" if key in targets else ""))
            if isinstance(value, float)
            else (key, value)
            for key, value in figures.items()
        ],
        echo=click.echo,
    )
    write_json(json_path, figures)
