"""`ragspeed eval rag`: answer accuracy beside latency, through the real gateway and engine.

Every question of a QA file (`nq_dev.jsonl`) is sent to the gateway app, in this process and
over ASGI (its middleware, routes, pipeline, engine and SSE), once per *configuration*:

- `full`: the question's documents as given, uncompressed;
- `<method>@<N>x`: the documents compressed by a registered compressor to 1/N of their tokens
  (rate 1/N), e.g. `coarse-to-fine@4x`, `first-docs@2x`;
- `retrieval`: no documents sent; the gateway retrieves the question's top-k passages from a
  collection of every passage of the file (all its valid lines, not only the first `limit`;
  deduplicated), built before the first question;
- `kv-reuse`, `kv-sink@<k>`, `kv-blend@<percent>`: the documents uncompressed, their KV reused
  from the gateway's document store with that repair policy (`ragspeed.document_cache`), the
  glue between documents recomputed, or with `:glue` after the name (`kv-reuse:glue`) reused; and
  `<method>@<N>x+kv-...`: compressed, then reused (only whole documents, as a selecting method
  keeps them, are found again).

A document-cache configuration answers each question twice: first with the documents in reverse
order (*cold*: its TTFT is the first-sight figure; the documents are prefilled one by one into
the store), then in their own order (*warm*: every document is in the store, but no prefix of
the prompt beyond the first document is in the prefix cache), which is scored and timed as TTFT.

Requests are greedy chat completions, streamed. *TTFT* is the time from sending the request to
the first chunk with content, *e2e* to the end of the stream; prompt tokens come from the usage.

Schedule: one warm-up request per configuration (the first question, one token, neither timed
nor scored: it loads what the configuration needs and shows a configuration that cannot run);
then question by question, each configuration in turn, the order rotating from one question to
the next so that drift of the machine falls on all alike. Each configuration sends its own
`cache_salt`, so none reuses the KV of another's prompt for the same question; the compressors
share the gateway's embedding cache, so the sentences of a question are embedded by the first
configuration of a method to see them and found warm by its other rates.

Scores (texts normalised SQuAD-style: `ragspeed.ab.quality`): *accuracy* is best-subspan, as in
"Lost in the Middle" (a gold answer is a substring of the output); *EM* and token *F1* as in
SQuAD. A configuration's accuracy against full context's is a *paired* difference: over the
questions both answered, with a bootstrap 95% CI that resamples questions. Accuracy by gold
position groups the questions by `gold_index` (0, 4, 9, 14, 19 in the NQ file): the
lost-in-the-middle curve.

Fidelity against `full` (ragspeed.evals.fidelity), per configuration on the questions both
answered: the share of answers identical to full's (Wilson 95% CI); and, for the document-cache
configurations of uncompressed documents (`--teacher-forced`, on by default), teacher-forced along
full's answer on the gateway's own engine (`NativeEngine.call`, the gateway's prompt layout, each
configuration's salt: its documents are in the store), the top-1 agreement and mean KL of the
next-token distributions. Compressed and retrieved prompts differ from full's: no teacher-forced
figure.

A configuration *fails* when the gateway refuses its warm-up (an unknown method, a compressor
that cannot be built: a 4xx) or its compressor raises (the gateway then fails open and sends the
documents uncompressed): it is reported with the error, its remaining requests are not sent, and
the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragspeed.ab.quality import accuracy, exact_match, f1
from ragspeed.ab.stats import paired_bootstrap_difference
from ragspeed.ab.workload import SkippedLine
from ragspeed.bench.common import percentile
from ragspeed.compression.registry import COMPRESSORS, DEFAULT_METHOD
from ragspeed.document import Document
from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.evals.fidelity import QuestionFidelity, binomial_ci, summarize_fidelity
from ragspeed.gateway.settings import Settings
from ragspeed.retrieval.documents import document_id

if TYPE_CHECKING:  # the gateway app is imported only when a run starts
    from ragspeed.evals.rag_gateway import StreamedReply

# The instruction of "Lost in the Middle"'s QA prompt.
DEFAULT_SYSTEM_PROMPT = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
METHODS = ("coarse-to-fine", "fast", "bm25", "llmlingua2", "first-docs")
FACTORS = (2, 4, 8, 16)
FULL, RETRIEVAL = "full", "retrieval"
COLLECTION = "eval-rag"
DEFAULT_TOP_K = 5
_COMPRESSED = re.compile(r"^(?P<method>[a-z0-9-]+)@(?P<factor>\d+)x$")
_DOCUMENT_CACHE = re.compile(r"^kv-(?P<policy>reuse|sink|blend)(@(?P<value>\d+))?(?P<glue>:glue)?$")


# ---------------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class RagExample:
    line: int  # 1-based line of the data file
    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Passage, ...]
    gold_index: int | None  # the gold document's position; None when unknown


def parse_example(text: str, line: int) -> RagExample:
    """One JSONL line; raises ValueError naming what is wrong with it."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' is missing or not a non-empty string")
    answers = record.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError("'answers' is missing or not a non-empty list of strings")
    documents = record.get("documents")
    if not isinstance(documents, list) or not documents:
        raise ValueError("'documents' is missing or not a non-empty list")
    passages = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            passages.append(Passage("", doc))
        elif isinstance(doc, dict) and isinstance(doc.get("text"), str):
            passages.append(Passage(str(doc.get("title") or ""), doc["text"]))
        else:
            raise ValueError(f"documents[{i}] is neither a string nor an object with a string 'text'")
    gold_index = record.get("gold_index")
    if gold_index is None:
        gold = [i for i, d in enumerate(documents) if isinstance(d, dict) and d.get("is_gold")]
        gold_index = gold[0] if len(gold) == 1 else None
    elif not isinstance(gold_index, int) or not 0 <= gold_index < len(passages):
        raise ValueError(f"'gold_index' {gold_index!r} is not a position among the {len(passages)} documents")
    return RagExample(
        line, str(record.get("id", f"line-{line}")), question, tuple(answers), tuple(passages), gold_index
    )


def load_examples(path: str | Path) -> tuple[list[RagExample], list[SkippedLine]]:
    """Every valid line of a QA file, and the skipped ones with their line numbers and reasons."""
    examples: list[RagExample] = []
    skipped: list[SkippedLine] = []
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                examples.append(parse_example(text, number))
            except ValueError as exc:
                skipped.append(SkippedLine(number, str(exc)))
    return examples, skipped


def distinct_passages(examples: Sequence[RagExample]) -> list[Passage]:
    """Every passage once, in order of first appearance (texts equal up to white space are one)."""
    seen: dict[str, Passage] = {}
    for example in examples:
        for passage in example.documents:
            seen.setdefault(" ".join(passage.text.split()), passage)
    return list(seen.values())


# ------------------------------------------------------------------------- the configurations


@dataclass(frozen=True)
class RagConfig:
    """A named way of answering: the request's `ragspeed` object, and whether the question's
    own documents are sent."""

    name: str
    ragspeed: Mapping[str, Any]
    send_documents: bool = True

    @property
    def needs_collection(self) -> bool:
        return "retrieval" in self.ragspeed

    @property
    def reuses_documents(self) -> bool:
        return isinstance(self.ragspeed.get("document_cache"), dict)


# Configurations other than the document-cache ones prefill every token: the server's default
# document cache would otherwise reuse uncompressed (and retrieved) documents in them too.
NO_REUSE = {"document_cache": False}


def full_config(top_k: int) -> RagConfig:
    return RagConfig(FULL, {"compression": False, **NO_REUSE})


def retrieval_config(top_k: int) -> RagConfig:
    options = {
        "retrieval": {"collection": COLLECTION, "top_k": top_k, "mode": "hybrid"},
        "compression": False,
        **NO_REUSE,
    }
    return RagConfig(RETRIEVAL, options, send_documents=False)


def compressed_config(method: str, factor: int) -> RagConfig:
    compression = {"method": method, "rate": 1.0 / factor}
    return RagConfig(f"{method}@{factor}x", {"compression": compression, **NO_REUSE})


def document_cache_config(name: str) -> RagConfig | None:
    """`kv-reuse`, `kv-sink@<k>` (k tokens, default 16), `kv-blend@<percent>` (default 15);
    `:glue` after any: the glue between documents reused too (else recomputed)."""
    match = _DOCUMENT_CACHE.match(name)
    if match is None:
        return None
    policy, value = match["policy"], match["value"]
    options: dict[str, Any] = {"policy": policy, "glue": "reuse" if match["glue"] else "recompute"}
    if policy == "sink":
        options["tokens"] = int(value or 16)
    elif policy == "blend":
        options["ratio"] = int(value or 15) / 100
    elif value is not None:
        return None
    return RagConfig(name, {"compression": False, "document_cache": options})


# The configurations without a parameter in their name.
FIXED_CONFIGS: dict[str, Callable[[int], RagConfig]] = {FULL: full_config, RETRIEVAL: retrieval_config}


def default_config_names() -> list[str]:
    return [FULL, *(f"{m}@{f}x" for m in METHODS for f in FACTORS), RETRIEVAL]


def parse_configs(spec: str, *, top_k: int = DEFAULT_TOP_K) -> list[RagConfig]:
    """`all`, or comma-separated names: `full`, `retrieval`, `<method>@<N>x` (any registered
    compression method, N >= 2). Raises ValueError naming the valid names."""
    from ragspeed.compression.registry import COMPRESSORS

    names = (
        default_config_names() if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    )
    if not names:
        raise ValueError("no configuration named; " + _valid_names(COMPRESSORS))
    configs: list[RagConfig] = []
    for name in names:
        config = _one_config(name, top_k)
        if config is None:
            raise ValueError(f"unknown configuration {name!r}; " + _valid_names(COMPRESSORS))
        if any(c.name == config.name for c in configs):
            raise ValueError(f"configuration {name!r} is named twice")
        configs.append(config)
    return configs


def _one_config(name: str, top_k: int) -> RagConfig | None:
    head, _, reuse = name.partition("+")
    match = _COMPRESSED.match(head)
    if name in FIXED_CONFIGS:
        return FIXED_CONFIGS[name](top_k)
    if match and match["method"] in COMPRESSORS and int(match["factor"]) >= 2:
        config = compressed_config(match["method"], int(match["factor"]))
        if not reuse:
            return config
        cached = document_cache_config(reuse)
        if cached is None:
            return None
        return RagConfig(name, {**config.ragspeed, "document_cache": cached.ragspeed["document_cache"]})
    return None if reuse else document_cache_config(name)


def _valid_names(methods: Mapping[str, Any]) -> str:
    return (
        f"valid: all, {', '.join(default_config_names())}; <method>@<N>x with N >= 2 and a method "
        f"among {', '.join(sorted(methods))}; kv-reuse, kv-sink@<k>, kv-blend@<percent>, each "
        "with an optional :glue; or <method>@<N>x+kv-..."
    )


def request_body(
    config: RagConfig,
    example: RagExample,
    *,
    system_prompt: str,
    max_tokens: int,
    cache_salt: str,
    reverse: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": example.question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": cache_salt,
        "ragspeed": json.loads(json.dumps(config.ragspeed)),  # a plain copy
    }
    if config.send_documents:
        documents = reversed(example.documents) if reverse else example.documents
        body["documents"] = [{"title": d.title, "text": d.text} for d in documents]
    return body


# ------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RagObservation:
    """One question answered by one configuration."""

    config: str
    example: int  # index into the run's examples
    ok: bool
    error: str | None = None
    text: str = ""
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    cold_ttft_ms: float | None = None  # a document-cache configuration's first sight
    documents_hit: int | None = None  # of the document store, in the warm request
    recomputed_tokens: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    compression_ms: float | None = None  # the gateway's compression stage
    compressed: bool | None = None  # None: no compression asked; False: the gateway skipped it
    accuracy: float | None = None
    exact_match: float | None = None
    f1: float | None = None


@dataclass(frozen=True)
class RagRun:
    examples: tuple[RagExample, ...]
    configs: tuple[RagConfig, ...]
    observations: tuple[RagObservation, ...]
    failures: Mapping[str, str]  # configuration -> why it failed
    setup: Mapping[str, Any] = field(default_factory=dict)
    # configuration -> example index -> teacher-forced fidelity against full (`--teacher-forced`)
    fidelity: Mapping[str, Mapping[int, QuestionFidelity]] = field(default_factory=dict)


def _ttft_ms(reply: StreamedReply) -> float:
    end = reply.end_s if reply.end_s is not None else 0.0
    return 1000 * (reply.first_content_s if reply.first_content_s is not None else end)


def observe(
    config: RagConfig,
    index: int,
    example: RagExample,
    reply: StreamedReply,
    cold: StreamedReply | None = None,
) -> RagObservation:
    """A `StreamedReply` scored against the example's answers (`cold`: the first-sight reply of
    a document-cache configuration)."""
    error = reply.error if reply.error is not None else cold.error if cold is not None else None
    if error is not None:
        return RagObservation(config.name, index, ok=False, error=error)
    usage, ragspeed = reply.usage, reply.ragspeed
    compression = ragspeed.get("compression")
    documents = ragspeed.get("document_cache") or {}
    end = reply.end_s if reply.end_s is not None else 0.0
    return RagObservation(
        config=config.name,
        example=index,
        ok=True,
        text=reply.text,
        ttft_ms=_ttft_ms(reply),
        e2e_ms=1000 * end,
        cold_ttft_ms=_ttft_ms(cold) if cold is not None else None,
        documents_hit=documents.get("documents_hit"),
        recomputed_tokens=documents.get("recomputed_tokens"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        compression_ms=(ragspeed.get("timings_ms") or {}).get("compression"),
        compressed=None if compression is None else not compression.get("skipped_reason"),
        accuracy=accuracy(reply.text, example.answers),
        exact_match=exact_match(reply.text, example.answers),
        f1=f1(reply.text, example.answers),
    )


def compressor_failure(reply: StreamedReply, errors: list[str]) -> str | None:
    """Why the compressor of this reply failed (the gateway fell back to the full documents), or None."""
    compression = reply.ragspeed.get("compression") or {}
    if not compression.get("failed"):
        return None
    cause = errors[-1] if errors else "no error logged"
    return f"the compressor {compression.get('method')!r} raised ({cause}); the gateway sent the documents uncompressed"


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """`items` starting at position `by` (mod their number): 0 1 2, 1 2 0, 2 0 1, ..."""
    if not items:
        return []
    k = by % len(items)
    return [*items[k:], *items[:k]]


async def run_configs(
    settings: Settings,
    examples: Sequence[RagExample],
    configs: Sequence[RagConfig],
    *,
    passages: Sequence[Passage] = (),
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    max_tokens: int = 32,
    on_done: Callable[[str], None] = lambda config: None,
    teacher_forced: bool = True,
) -> RagRun:
    """Start the gateway of `settings`, build the retrieval collection of `passages` when a
    configuration retrieves, warm every configuration up, then answer every example with every
    configuration (and, with `teacher_forced`, measure the document-cache ones along full's
    answer). `on_done(config name)` is called after each request, warm-ups included."""
    from ragspeed.evals.rag_gateway import CompressorErrors, running_gateway

    setup: dict[str, Any] = {}
    failures: dict[str, str] = {}
    observations: list[RagObservation] = []
    fidelity: dict[str, dict[int, QuestionFidelity]] = {}

    def body(
        config: RagConfig, example: RagExample, salt: str, tokens: int, reverse: bool = False
    ) -> dict[str, Any]:
        return request_body(
            config, example, system_prompt=system_prompt, max_tokens=tokens, cache_salt=salt, reverse=reverse
        )

    t0 = time.perf_counter()
    with CompressorErrors() as logged:
        async with running_gateway(settings) as app:
            setup["gateway_start_s"] = round(time.perf_counter() - t0, 2)
            if any(c.needs_collection for c in configs):
                setup.update(await _build_collection(app, passages))
            for config in configs:
                # A salt of its own: the warm-up must not leave the first question's KV cached.
                reply = await _stream_chat(app, body(config, examples[0], f"warmup-{config.name}", 1))
                failure = reply.error or compressor_failure(reply, logged.errors)
                if failure:
                    failures[config.name] = failure
                on_done(config.name)
            for index, example in enumerate(examples):
                for config in rotated(configs, index):
                    if config.name not in failures:
                        observation = await _answer(
                            app, body, config, index, example, max_tokens, logged.errors
                        )
                        if isinstance(observation, str):
                            failures[config.name] = observation
                        else:
                            observations.append(observation)
                    on_done(config.name)
                forced = [c for c in teacher_forced_configs(configs) if c.name not in failures]
                if teacher_forced and forced and FULL not in failures:
                    measured = await _teacher_forced(
                        app, settings, example, forced, system_prompt=system_prompt, max_tokens=max_tokens
                    )
                    for name, question in measured.items():
                        fidelity.setdefault(name, {})[index] = question
    setup["run_s"] = round(time.perf_counter() - t0, 2)
    # A configuration that failed part way reports no figures: they would mix two kinds of answer.
    kept = tuple(o for o in observations if o.config not in failures)
    return RagRun(tuple(examples), tuple(configs), kept, failures, setup, fidelity)


def teacher_forced_configs(configs: Sequence[RagConfig]) -> list[RagConfig]:
    """The configurations whose prompt is full's with its documents reused: the document-cache
    ones of uncompressed documents."""
    return [c for c in configs if c.reuses_documents and c.ragspeed.get("compression") is False]


def document_cache_options(config: RagConfig, settings: Settings) -> DocumentCacheOptions:
    """A configuration's `ragspeed.document_cache` as the gateway resolves it (the settings
    fill what it does not name)."""
    asked, configured = config.ragspeed["document_cache"], settings.engine.document_cache_options()
    return DocumentCacheOptions(
        policy=asked.get("policy", configured.policy),
        num_tokens=asked.get("tokens", configured.num_tokens),
        ratio=asked.get("ratio", configured.ratio),
        glue=asked.get("glue", configured.glue),
    )


async def _teacher_forced(
    app: Any,
    settings: Settings,
    example: RagExample,
    configs: Sequence[RagConfig],
    *,
    system_prompt: str,
    max_tokens: int,
) -> dict[str, QuestionFidelity]:
    """Full prefill's greedy answer on the gateway's engine, then each configuration along it
    (ragspeed.evals.fidelity), on the engine's thread; {} on an engine that cannot run it."""
    from ragspeed.evals.fidelity import QuestionPrompts, generate, policy_fidelity

    engine = app.state.services.engine
    if not hasattr(engine, "call"):  # not the native engine
        return {}
    documents = [Document(f"{example.line}-{i}", p.text, p.title) for i, p in enumerate(example.documents)]
    policies = {c.name: document_cache_options(c, settings) for c in configs}

    def measure(llm: Any) -> dict[str, QuestionFidelity]:
        import torch

        with torch.inference_mode():
            prompts = QuestionPrompts(llm.tokenizer, system_prompt, example.question, documents)
            reference = generate(llm, prompts.request(prompts.full, None, "teacher-full", max_tokens))
            forced: dict = {}  # full prefill's forced steps, shared by the configurations
            return {
                name: policy_fidelity(
                    llm, prompts, reference, options, f"eval-{name}", max_tokens, forced, "teacher-full"
                )[0]
                for name, options in policies.items()
            }

    return await engine.call(measure)


async def _build_collection(app: Any, passages: Sequence[Passage]) -> dict[str, Any]:
    """The retrieval collection of `passages`: its size and the seconds it took."""
    from ragspeed.evals.rag_gateway import create_collection

    t1 = time.perf_counter()
    # Ids given: the store makes content ids only for documents it chunks.
    documents = [{"id": document_id(p.title, p.text), "title": p.title, "text": p.text} for p in passages]
    num_documents = await create_collection(app, COLLECTION, documents)
    return {"collection_documents": num_documents, "collection_build_s": round(time.perf_counter() - t1, 2)}


async def _stream_chat(app: Any, body: dict[str, Any]) -> StreamedReply:
    """rag_gateway.stream_chat, imported when a run starts."""
    from ragspeed.evals.rag_gateway import stream_chat

    return await stream_chat(app, body)


async def _answer(
    app: Any,
    body: Callable[..., dict[str, Any]],
    config: RagConfig,
    index: int,
    example: RagExample,
    max_tokens: int,
    logged_errors: list[str],
) -> RagObservation | str:
    """One example answered by one configuration (its documents seen first in another order
    when it reuses them): the observation, or why the configuration failed."""
    salt = f"eval-{config.name}"
    cold = None
    if config.reuses_documents:  # first sight, in another order
        cold = await _stream_chat(app, body(config, example, salt, max_tokens, reverse=True))
    reply = await _stream_chat(app, body(config, example, salt, max_tokens))
    failure = compressor_failure(reply, logged_errors)
    return failure if failure else observe(config, index, example, reply, cold)


def offered_methods(configs: Sequence[RagConfig], settings_values: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's compressors: those the configurations name, each loaded at start-up (none
    else); llmlingua2 only with its model (`--set compression_llmlingua2_model=DIR`): without,
    its configurations fail with the gateway's 400 while the others run."""
    named = {
        c.ragspeed["compression"]["method"]
        for c in configs
        if isinstance(c.ragspeed.get("compression"), dict)
    }
    if not settings_values.get("compression_llmlingua2_model"):
        named.discard("llmlingua2")
    methods = sorted(named & set(COMPRESSORS)) or ["identity"]  # an unknown one: the gateway's 400
    default = DEFAULT_METHOD if DEFAULT_METHOD in methods else methods[0]
    return {"compression_methods": methods, "compression_default_method": default}


def run_rag_eval(
    data: str | Path,
    configs: Sequence[RagConfig],
    *,
    limit: int | None = None,
    settings_values: Mapping[str, Any] | None = None,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    max_tokens: int = 32,
    on_done: Callable[[str], None] = lambda config: None,
    num_resamples: int = 2000,
    seed: int = 0,
    teacher_forced: bool = True,
) -> dict[str, Any]:
    """Load the data, run every configuration through a gateway of `settings_values` (Settings
    fields; nothing persisted), and return the report (`summarize`)."""
    all_examples, skipped = load_examples(data)
    examples = all_examples[:limit] if limit is not None else all_examples
    if not examples:
        raise ValueError(f"{data}: no valid question (skipped {len(skipped)} line(s))")
    with tempfile.TemporaryDirectory(prefix="ragspeed-eval-rag-") as tmp:
        values: dict[str, Any] = {
            "prompt_cache_dir": None,
            "document_cache_dir": None,  # RAM only: a run finds no documents stored by another
            "collections_dir": str(Path(tmp) / "collections"),
            **offered_methods(configs, settings_values or {}),
        }
        values.update(settings_values or {})
        settings = Settings(**values)
        run = asyncio.run(
            run_configs(
                settings,
                examples,
                configs,
                passages=distinct_passages(all_examples),
                system_prompt=system_prompt,
                max_tokens=max_tokens,
                on_done=on_done,
                teacher_forced=teacher_forced,
            )
        )
    report = summarize(run, num_resamples=num_resamples, seed=seed)
    report["setup"] = {
        "data": str(data),
        "model": settings.engine.model,
        "engine": settings.engine.backend,
        "compression_order": settings.compression.order,
        "max_tokens": max_tokens,
        "num_examples": len(examples),
        "num_resamples": num_resamples,
        "seed": seed,
        "system_prompt": system_prompt,
        **run.setup,
    }
    report["skipped_lines"] = [asdict(s) for s in skipped]
    return report


# ------------------------------------------------------------------------------ the figures


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run: RagRun, *, num_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per configuration: scores, latencies, the paired difference to `full`, accuracy by gold
    position; and every observation."""
    by_config: dict[str, dict[int, RagObservation]] = {c.name: {} for c in run.configs}
    for o in run.observations:
        by_config[o.config][o.example] = o
    full = by_config.get(FULL) if FULL not in run.failures else None
    positions = sorted({e.gold_index for e in run.examples if e.gold_index is not None})
    configs: dict[str, Any] = {}
    for config in run.configs:
        if config.name in run.failures:
            configs[config.name] = {"status": "failed", "error": run.failures[config.name]}
            continue
        answered = by_config[config.name]
        ok = [o for o in answered.values() if o.ok]
        configs[config.name] = {
            **_scores_and_latencies(run, answered, ok),
            "accuracy_minus_full": _minus_full(answered, full, num_resamples, seed),
            "fidelity": _fidelity(answered, full, run.fidelity.get(config.name)),
            "accuracy_by_gold_index": _by_gold_index(run, ok, positions),
        }
    observations = [
        {
            **asdict(o),
            "id": run.examples[o.example].id,
            "line": run.examples[o.example].line,
            "gold_index": run.examples[o.example].gold_index,
        }
        for o in run.observations
    ]
    return {
        "configs": configs,
        "failed": dict(run.failures),
        "gold_positions": positions,
        "observations": observations,
    }


def _scores_and_latencies(
    run: RagRun, answered: dict[int, RagObservation], ok: list[RagObservation]
) -> dict[str, Any]:
    """One configuration's scores (over its answered questions), latency percentiles and token
    counts."""
    summary: dict[str, Any] = {
        "status": "ok",
        "num_questions": len(run.examples),
        "num_errors": len(answered) - len(ok),
        "errors": sorted({o.error for o in answered.values() if o.error})[:5],
        "accuracy": _mean([o.accuracy for o in ok if o.accuracy is not None]),
        "exact_match": _mean([o.exact_match for o in ok if o.exact_match is not None]),
        "f1": _mean([o.f1 for o in ok if o.f1 is not None]),
    }
    for metric in ("ttft_ms", "e2e_ms", "cold_ttft_ms"):
        values = [getattr(o, metric) for o in ok if getattr(o, metric) is not None]
        summary[f"{metric}_p50"] = percentile(values, 0.5) if values else None
        summary[f"{metric}_p95"] = percentile(values, 0.95) if values else None
    summary["prompt_tokens_p50"] = percentile([o.prompt_tokens for o in ok], 0.5) if ok else None
    recomputed = [o.recomputed_tokens for o in ok if o.recomputed_tokens is not None]
    summary["recomputed_tokens_p50"] = percentile(recomputed, 0.5) if recomputed else None
    summary["cached_tokens_mean"] = _mean([o.cached_tokens for o in ok])
    summary["completion_tokens_mean"] = _mean([o.completion_tokens for o in ok])
    compression = [o.compression_ms for o in ok if o.compression_ms is not None]
    summary["compression_ms_p50"] = percentile(compression, 0.5) if compression else None
    summary["num_uncompressed"] = sum(1 for o in ok if o.compressed is False)
    return summary


def _minus_full(
    answered: dict[int, RagObservation],
    full: dict[int, RagObservation] | None,
    num_resamples: int,
    seed: int,
) -> dict[str, Any] | None:
    """Accuracy minus `full`'s on the questions both scored (paired bootstrap); None without
    `full` or a question both scored."""
    if full is None:
        return None
    both = [(full[i].accuracy, o.accuracy) for i, o in answered.items() if i in full]
    pairs = [(a, b) for a, b in both if a is not None and b is not None]  # both scored
    if not pairs:
        return None
    estimate = paired_bootstrap_difference(
        [a for a, _ in pairs],
        [b for _, b in pairs],
        num_resamples=num_resamples,
        seed=seed,
    )
    return {**estimate.as_dict(), "num_pairs": len(pairs)}


def _fidelity(
    answered: dict[int, RagObservation],
    full: dict[int, RagObservation] | None,
    forced: Mapping[int, QuestionFidelity] | None,
) -> dict[str, Any] | None:
    """Against `full` on the questions both answered: the share of identical answers (texts
    equal), and the teacher-forced figures where measured; None without `full`."""
    if full is None:
        return None
    pairs = [(full[i].text, o.text) for i, o in answered.items() if i in full and o.ok and full[i].ok]
    if not pairs:
        return None
    identical = sum(a == b for a, b in pairs)
    low, high = binomial_ci(identical, len(pairs))
    figures: dict[str, Any] = {
        "num_pairs": len(pairs),
        "identical": identical / len(pairs),
        "identical_ci": [low, high],
        "top1_agreement": None,
        "kl_mean": None,
    }
    if forced:
        teacher = summarize_fidelity(list(forced.values()))
        figures.update(
            top1_agreement=teacher["top1_agreement"],
            kl_mean=teacher["kl_mean"],
            num_positions=teacher["num_positions"],
            # the engine-level rerun's own identical share (token ids): the gateway's, unless
            # the rerun's batch differed
            identical_tokens=teacher["identical"],
        )
    return figures


def _by_gold_index(run: RagRun, ok: list[RagObservation], positions: list[int]) -> dict[str, Any]:
    """Accuracy of the answered questions by their gold passage's position."""
    by_position = {}
    for position in positions:
        scored = [
            o.accuracy
            for o in ok
            if o.accuracy is not None and run.examples[o.example].gold_index == position
        ]
        by_position[str(position)] = {"accuracy": _mean(scored), "n": len(scored)}
    return by_position


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(estimate: Mapping[str, float] | None) -> str:
    if estimate is None:
        return "-"
    return f"{estimate['value']:+.3f} [{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}]"


SUMMARY_HEADER = (
    "config", "n", "accuracy", "EM", "F1", "acc - full [95% CI]", "= full", "top-1", "KL",
    "TTFT p50", "TTFT p95", "cold TTFT p50", "e2e p50", "e2e p95", "prompt tok p50",
)  # fmt: skip


def summary_rows(report: Mapping[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for name, s in report["configs"].items():
        if s["status"] != "ok":
            rows.append((name, "failed", *("-",) * (len(SUMMARY_HEADER) - 2)))
            continue
        rows.append(
            (
                name,
                str(s["num_questions"] - s["num_errors"]),
                _fmt(s["accuracy"]),
                _fmt(s["exact_match"]),
                _fmt(s["f1"]),
                _ci(s["accuracy_minus_full"]),
                *_fidelity_cells(s.get("fidelity")),
                f"{_fmt(s['ttft_ms_p50'], 0)} ms",
                f"{_fmt(s['ttft_ms_p95'], 0)} ms",
                f"{_fmt(s['cold_ttft_ms_p50'], 0)} ms" if s["cold_ttft_ms_p50"] is not None else "-",
                f"{_fmt(s['e2e_ms_p50'], 0)} ms",
                f"{_fmt(s['e2e_ms_p95'], 0)} ms",
                _fmt(s["prompt_tokens_p50"], 0),
            )
        )
    return rows


def _fidelity_cells(fidelity: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """Identical share, teacher-forced top-1 agreement and KL (`-` where not measured)."""
    if fidelity is None:
        return ("-", "-", "-")
    return (_fmt(fidelity["identical"]), _fmt(fidelity["top1_agreement"]), _fmt(fidelity["kl_mean"]))


def position_rows(report: Mapping[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for name, s in report["configs"].items():
        if s["status"] == "ok":
            cells = [s["accuracy_by_gold_index"][str(p)] for p in report["gold_positions"]]
            rows.append((name, *(f"{_fmt(c['accuracy'])} ({c['n']})" for c in cells)))
    return rows


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_text(report: Mapping[str, Any]) -> str:
    parts = [text_table(SUMMARY_HEADER, summary_rows(report))]
    if report["gold_positions"]:
        header = ("accuracy by gold position", *(str(p) for p in report["gold_positions"]))
        parts.append(text_table(header, position_rows(report)))
    for name, error in report["failed"].items():
        parts.append(f"failed: {name}: {error}")
    skipped = report.get("skipped_lines") or []
    if skipped:
        parts.append(
            f"skipped {len(skipped)} invalid line(s): "
            + "; ".join(f"{s['line']} ({s['reason']})" for s in skipped)
        )
    return "\n\n".join(parts)
