"""What a step of each shape costs the native engine's model runner, and what the server adds
to a stream (`ragspeed bench engine` reports both).

Step costs run the served model (the engine's `LoadedModel`) through a `ModelRunner` over a KV
pool of their own, the shapes taking turns in each round, medians of the rounds:
- a plain step: one decode row and its logits, after `context` tokens [plain_step_{context}_ms];
- a verification: the last token and `num_drafts` drafts of one sequence, every row's logits, in
  plain steps beside it [verification_steps_{context}];
- a prompt of `prompt_len` tokens prefilled in chunks of `chunk` tokens, each beside a decode
  (an arrival beside a stream), per prompt token: the steps' time less a plain step's each
  [chunk_beside_decode_ms_per_token], against the same prompt in chunks of `large_chunk` alone
  [large_chunks_ms_per_token], and their ratio [chunk_beside_decode_ratio].

The served stream: `ragspeed serve` on the same model in a child process, streamed completions
of `prompt_len` random token ids (greedy, EOS ignored) read from a raw HTTP client in this
process; TPOT from the client's side, from the first token's chunk to the final one (sent with
the last token) [served_tpot_ms].
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from ragspeed.bench.launcher import ServerProcess
from ragspeed.bench.tokens import random_prompt
from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk, SchedulerOutput, TokenSequence

BLOCK_SIZE = 16


class _Sequences:
    """Random token sequences, each with the blocks of its own stretch of one KV pool."""

    def __init__(self, loaded: Any, lengths: list[int], seed: int):
        generator = torch.Generator().manual_seed(seed)
        vocab = loaded.arch.vocab_size
        blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        self.pool = KVCachePool(loaded.arch, sum(blocks), BLOCK_SIZE, torch.float16, "cpu")
        self.runner = ModelRunner(loaded.model, loaded.rotary, self.pool, "cpu")
        self.sequences, self.tables, first = [], [], 0
        for n, count in zip(lengths, blocks):
            self.sequences.append(TokenSequence(list(random_prompt(generator, n, vocab))))
            self.tables.append(tuple(range(first, first + count)))
            first += count

    def chunk(self, index: int, start: int, num_tokens: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        chunk = self.sequences[index].chunk(start, num_tokens, self.tables[index])
        return dataclasses.replace(chunk, draft_token_ids=drafts) if drafts else chunk

    def step(self, decodes: tuple[ScheduledChunk, ...], prefills: tuple[ScheduledChunk, ...] = ()) -> float:
        start = time.perf_counter()
        self.runner.execute(SchedulerOutput(decodes, prefills))
        return time.perf_counter() - start


def step_costs(
    loaded: Any,
    contexts: tuple[int, ...] = (256, 2048),
    num_drafts: int = 4,
    prompt_len: int = 2048,
    chunk: int = 64,
    large_chunk: int = 512,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """The figures above, with torch's threads as they are."""
    figures: dict[str, float] = {}
    with torch.inference_mode():
        for context in contexts:
            figures.update(_verification(loaded, context, num_drafts, repeats, seed))
        figures.update(_chunks_beside_decode(loaded, prompt_len, chunk, large_chunk, repeats, seed))
    return figures


def _verification(loaded: Any, context: int, num_drafts: int, repeats: int, seed: int) -> dict[str, float]:
    """A decode (sequence 0: its last token samples) and a verification (sequence 1: the last
    token and the drafts, every row samples), both after `context` tokens, alternated."""
    seqs = _Sequences(loaded, [context + 1, context + 1 + num_drafts], seed)
    tokens = seqs.sequences[1].all_token_ids  # its blocks have room for the drafts
    seqs.sequences[1] = TokenSequence(tokens[: context + 1])  # the drafts are not its tokens yet
    drafts = tuple(tokens[context + 1 :])
    for index in (0, 1):
        seqs.step((), (seqs.chunk(index, 0, context),))
    plain = (seqs.chunk(0, context, 1),)
    verify = (seqs.chunk(1, context, 1 + num_drafts, drafts),)
    assert plain[0].samples and verify[0].samples  # the logits of every row, as in the engine
    plain_times, verify_times = [], []
    for round_ in range(repeats + 1):  # the first round warms up
        p = statistics.median(seqs.step(plain) for _ in range(20))
        v = statistics.median(seqs.step((), verify) for _ in range(20))
        if round_:
            plain_times.append(p)
            verify_times.append(v)
    plain_s, verify_s = statistics.median(plain_times), statistics.median(verify_times)
    return {
        f"plain_step_{context}_ms": plain_s * 1e3,
        f"verification_{context}_ms": verify_s * 1e3,
        f"verification_steps_{context}": verify_s / plain_s,
    }


def _chunks_beside_decode(
    loaded: Any, prompt_len: int, chunk: int, large_chunk: int, repeats: int, seed: int
) -> dict[str, float]:
    """Sequence 0 decodes (after `chunk` tokens of context) beside each chunk of sequence 1's
    prompt; the prompt alone in large chunks is sequence 1 again (its KV rewritten)."""
    seqs = _Sequences(loaded, [chunk + 1, prompt_len], seed)
    seqs.step((), (seqs.chunk(0, 0, chunk),))
    decode = (seqs.chunk(0, chunk, 1),)

    def prefill(size: int, beside: bool) -> float:
        total = 0.0
        for start in range(0, prompt_len, size):
            piece = (seqs.chunk(1, start, min(size, prompt_len - start)),)
            if beside:
                total += seqs.step(decode, piece) - seqs.step(decode)
            else:
                total += seqs.step((), piece)
        return total / prompt_len

    beside_times, alone_times = [], []
    for round_ in range(repeats + 1):
        b, a = prefill(chunk, True), prefill(large_chunk, False)
        if round_:
            beside_times.append(b)
            alone_times.append(a)
    beside, alone = statistics.median(beside_times), statistics.median(alone_times)
    return {
        "chunk_beside_decode_ms_per_token": beside * 1e3,
        "large_chunks_ms_per_token": alone * 1e3,
        "chunk_beside_decode_ratio": beside / alone,
    }


def served_tpot(
    model: str,
    prompt_len: int,
    output_len: int,
    repeats: int,
    threads: int,
    vocab_size: int,
    seed: int = 0,
    serve_args: list[str] | None = None,
) -> dict[str, float]:
    """TPOT of streamed completions from a `ragspeed serve` child, seen by this process."""
    generator = torch.Generator().manual_seed(seed)

    def prompt() -> list[int]:
        return list(random_prompt(generator, prompt_len, vocab_size))

    args = ["--model", model, "--num-threads", str(threads), *(serve_args or [])]
    with ServerProcess(args) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        stream = _streamer(client, model_id, output_len)
        stream(prompt())  # warm-up
        tpots = [stream(prompt()) for _ in range(repeats)]
    return {"served_tpot_ms": statistics.median(tpots) * 1e3}


def _streamer(client: httpx.Client, model_id: str, output_len: int) -> Callable[[list[int]], float]:
    def stream(prompt: list[int]) -> float:
        """One streamed completion: (last token's arrival - first's) / (tokens - 1)."""
        body = {
            "model": model_id,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        first = last = None
        with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now, choices = time.perf_counter(), json.loads(line[6:])["choices"]
                first = first or now
                if choices and choices[0]["finish_reason"] is not None:
                    last = now  # the final chunk, sent with the last token
        assert first is not None and last is not None, "the stream ended without its final chunk"
        return (last - first) / (output_len - 1)

    return stream
