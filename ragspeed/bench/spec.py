"""`ragspeed bench spec`: speculative decoding (prompt lookup, draft model) in the native engine.

Figures (one run; warm-up first; medians of `repeats` runs; JSON keys in brackets), greedy:
- batch 1, extractive RAG prompts from nq_dev.jsonl (the documents, then an instruction to
  quote the passage that answers), each prompt run without and with n-gram speculation, side by
  side: decode tokens/s = (output tokens - 1) / (time of the last token - time of the first),
  the median over prompts and repeats [plain_decode_tokens_per_s, ngram_decode_tokens_per_s,
  ngram_speedup = ngram / plain], acceptance rate and mean accepted length [ngram_acceptance,
  ngram_mean_accepted_length], and whether both gave the same tokens [outputs_identical].
- batch 1, wiki-style prompts (the first 64 tokens of held-out passages of the demo's split, as
  plain text to continue), without speculation and with the draft model (`--draft-model`,
  default the zoo's draft for the model where it is here, engine.native.loading.model_zoo.zoo_draft; none: the
  section is skipped and `draft_model` is null; its weights as `--draft-quantization` says, default int8
  on a CPU [draft_quantization]), side by side: [draft_plain_decode_tokens_per_s,
  draft_decode_tokens_per_s, draft_speedup = draft / plain], acceptance and mean accepted
  length over the timed runs [draft_acceptance, draft_mean_accepted_length],
  [draft_outputs_identical], and the timed steps the controller ran without drafts
  [draft_steps_switched_off]; the same on the RAG prompts above [draft_rag_*] (the draft's
  training holds out nq_dev's first 16 questions, the ones these prompts are made from).
- batch 16 of the RAG prompts at once, adaptive speculation on (the default controller):
  output tokens/s over the whole run [batch16_plain_tokens_per_s, batch16_ngram_tokens_per_s,
  batch16_ratio = ngram / plain].
- the ceiling of prompt lookup on this machine and model: batch 1, the RAG prompts, drafts that
  replay the plain run's own greedy output (every draft accepted), k drafts a step: what
  verification costs against a plain step, whatever a proposer guesses
  [ceiling_decode_tokens_per_s, ceiling_speedup = ceiling / plain, ceiling_acceptance (1.0
  unless batched and lone greedy runs disagree), and a verification step's time in plain steps,
  (k + 1) / ceiling_speedup: ceiling_verification_steps].
The target's weights are serve's default (`--quantization auto`: a GGUF model's own blocks) or
as `--quantization` says [quantization].
A *ratio* or *speedup* divides the speculative contender's rate by the plain one's.
The table prints each ratio beside its target: ngram_speedup >= 0.97 (prompt lookup
never slower); draft_speedup and draft_rag_speedup >= 1.6; batch16_ratio >= 0.97.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.bench.common import json_option, machine_line, qa_data_option, quantization_option, write_json
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, zoo_draft
from ragspeed.engine.protocol import GenerationRequest, SamplingParams

SYSTEM = "Answer the question by quoting the documents."
INSTRUCTION = "Quote the passage that answers the question: {question}"


def rag_prompts(data_path: Path, tokenizer, num_prompts: int, num_documents: int) -> list[tuple[int, ...]]:
    """Chat prompts: numbered documents, then the instruction, through the chat template."""
    prompts: list[tuple[int, ...]] = []
    with open(data_path) as f:
        for line in f:
            if len(prompts) == num_prompts:
                break
            example = json.loads(line)
            docs = example["documents"][:num_documents]
            body = "\n\n".join(f"[{i}] {d['title']}: {d['text']}" for i, d in enumerate(docs, 1))
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": body + "\n\n" + INSTRUCTION.format(**example)},
            ]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append(tuple(int(t) for t in ids))
    if not prompts:
        raise click.BadParameter(f"no examples in {data_path}", param_hint="--data")
    return prompts


def wiki_prompts(data_dir: Path, tokenizer, num_prompts: int, num_tokens: int) -> list[tuple]:
    """Plain-text prompts: bos + the first `num_tokens` tokens of held-out wiki passages (the
    demo model's and the draft's held-out split, so neither was trained on them)."""
    from ragspeed.training.corpus import load_corpus
    from ragspeed.training.distill import text_prompts

    passages = load_corpus(data_dir, seed=0).heldout_passages
    prompts = text_prompts(tokenizer, passages, num_tokens)[:num_prompts]
    if not prompts:
        raise click.BadParameter(f"no held-out passages in {data_dir}", param_hint="--data")
    return prompts


def _median_rates(contenders: dict, prompts: list[tuple], max_tokens: int, repeats: int):
    """Batch-1 decode rate per (prompt, repeat), the contenders alternating; whether every
    contender gave the first one's tokens."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    identical = True
    for _ in range(repeats):
        for prompt in prompts:
            outs = []
            for name, contender in contenders.items():
                ((ids, times),) = contender.run([prompt], max_tokens)
                outs.append(ids)
                rates[name].append((len(ids) - 1) / (times[-1] - times[0]))
            identical &= all(ids == outs[0] for ids in outs)
    return {name: statistics.median(r) for name, r in rates.items()}, identical


class ReplayProposer:
    """Drafts each prompt's recorded greedy continuation (the target's own output), so every
    draft is accepted: speculation's best case, for the ceiling figure."""

    name = "replay"

    def __init__(self, continuations: dict[tuple, list[int]]):
        self.continuations = continuations

    def propose_batch(self, requests, num_tokens) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, num_tokens):
            output = self.continuations.get(tuple(request.prompt_token_ids), [])
            done = request.num_output_tokens
            drafts.append(list(output[done : done + k]))
        return drafts

    def release(self, request_id: str) -> None:
        pass


class _Contender:
    def __init__(self, engine):
        self.engine = engine
        self._ids = 0

    def run(self, prompts: list[tuple], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Requests together; per request its token ids and their arrival times."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        results: dict[str, tuple[list[int], list[float]]] = {}
        for prompt in prompts:
            self._ids += 1
            request_id = f"spec-bench-{self._ids}"
            results[request_id] = ([], [])
            self.engine.add_request(GenerationRequest(request_id, prompt, params))
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                ids, times = results[out.request_id]
                ids.extend(out.delta.token_ids)
                times.extend([now] * len(out.delta.token_ids))
        return list(results.values())


@dataclass(frozen=True)
class _SpecEngines:
    """The contenders' engines, sharing the target's weights; `draft` is None without a draft
    model, `draft_config` is its config either way."""

    plain: Any
    ngram: Any
    draft: Any
    ceiling: Any
    draft_config: EngineConfig


def run_bench_spec(
    model: str = DEFAULT_MODEL_NAME,
    *,
    data_path: Path,
    num_prompts: int = 8,
    num_documents: int = 3,
    max_tokens: int = 64,
    batch_max_tokens: int = 32,
    num_speculative_tokens: int = 4,
    repeats: int = 3,
    threads: int = 2,
    draft_model: str | Path | None = None,
    draft_quantization: str | None = "auto",
    wiki_prompt_tokens: int = 64,
    quantization: str | None = "auto",
) -> dict[str, Any]:
    """Measure plain decoding against prompt lookup, a draft model and the ceiling; return flat
    JSON (the command prints it with `print_table`)."""
    draft_model = str(draft_model) if draft_model else zoo_draft(model)
    torch.set_num_threads(threads)
    engines = _build_engines(model, num_speculative_tokens, draft_model, draft_quantization, quantization)
    tokenizer = engines.plain.tokenizer
    prompts = rag_prompts(data_path, tokenizer, max(num_prompts, 16), num_documents)
    wiki = wiki_prompts(data_path.parent, tokenizer, num_prompts, wiki_prompt_tokens)
    timed = prompts[:num_prompts]
    contenders = {"plain": _Contender(engines.plain), "ngram": _Contender(engines.ngram)}
    _warm_up(engines, contenders, timed, prompts[:16], max_tokens)
    ceiling = _ceiling_contenders(engines.ceiling, contenders["plain"], prompts, timed, max_tokens)

    # batch 1: one decode rate per (prompt, repeat), the contenders alternating; medians
    # (robust to the stalls other processes cause on a shared machine)
    rates, identical = _median_rates(contenders, timed, max_tokens, repeats)
    spec_stats = engines.ngram.stats()
    draft_figures = _draft_section(engines, contenders["plain"], wiki, timed, max_tokens, repeats)
    # batch 1, RAG prompts: plain against drafts that are always right
    ceiling_rates, _ = _median_rates(ceiling, timed, max_tokens, repeats)
    batch = _batch_rates(contenders, prompts[:16], batch_max_tokens, repeats)
    plain_rate, ngram_rate = rates["plain"], rates["ngram"]
    return {
        "model": model,
        "quantization": engines.plain.loaded.quantization or "none",
        "num_prompts": num_prompts,
        "mean_prompt_tokens": statistics.mean(len(p) for p in timed),
        "max_tokens": max_tokens,
        "num_speculative_tokens": num_speculative_tokens,
        "plain_decode_tokens_per_s": plain_rate,
        "ngram_decode_tokens_per_s": ngram_rate,
        "ngram_speedup": ngram_rate / plain_rate,
        "ngram_acceptance": spec_stats["spec_acceptance_rate"],
        "ngram_mean_accepted_length": spec_stats["spec_mean_accepted_length"],
        "outputs_identical": identical,
        "num_wiki_prompts": len(wiki),
        "mean_wiki_prompt_tokens": statistics.mean(len(p) for p in wiki),
        **draft_figures,
        "ceiling_decode_tokens_per_s": ceiling_rates["ceiling"],
        "ceiling_speedup": ceiling_rates["ceiling"] / ceiling_rates["plain"],
        "ceiling_acceptance": engines.ceiling.stats()["spec_acceptance_rate"],
        "ceiling_verification_steps": (num_speculative_tokens + 1)
        * ceiling_rates["plain"]
        / ceiling_rates["ceiling"],
        "batch16_plain_tokens_per_s": batch["plain"],
        "batch16_ngram_tokens_per_s": batch["ngram"],
        "batch16_ratio": batch["ngram"] / batch["plain"],
        "batch16_steps_switched_off": engines.ngram.stats()["spec_steps_switched_off"],
        "threads": threads,
    }


def _build_engines(
    model: str,
    num_speculative_tokens: int,
    draft_model: str | None,
    draft_quantization: str | None,
    quantization: str | None,
) -> _SpecEngines:
    """Plain, n-gram, draft-model and ceiling engines over one load of the target's weights."""
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.loading.loader import load_model, resolve_model_path

    quantization = None if quantization == "none" else quantization
    base = EngineConfig(
        model=model, num_kv_cache_tokens=32 * 1024, max_model_len=4096, quantization=quantization
    )
    loaded = load_model(
        resolve_model_path(model),
        device="cpu",
        dtype="float32",
        quantization=quantization,
        max_model_len=4096,
    )
    plain = build_llm_engine(base, loaded=loaded)
    spec_config = replace(base, speculative="ngram", num_speculative_tokens=num_speculative_tokens)
    ngram = build_llm_engine(spec_config, loaded=loaded, tokenizer=plain.tokenizer)
    draft_config = replace(
        base,
        speculative="draft",
        draft_model=draft_model,
        draft_quantization=draft_quantization,
        num_speculative_tokens=num_speculative_tokens,
    )
    draft = build_llm_engine(draft_config, loaded=loaded, tokenizer=plain.tokenizer) if draft_model else None
    ceiling = build_llm_engine(spec_config, loaded=loaded, tokenizer=plain.tokenizer)
    return _SpecEngines(plain, ngram, draft, ceiling, draft_config)


def _warm_up(
    engines: _SpecEngines,
    contenders: dict[str, _Contender],
    timed: list[tuple],
    batch: list[tuple],
    max_tokens: int,
) -> None:
    for engine in (engines.plain, engines.ngram, engines.draft, engines.ceiling):
        if engine is None:
            continue
        # Touch every page of the KV pool now: first writes fault pages in, which would
        # otherwise be timed (the free list hands out never-used blocks before reused ones).
        engine.kv_pool.kv.fill_(0.0)
    for c in contenders.values():  # warm-up: both step shapes (verification too), both batches
        for prompt in timed:
            c.run([prompt], max_tokens)
        c.run(batch, 4)


def _ceiling_contenders(
    ceiling: Any, plain: _Contender, prompts: list[tuple], timed: list[tuple], max_tokens: int
) -> dict[str, _Contender]:
    """Plain beside the ceiling engine, whose drafts replay plain's greedy outputs (warmed up)."""
    assert ceiling.speculator is not None  # its config asks for one
    ceiling.speculator.proposer = ReplayProposer(
        {p: ids for p, (ids, _) in zip(prompts, plain.run(timed, max_tokens))}
    )
    contenders = {"plain": plain, "ceiling": _Contender(ceiling)}
    for prompt in timed:
        contenders["ceiling"].run([prompt], max_tokens)
    return contenders


def _draft_section(
    engines: _SpecEngines,
    plain: _Contender,
    wiki: list[tuple],
    rag: list[tuple],
    max_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """The draft model's figures on the wiki prompts and the RAG ones; `draft_model` None
    without one."""
    from ragspeed.engine.native.core.spec_decode.draft import draft_quantization as resolve_draft_quantization

    if engines.draft is None:
        return {"draft_model": None}
    return {
        "draft_model": engines.draft_config.draft_model,
        "draft_quantization": resolve_draft_quantization(engines.draft_config) or "none",
        **_draft_figures(plain, _Contender(engines.draft), wiki, max_tokens, repeats, "draft"),
        **_draft_figures(plain, _Contender(engines.draft), rag, max_tokens, repeats, "draft_rag"),
    }


def _batch_rates(
    contenders: dict[str, _Contender], prompts: list[tuple], max_tokens: int, repeats: int
) -> dict[str, float]:
    """Batch 16, adaptive speculation against none: the median whole-run output rate."""
    batch: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, contender in contenders.items():
            start = time.perf_counter()
            outs = contender.run(prompts, max_tokens)
            batch[name].append(sum(len(ids) for ids, _ in outs) / (time.perf_counter() - start))
    return {name: statistics.median(rates) for name, rates in batch.items()}


def _draft_figures(
    plain, draft, prompts: list[tuple], max_tokens: int, repeats: int, prefix: str
) -> dict[str, Any]:
    """Batch 1: plain against the draft model on `prompts`; acceptance over the timed runs.
    Keys `<prefix>_*` (the rates: `<prefix>_plain_decode_tokens_per_s`, ...)."""
    for prompt in prompts:  # warm-up
        draft.run([prompt], max_tokens)
    before = draft.engine.stats()
    rates, identical = _median_rates({"plain": plain, "draft": draft}, prompts, max_tokens, repeats)
    after = draft.engine.stats()
    num_drafted, num_accepted, num_verified, num_switched_off = (
        after[key] - before[key]
        for key in (
            "spec_draft_tokens",
            "spec_accepted_tokens",
            "spec_verifications",
            "spec_steps_switched_off",
        )
    )
    figures = {
        "plain_decode_tokens_per_s": rates["plain"],
        "decode_tokens_per_s": rates["draft"],
        "speedup": rates["draft"] / rates["plain"],
        "acceptance": num_accepted / num_drafted if num_drafted else 0.0,
        "mean_accepted_length": num_accepted / num_verified if num_verified else 0.0,
        "outputs_identical": identical,
        "steps_switched_off": num_switched_off,
    }
    return {f"{prefix}_{key}": value for key, value in figures.items()}


def print_table(r: dict[str, Any]) -> None:
    print(machine_line(r["threads"]))
    print(
        f"speculative decoding, {r['model']} ({r['quantization']} weights), greedy,"
        f" k={r['num_speculative_tokens']}"
    )
    print(
        f"batch 1 ({r['num_prompts']} RAG prompts of ~{r['mean_prompt_tokens']:.0f} tokens,"
        f" {r['max_tokens']} output tokens):"
    )
    print(
        f"  decode tokens/s   plain {r['plain_decode_tokens_per_s']:8.1f}"
        f"   ngram {r['ngram_decode_tokens_per_s']:8.1f}   speedup {r['ngram_speedup']:.2f}x"
        f"  (target >= 0.97)"
    )
    print(
        f"  acceptance {r['ngram_acceptance']:.3f}, mean accepted length"
        f" {r['ngram_mean_accepted_length']:.2f}, outputs identical: {r['outputs_identical']}"
    )
    print(
        f"  ceiling (drafts replay the plain output, all accepted):"
        f" {r['ceiling_decode_tokens_per_s']:8.1f} tokens/s, speedup {r['ceiling_speedup']:.2f}x;"
        f" a verification of {r['num_speculative_tokens'] + 1} rows costs"
        f" {r['ceiling_verification_steps']:.2f} plain steps"
    )
    if r["draft_model"] is None:
        print(
            f"draft model: none built for {r['model']} (train one: ragspeed train-draft --target"
            f" {r['model']} --data-dir DATA [--out DIR; then --draft-model DIR])"
        )
    else:
        prompts = {
            "draft": f"{r['num_wiki_prompts']} wiki prompts of ~{r['mean_wiki_prompt_tokens']:.0f} tokens",
            "draft_rag": f"{r['num_prompts']} RAG prompts",
        }
        for prefix, described in prompts.items():
            print(
                f"batch 1 ({described}, draft {Path(r['draft_model']).name},"
                f" {r['draft_quantization']} weights):"
            )
            print(
                f"  decode tokens/s   plain {r[f'{prefix}_plain_decode_tokens_per_s']:8.1f}"
                f"   draft {r[f'{prefix}_decode_tokens_per_s']:8.1f}"
                f"   speedup {r[f'{prefix}_speedup']:.2f}x  (target >= 1.6)"
            )
            print(
                f"  acceptance {r[f'{prefix}_acceptance']:.3f}, mean accepted length"
                f" {r[f'{prefix}_mean_accepted_length']:.2f}, outputs identical:"
                f" {r[f'{prefix}_outputs_identical']}"
            )
    print(
        f"batch 16 (adaptive):  plain {r['batch16_plain_tokens_per_s']:8.1f} tokens/s"
        f"   ngram {r['batch16_ngram_tokens_per_s']:8.1f}   ratio {r['batch16_ratio']:.2f}"
        f"  (target >= 0.97)"
    )


@click.command("spec")
@click.option("--model", default=DEFAULT_MODEL_NAME, show_default=True, help="target model")
@qa_data_option(
    "nq_dev.jsonl-style questions, with wiki_passages.txt and wikitext2_raw_test.txt beside it",
    "data_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
)
@click.option("--num-prompts", default=8, show_default=True, type=click.IntRange(1, 16))
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(2))
@click.option("--num-speculative-tokens", default=4, show_default=True, type=click.IntRange(1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1))
@click.option(
    "--draft-model",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="draft model folder  [default: the draft the zoo ships for --model; none: no draft figures]",
)
@click.option(
    "--draft-quantization",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "none", "int8"]),
    help="the draft's weights (auto: int8 on a CPU)",
)
@quantization_option("the target's weights, as serve's --quantization")
@json_option
def bench_spec(
    model,
    data_path,
    num_prompts,
    max_tokens,
    num_speculative_tokens,
    repeats,
    threads,
    draft_model,
    draft_quantization,
    quantization,
    json_path,
) -> None:
    """Speculative decoding on and off: prompt lookup and draft model at batch 1, batch-16 ratio."""
    result = run_bench_spec(
        model,
        data_path=data_path,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        num_speculative_tokens=num_speculative_tokens,
        repeats=repeats,
        threads=threads,
        draft_model=draft_model,
        draft_quantization=draft_quantization,
        quantization=quantization,
    )
    print_table(result)
    write_json(json_path, result)
