"""`ragspeed bench fidelity`: does document KV reuse keep a model's answers? Per repair policy.

One process, one `LLMEngine` built as `ragspeed serve` builds it (the server's engine settings,
`--model` aside). Questions come from a QA file (the 100 NQ questions shipped in ragspeed/data by
default), each with its gold passage and the distractors before it up to `--documents`; prompts
are laid out as the gateway lays them out (gateway.prompt). Per question:

1. *exact*: full prefill (no document spans, as the gateway sends a request that does not reuse),
   greedy, with each token's top-20 distribution: the reference (ragspeed.evals.fidelity);
2. the documents stored: one request with the documents reversed and the document cache on
   (under a salt the policies share; the first `--cold-questions` questions instead give each
   policy a salt of its own, and that policy's request is timed as its *cold* TTFT);
3. per policy, in an order that rotates from one question to the next: *warm*, the documents in
   their own order, every one stored (placed in another order than they were computed in), greedy
   with distributions, timed to its first token; then its teacher-forced positions past the first
   divergence, one one-token request each (prompt + the reference's first t tokens).

Figures per policy against exact: identical greedy answers (Wilson 95% CI), teacher-forced top-1
agreement and mean KL (top 20), best-subspan accuracy and its paired change (bootstrap 95% CI),
median warm and cold TTFT. The result is written under the model's fidelity key (gateway.
fidelity_gate): `ragspeed serve` reads it at start-up to choose its default document-cache policy.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.ab.quality import accuracy as best_subspan
from ragspeed.bench.common import (
    json_option,
    machine_line,
    model_option,
    prefill_line,
    qa_data_option,
    write_json,
)
from ragspeed.document import Document
from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.evals.fidelity import (
    Distribution,
    QuestionFidelity,
    QuestionPrompts,
    generate,
    policy_fidelity,
    summarize_fidelity,
)
from ragspeed.evals.rag import DEFAULT_SYSTEM_PROMPT, RagExample, load_examples
from ragspeed.gateway.fidelity_gate import (
    EXACT,
    FIDELITY_GATE,
    FidelityResult,
    PolicyFigures,
    choose_default,
    engine_fidelity_key,
    write_result,
)

DEFAULT_POLICIES = "reuse,sink@8,sink@32,blend@15,blend@30"


def parse_policies(spec: str, glue: str) -> dict[str, DocumentCacheOptions]:
    """`reuse`, `sink@<k>` (tokens), `blend@<percent>`, comma-separated; raises ValueError."""
    policies: dict[str, DocumentCacheOptions] = {}
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        policy, _, value = name.partition("@")
        try:
            if policy == "reuse" and not value:
                options = DocumentCacheOptions("reuse", glue=glue)
            elif policy == "sink" and value:
                options = DocumentCacheOptions("sink", num_tokens=int(value), glue=glue)
            elif policy == "blend" and value:
                options = DocumentCacheOptions("blend", ratio=int(value) / 100, glue=glue)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"unknown policy {name!r}: reuse, sink@<tokens> or blend@<percent>") from None
        policies[name] = options
    if not policies:
        raise ValueError("no policy named")
    return policies


def select_documents(example: RagExample, num_documents: int) -> list[Document]:
    """The first `num_documents` documents, the gold one kept (in the last place when it stood
    further back)."""
    passages = list(example.documents)
    chosen = passages[:num_documents]
    gold = example.gold_index
    if gold is not None and gold >= num_documents:
        chosen = passages[: num_documents - 1] + [passages[gold]]
    return [Document(f"{example.line}-{i}", p.text, p.title) for i, p in enumerate(chosen)]


def measure(
    engine: Any,
    examples: Sequence[RagExample],
    policies: dict[str, DocumentCacheOptions],
    *,
    num_documents: int,
    max_tokens: int,
    cold_questions: int,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    echo: Any = click.echo,
) -> dict[str, Any]:
    """Every question through exact prefill and every policy; per-policy raw figures."""
    names = list(policies)
    raw: dict[str, dict[str, list[Any]]] = {
        name: {
            "fidelity": [],
            "accuracy": [],
            "warm_ms": [],
            "cold_ms": [],
            "recomputed": [],
            "prompt_tokens": [],
        }
        for name in [EXACT, *names]
    }
    # Warm-up, neither timed nor scored: kernels, allocators, the system prompt's prefix.
    warm_up = QuestionPrompts(
        engine.tokenizer, system_prompt, examples[0].question, select_documents(examples[0], 2)
    )
    generate(engine, warm_up.request(warm_up.full, None, "warmup", 1))
    generate(engine, warm_up.request(warm_up.spanned, policies[names[0]], "warmup", 1))
    for q, example in enumerate(examples):
        t0 = time.perf_counter()
        prompts = QuestionPrompts(
            engine.tokenizer, system_prompt, example.question, select_documents(example, num_documents)
        )
        reference = generate(engine, prompts.request(prompts.full, None, EXACT, max_tokens))
        raw[EXACT]["warm_ms"].append(1000 * reference.ttft_s)
        raw[EXACT]["cold_ms"].append(1000 * reference.ttft_s)
        reference_text = engine.tokenizer.decode(list(reference.token_ids), skip_special_tokens=True)
        raw[EXACT]["accuracy"].append(best_subspan(reference_text, example.answers))
        cold = q < cold_questions
        reference_forced: dict[int, Distribution] = {}  # full prefill's forced steps, shared
        if not cold:  # the documents stored once for every policy
            first = policies[names[0]]
            generate(engine, prompts.request(prompts.reversed, first, f"shared-{q}", 1))
        k = q % len(names)
        for name in names[k:] + names[:k]:
            options, salt = policies[name], f"{name}-{q}" if cold else f"shared-{q}"
            if cold:
                stored = generate(engine, prompts.request(prompts.reversed, options, salt, 1))
                raw[name]["cold_ms"].append(1000 * stored.ttft_s)
            fidelity, greedy = policy_fidelity(
                engine, prompts, reference, options, salt, max_tokens, reference_forced, EXACT
            )
            raw[name]["fidelity"].append(fidelity)
            text = engine.tokenizer.decode(list(greedy.token_ids), skip_special_tokens=True)
            raw[name]["accuracy"].append(best_subspan(text, example.answers))
            raw[name]["warm_ms"].append(1000 * greedy.ttft_s)
            raw[name]["recomputed"].append(greedy.recomputed_tokens or 0)
        identical = " ".join(f"{n}={'=' if raw[n]['fidelity'][-1].identical else 'x'}" for n in names)
        echo(f"question {q + 1}/{len(examples)} ({time.perf_counter() - t0:.0f} s): {identical}")
        raw[EXACT]["prompt_tokens"].append(len(prompts.full.token_ids))
    return raw


def summarize(
    raw: dict[str, dict[str, list[Any]]], policies: dict[str, DocumentCacheOptions]
) -> dict[str, Any]:
    """Per policy: fidelity figures against exact, TTFTs and their ratio to exact's."""
    exact_warm = statistics.median(raw[EXACT]["warm_ms"])
    table: dict[str, Any] = {
        EXACT: {
            "accuracy": statistics.mean(raw[EXACT]["accuracy"]),
            "ttft_warm_ms": exact_warm,
            "ttft_cold_ms": exact_warm,
        }
    }
    for name, options in policies.items():
        r = raw[name]
        fidelity: list[QuestionFidelity] = r["fidelity"]
        figures = summarize_fidelity(fidelity, r["accuracy"], raw[EXACT]["accuracy"])
        warm = statistics.median(r["warm_ms"])
        entry: dict[str, Any] = {
            "options": {
                "policy": options.policy,
                "num_tokens": options.num_tokens,
                "ratio": options.ratio,
                "glue": options.glue,
            },
            **figures,
            "ttft_warm_ms": warm,
            "warm_over_exact": warm / exact_warm,
            "ttft_cold_ms": statistics.median(r["cold_ms"]) if r["cold_ms"] else None,
            "recomputed_tokens_p50": statistics.median(r["recomputed"]),
        }
        entry["gate"] = "; ".join(FIDELITY_GATE.failures(_policy_figures(name, entry))) or "pass"
        table[name] = entry
    return table


def _policy_figures(name: str, entry: dict[str, Any]) -> PolicyFigures:
    return PolicyFigures(
        name=name,
        options=entry["options"],
        num_questions=entry["num_questions"],
        identical=entry["identical"],
        top1_agreement=entry["top1_agreement"] if entry["top1_agreement"] is not None else 1.0,
        kl_mean=entry["kl_mean"] if entry["kl_mean"] is not None else 0.0,
        ttft_warm_ms=entry["ttft_warm_ms"],
        ttft_cold_ms=entry.get("ttft_cold_ms"),
    )


def _ci(e: dict[str, float]) -> str:
    return f"{e['value']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}]"


def format_table(table: dict[str, Any]) -> str:
    header = (
        "policy",
        "identical [95% CI]",
        "top-1",
        "KL",
        "acc - exact [95% CI]",
        "warm TTFT",
        "x exact",
        "cold TTFT",
        "gate",
    )
    rows = [
        (
            EXACT,
            "-",
            "-",
            "-",
            f"{table[EXACT]['accuracy']:.3f} (acc)",
            f"{table[EXACT]['ttft_warm_ms']:.0f} ms",
            "1.000",
            "-",
            "-",
        )
    ]
    for name, s in table.items():
        if name == EXACT:
            continue
        low, high = s["identical_ci"]
        cold = "-" if s["ttft_cold_ms"] is None else f"{s['ttft_cold_ms']:.0f} ms"
        rows.append(
            (
                name,
                f"{s['identical']:.3f} [{low:.2f}, {high:.2f}]",
                f"{s['top1_agreement']:.3f}" if s["top1_agreement"] is not None else "-",
                f"{s['kl_mean']:.3f}" if s["kl_mean"] is not None else "-",
                _ci(s["accuracy_minus_full"]),
                f"{s['ttft_warm_ms']:.0f} ms",
                f"{s['warm_over_exact']:.3f}",
                cold,
                "pass" if s["gate"] == "pass" else "fail",
            )
        )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_bench_fidelity(
    model: str,
    json_path: str | None = None,
    *,
    data: Path,
    policies: str = DEFAULT_POLICIES,
    glue: str = "reuse",
    limit: int = 30,
    num_documents: int = 10,
    max_tokens: int = 32,
    cold_questions: int = 3,
    save: bool = True,
    results_dir: Path | None = None,
    engine_values: dict[str, Any] | None = None,
    echo: Any = click.echo,
) -> dict[str, Any]:
    """Measure, print the table, write the JSON and (with `save`) the gate's result file."""
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.gateway.settings import Settings

    chosen = parse_policies(policies, glue)
    examples, _ = load_examples(data)
    examples = examples[:limit]
    if not examples:
        raise ValueError(f"{data}: no valid question")
    if num_documents < 1:
        raise ValueError(f"--documents must be >= 1, got {num_documents}")
    settings = Settings(**{"model": model, **(engine_values or {})})  # the server's engine, as served
    engine = build_llm_engine(settings.engine.config())
    if engine.documents is None:
        raise ValueError(
            f"{model}: its rope cannot be shifted, so document KV is never reused: exact prefill"
        )
    machine = f"{machine_line(torch.get_num_threads())}; {prefill_line(engine)}"
    echo(machine)
    t0 = time.perf_counter()
    with torch.inference_mode():
        raw = measure(
            engine,
            examples,
            chosen,
            num_documents=num_documents,
            max_tokens=max_tokens,
            cold_questions=min(cold_questions, len(examples)),
            echo=echo,
        )
    table = summarize(raw, chosen)
    key = engine_fidelity_key(engine)
    result = FidelityResult(
        key=key,
        model=model,
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=machine,
        num_questions=len(examples),
        policies=tuple(_policy_figures(name, table[name]) for name in chosen),
        data=f"{data} (first {len(examples)} questions, {num_documents} documents each)",
        ttft_exact_ms=table[EXACT]["ttft_warm_ms"],
    )
    decision = choose_default(result)
    report = {
        "model": model,
        "machine": machine,
        "data": result.data,
        "num_questions": len(examples),
        "num_documents": num_documents,
        "prompt_tokens_p50": statistics.median(raw[EXACT]["prompt_tokens"]),
        "max_tokens": max_tokens,
        "glue": glue,
        "cold_questions": min(cold_questions, len(examples)),
        "run_s": round(time.perf_counter() - t0, 1),
        "gate": {
            "min_identical": FIDELITY_GATE.min_identical,
            "min_top1_agreement": FIDELITY_GATE.min_top1_agreement,
        },
        "default": decision.as_dict(),
        "fidelity_key": key,
        "policies": table,
    }
    echo(
        f"{model}: {len(examples)} questions, {num_documents} documents "
        f"({report['prompt_tokens_p50']:.0f} prompt tokens p50), glue {glue}, greedy {max_tokens} tokens"
    )
    echo(format_table(table))
    echo(decision.describe())
    if save:
        report["result_file"] = str(write_result(result, results_dir))
        echo(f"written for `ragspeed serve`: {report['result_file']}")
    write_json(json_path, report)
    return report


@click.command("fidelity")
@model_option
@json_option
@qa_data_option(
    "QA jsonl (question, answers, documents)", type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--policies", default=DEFAULT_POLICIES, show_default=True, help="reuse, sink@<tokens>, blend@<percent>"
)
@click.option("--glue", default="reuse", type=click.Choice(["recompute", "reuse"]), show_default=True)
@click.option("--limit", default=30, type=click.IntRange(min=1), show_default=True, help="questions")
@click.option(
    "--documents",
    "num_documents",
    default=10,
    type=click.IntRange(min=1),
    show_default=True,
    help="documents per question (the gold one kept)",
)
@click.option("--max-tokens", default=32, type=click.IntRange(min=1), show_default=True)
@click.option(
    "--cold-questions",
    default=3,
    type=click.IntRange(min=0),
    show_default=True,
    help="questions whose cold TTFT each policy measures",
)
@click.option(
    "--save/--no-save", default=True, show_default=True, help="write the result that `ragspeed serve` reads"
)
def bench_fidelity(
    model: str,
    json_path: str | None,
    data: Path,
    policies: str,
    glue: str,
    limit: int,
    num_documents: int,
    max_tokens: int,
    cold_questions: int,
    save: bool,
) -> None:
    """Fidelity of document KV reuse against full prefill, per repair policy; the server's default."""
    try:
        run_bench_fidelity(
            model,
            json_path,
            data=data,
            policies=policies,
            glue=glue,
            limit=limit,
            num_documents=num_documents,
            max_tokens=max_tokens,
            cold_questions=cold_questions,
            save=save,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
