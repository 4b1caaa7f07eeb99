"""`ragspeed train-rag`: a LoRA adapter that fits a model to documents prefilled on their own.

The document cache (ragspeed.engine.native.core.document_kv) computes each document, and each piece of glue
between documents, after the prefix alone, and places it; only the fresh tokens after the last
document see everything. A stock model never saw documents that cannot see each other, and
answers worse that way. Block-Attention's recipe fits it: the *student* sees the prompt as the
document cache assembles it (`assembled_cache`: each placed span computed after the prefix
alone, at the positions right after it, then its keys rotated to its place), and the fresh
tokens over that; it learns to give, at the fresh tokens and along the teacher's greedy
answer, the distributions the unchanged model (the *teacher*: the same weights with the
adapter off) gives with full attention, by KL(teacher || student). No gold answer is a target.

The prompts are the gateway's own (gateway.prompt.assemble_prompt with document spans): a
random subset of a question's documents, in a random order, under one of a few system prompts.
The adapter (LoRA on every projection of every layer) is written in ragspeed.engine.native.loading.adapter's
format, beside a model card with its held-out figures (`held_out_figures`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ragspeed.ab.quality import accuracy
from ragspeed.document import Document
from ragspeed.engine.native.core.document_kv import placed_spans
from ragspeed.engine.native.loading.adapter import LORA_A, LORA_B
from ragspeed.evals.rag import DEFAULT_SYSTEM_PROMPT, RagExample, load_examples
from ragspeed.gateway.prompt import Segments, assemble_prompt
from ragspeed.training.trainer import TrainingConfig, adamw, scheduled_learning_rate

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SYSTEM_PROMPTS = (
    DEFAULT_SYSTEM_PROMPT,
    "You are a helpful assistant. Answer the question using the documents below.",
    "Answer briefly, from the search results only.",
)
# The QA files, and the lines of each that training may read: the first 200 NQ questions are
# `eval rag --limit 200`'s, and are never trained on.
NQ_FILE, SHIPPED_NQ_FILE, HOTPOT_FILE = "nq_dev.jsonl", "nq_dev100.jsonl", "hotpot_dev100.jsonl"
NQ_TRAIN_LINES = range(201, 281)
NQ_HELD_OUT_LINES = range(281, 301)


@dataclass(frozen=True)
class QuestionLines:
    """Lines of one QA file (1-based; None: every line)."""

    file_name: str
    lines: range | None = None

    def describe(self) -> str:
        if self.lines is None:
            return f"the questions of `{self.file_name}`"
        return f"lines {self.lines.start}-{self.lines.stop - 1} of `{self.file_name}`"


@dataclass(frozen=True)
class RagData:
    """The questions training reads and the ones its figures are held out on."""

    train: tuple[QuestionLines, ...]
    held_out: QuestionLines

    def file_names(self) -> list[str]:
        return sorted({q.file_name for q in (*self.train, self.held_out)})


# The project's dev data: 80 NQ questions past eval rag's 200 and the 100 HotpotQA ones; 20 NQ
# held out. The shipped adapter's recipe.
DEV_DATA = RagData(
    train=(QuestionLines(NQ_FILE, NQ_TRAIN_LINES), QuestionLines(HOTPOT_FILE)),
    held_out=QuestionLines(NQ_FILE, NQ_HELD_OUT_LINES),
)
# What ships in ragspeed/data (NQ's first 100 questions only, all eval rag's): the 100 HotpotQA
# questions train, the last 20 shipped NQ questions are held out.
SHIPPED_DATA = RagData(
    train=(QuestionLines(HOTPOT_FILE),),
    held_out=QuestionLines(SHIPPED_NQ_FILE, range(81, 101)),
)


def rag_data(data_dir: Path) -> RagData:
    """DEV_DATA where `data_dir` holds the 300-question nq_dev.jsonl, else SHIPPED_DATA; raise
    FileNotFoundError naming the files the choice needs and `data_dir` lacks."""
    data = DEV_DATA if (data_dir / NQ_FILE).is_file() else SHIPPED_DATA
    missing = [name for name in data.file_names() if not (data_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{data_dir} has no {' and no '.join(missing)} (train-rag reads {NQ_FILE} and"
            f" {HOTPOT_FILE}, or the shipped {SHIPPED_NQ_FILE} and {HOTPOT_FILE})"
        )
    return data


@dataclass(frozen=True)
class Recipe:
    rank: int = 8
    alpha: float = 16.0
    learning_rate: float = 3e-4
    min_learning_rate: float = 3e-5
    warmup_steps: int = 20
    accumulate: int = 2  # examples per optimizer step
    min_documents: int = 2
    max_documents: int = 8
    gold_share: float = 0.8  # of examples that hold the question's gold document
    max_answer_tokens: int = 12
    seed: int = 0


@dataclass(frozen=True)
class BlockExample:
    """A prompt, its prefix length and its placed spans (documents and glue, in order)."""

    token_ids: tuple[int, ...]
    prefix_len: int
    placed: tuple[tuple[int, int], ...]
    answers: tuple[str, ...] = ()

    @property
    def fresh_start(self) -> int:
        return self.placed[-1][1]


def block_mask(num_tokens: int, prefix_len: int, placed: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[T, T] bool, True where query t attends key s: causal, but a placed span's tokens see
    only the prefix and their own span (each prefilled on its own, in `assembled_cache`)."""
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()
    for start, end in placed:
        mask[start:end, prefix_len:start] = False
    return mask


def make_example(
    tokenizer: Any, record: RagExample, rng: random.Random, recipe: Recipe
) -> BlockExample | None:
    """A random subset of the record's documents in a random order (holding the gold one with
    probability `gold_share`), rendered as the gateway renders it; None without spans."""
    count = rng.randint(recipe.min_documents, min(recipe.max_documents, len(record.documents)))
    indices = rng.sample(range(len(record.documents)), count)
    gold = record.gold_index
    if gold is not None and gold not in indices and rng.random() < recipe.gold_share:
        indices[rng.randrange(count)] = gold
    documents = tuple(
        Document(id=str(i), text=record.documents[i].text, title=record.documents[i].title) for i in indices
    )
    segments = Segments(rng.choice(SYSTEM_PROMPTS), documents, (), record.question)
    prompt = assemble_prompt(tokenizer, segments, documents, document_spans=True)
    if not prompt.document_spans:
        return None
    placed, _ = placed_spans(prompt.document_spans, "reuse")
    return BlockExample(prompt.token_ids, prompt.document_spans[0][0], placed, record.answers)


# ------------------------------------------------------------------------------- the adapter


class LoRALinear(nn.Module):
    """`base(x) + scale * (x A^T) B^T`, with B starting at zero; off, the base alone."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        bound = 1.0 / math.sqrt(base.in_features)
        self.lora_a = nn.Parameter((torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.enabled:
            return out
        dtype = out.dtype
        return out + (x.to(dtype) @ self.lora_a.t().to(dtype)) @ self.lora_b.t().to(dtype) * self.scale


def add_adapters(model: nn.Module, rank: int, alpha: float, seed: int) -> dict[str, LoRALinear]:
    """LoRA on every PROJECTIONS linear of `model`, by the base weight's checkpoint name."""
    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for projection in PROJECTIONS:
            child = getattr(module, projection, None)
            if isinstance(child, nn.Linear):
                adapter = LoRALinear(child, rank, alpha, generator)
                setattr(module, projection, adapter)
                adapters[f"{name}.{projection}.weight"] = adapter
    if not adapters:
        raise ValueError(f"the model has none of the projections {', '.join(PROJECTIONS)}")
    return adapters


@contextmanager
def adapters_off(adapters: dict[str, LoRALinear]) -> Iterator[None]:
    for adapter in adapters.values():
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters.values():
            adapter.enabled = True


def save_adapter(adapters: dict[str, LoRALinear], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, adapter in adapters.items():
        tensors[name + LORA_A] = adapter.lora_a.detach().to(torch.float16).contiguous()
        tensors[name + LORA_B] = adapter.lora_b.detach().to(torch.float16).contiguous()
    scale = next(iter(adapters.values())).scale
    save_file(tensors, str(path), metadata={**metadata, "scale": repr(scale)})


# ----------------------------------------------------------------------------- the forwards


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def assembled_cache(model: Any, example: BlockExample) -> Any:
    """The KV the document cache assembles for the prompt before its fresh tokens: the prefix
    causal, each placed span computed after the prefix alone (its positions from prefix_len on,
    the mask keeping the spans apart), then its keys rotated by the delta to their place
    (RoPE: R(a + b) = R(b) R(a)). Differentiable, for the student."""
    num_tokens, prefix = example.fresh_start, example.prefix_len
    local, delta = list(range(num_tokens)), [0] * num_tokens
    for start, end in example.placed:
        local[start:end] = range(prefix, prefix + end - start)
        delta[start:end] = [start - prefix] * (end - start)
    out = model.model(
        input_ids=torch.tensor([list(example.token_ids[:num_tokens])]),
        attention_mask=block_mask(num_tokens, prefix, example.placed)[None, None],
        position_ids=torch.tensor([local]),
        use_cache=True,
    )
    cache = out.past_key_values
    for layer in cache.layers:
        cos, sin = model.model.rotary_emb(layer.keys, torch.tensor([delta]))  # [1, T, D]
        layer.keys = layer.keys * cos[:, None] + _rotate_half(layer.keys) * sin[:, None]
    return cache


def _fresh_forward(model: Any, example: BlockExample, fed: Sequence[int], *, blocked: bool) -> Any:
    """The fresh tokens (and `fed`) over the assembled cache, or the whole prompt with full
    attention; the hidden states are those of the fresh tokens on."""
    if not blocked:
        ids = list(example.token_ids) + list(fed)
        out = model.model(input_ids=torch.tensor([ids]), use_cache=True)
        return out.last_hidden_state[0, example.fresh_start :], out.past_key_values
    cache = assembled_cache(model, example)
    ids = list(example.token_ids[example.fresh_start :]) + list(fed)
    positions = torch.arange(example.fresh_start, example.fresh_start + len(ids))[None]
    out = model.model(
        input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache, use_cache=True
    )
    return out.last_hidden_state[0], out.past_key_values


@torch.no_grad()
def greedy(
    model: Any, example: BlockExample, *, blocked: bool, max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[int], torch.Tensor]:
    """Greedy decoding after the prompt, assembled as the document cache does or with full
    attention: the answer (ending at a stop token, if one came), the tokens fed back, and the
    logits from the first fresh token on ([len(fresh tokens) + len(fed), vocab], fp32)."""
    hidden, cache = _fresh_forward(model, example, (), blocked=blocked)
    logits = [model.lm_head(hidden).float()]
    answer: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1][-1].argmax())
        answer.append(token)
        if token in stop_ids:
            break
        out = model.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(model.lm_head(out.last_hidden_state[0]).float())
    fed = answer if not answer or answer[-1] not in stop_ids else answer[:-1]
    return answer, fed, torch.cat(logits)


def student_loss(
    model: Any, example: BlockExample, fed: list[int], teacher_logits: torch.Tensor
) -> torch.Tensor:
    """KL(teacher || student) at the fresh tokens and the fed answer, the student assembled."""
    hidden, _ = _fresh_forward(model, example, fed, blocked=True)
    logits = model.lm_head(hidden).float()
    target = F.log_softmax(teacher_logits, dim=-1)
    return F.kl_div(F.log_softmax(logits, dim=-1), target, log_target=True, reduction="batchmean")


# ------------------------------------------------------------------------------- training


def read_records(data_dir: Path, lines: range | None, file_name: str) -> list[RagExample]:
    examples, _ = load_examples(data_dir / file_name)
    return [e for e in examples if lines is None or e.line in lines]


def held_out_answers(
    model: Any,
    adapters: dict[str, LoRALinear],
    examples: Sequence[BlockExample],
    *,
    max_new_tokens: int,
    stop_ids: set[int],
) -> dict[str, list[list[int]]]:
    """Greedy answers to held-out prompts, stock and adapted, with full attention and blocked."""
    answers = {}
    for label, adapted, blocked in (
        ("stock_full", False, False),
        ("stock_blocked", False, True),
        ("adapted_blocked", True, True),
        ("adapted_full", True, False),
    ):
        with nullcontext() if adapted else adapters_off(adapters):
            answers[label] = [
                greedy(model, e, blocked=blocked, max_new_tokens=max_new_tokens, stop_ids=stop_ids)[0]
                for e in examples
            ]
    return answers


def train_rag_adapter(
    out: Path,
    data_dir: Path,
    *,
    base: str,
    minutes: float,
    max_steps: int | None,
    threads: int,
    recipe: Recipe,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the adapter of `base` (a zoo name or folder) into `out`: adapter.safetensors,
    README.md (the card) and figures.json. Returns the figures. The questions are `rag_data`'s
    choice of what `data_dir` holds."""
    from ragspeed.engine.native.compute.cpu_features import read_cpu_features

    data = rag_data(data_dir)
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(threads)
    student = _load_student(base, recipe)
    train = [r for q in data.train for r in read_records(data_dir, q.lines, q.file_name)]
    held_rng = random.Random(recipe.seed + 1)
    held_out = [
        e
        for r in read_records(data_dir, data.held_out.lines, data.held_out.file_name)
        if (e := make_example(student.tokenizer, r, held_rng, recipe)) is not None
    ]
    log(f"{len(train)} training questions, {len(held_out)} held out; {student.dtype}, {threads} threads")
    run = _train_steps(student, train, recipe, minutes=minutes, max_steps=max_steps, log=log)
    scored = held_out_figures(
        student.model, student.adapters, student.tokenizer, held_out, recipe, student.stop_ids
    )
    figures = {
        "base": base,
        "recipe": asdict(recipe),
        "dtype": str(student.dtype).removeprefix("torch."),
        "threads": threads,
        **asdict(run),
        "held_out": scored,
        "data": {"train": [q.describe() for q in data.train], "held_out": data.held_out.describe()},
        "cpu": read_cpu_features().describe(),
    }
    out.mkdir(parents=True, exist_ok=True)
    save_adapter(
        student.adapters, out / "adapter.safetensors", {"base": base, "recipe": json.dumps(asdict(recipe))}
    )
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    (out / "README.md").write_text(model_card(figures))
    return figures


@dataclass(frozen=True)
class _Student:
    """The base model with its LoRA adapters (the only trainable parameters)."""

    model: Any
    tokenizer: Any
    adapters: dict[str, LoRALinear]
    dtype: torch.dtype
    stop_ids: set[int]


def _load_student(base: str, recipe: Recipe) -> _Student:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragspeed.engine.native.compute.cpu_features import read_cpu_features
    from ragspeed.engine.native.loading.model_zoo import resolve_model

    base_dir = resolve_model(base)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    # bf16 runs at speed only where the CPU multiplies it (AVX512-BF16, AMX); elsewhere fp32.
    dtype = torch.bfloat16 if read_cpu_features().has_bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    model.requires_grad_(False)
    adapters = add_adapters(model, recipe.rank, recipe.alpha, recipe.seed)
    stop_ids = {
        i
        for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        if isinstance(i, int)
    }
    return _Student(model, tokenizer, adapters, dtype, stop_ids)


@dataclass(frozen=True)
class _TrainingRun:
    """What the loop did (the figures' keys, in their order)."""

    steps: int
    examples: int
    tokens: int
    wall_seconds: float
    losses: list[tuple[int, float]]


def _train_steps(
    student: _Student,
    train: list[RagExample],
    recipe: Recipe,
    *,
    minutes: float,
    max_steps: int | None,
    log: Callable[[str], None],
) -> _TrainingRun:
    """Optimizer steps of `recipe.accumulate` examples each until the time budget (or
    `max_steps`) is spent; the mean KL every 10 steps."""
    params = [p for a in student.adapters.values() for p in (a.lora_a, a.lora_b)]
    config = TrainingConfig(
        max_minutes=minutes,
        max_steps=max_steps,
        learning_rate=recipe.learning_rate,
        min_learning_rate=recipe.min_learning_rate,
        warmup_steps=recipe.warmup_steps,
        weight_decay=0.0,
    )
    optimizer = adamw(params, config)
    rng = random.Random(recipe.seed)
    budget_s = minutes * 60.0
    start = time.perf_counter()
    steps, examples_seen, tokens, loss_sum, loss_count = 0, 0, 0, 0.0, 0
    losses: list[tuple[int, float]] = []

    def progress() -> float:
        by_time = (time.perf_counter() - start) / budget_s
        return max(by_time, steps / max_steps if max_steps else 0.0)

    while progress() < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = scheduled_learning_rate(config, steps, progress())
        optimizer.zero_grad(set_to_none=True)
        for _ in range(recipe.accumulate):
            example = make_example(student.tokenizer, rng.choice(train), rng, recipe)
            if example is None:
                continue
            loss, num_tokens = _example_loss(student, example, recipe)
            (loss / recipe.accumulate).backward()
            loss_sum += loss.item()
            loss_count += 1
            examples_seen += 1
            tokens += num_tokens
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        steps += 1
        if steps % 10 == 0:
            losses.append((steps, loss_sum / max(loss_count, 1)))
            elapsed = time.perf_counter() - start
            log(f"step {steps} kl {losses[-1][1]:.4f} {tokens / elapsed:.0f} tok/s {elapsed:.0f}s")
            loss_sum, loss_count = 0.0, 0
    return _TrainingRun(steps, examples_seen, tokens, round(time.perf_counter() - start, 1), losses)


def _example_loss(student: _Student, example: BlockExample, recipe: Recipe) -> tuple[torch.Tensor, int]:
    """The student's KL on one example, the teacher (adapters off) answering greedily with full
    attention; and the tokens it saw."""
    with adapters_off(student.adapters):
        _, fed, teacher_logits = greedy(
            student.model,
            example,
            blocked=False,
            max_new_tokens=recipe.max_answer_tokens,
            stop_ids=student.stop_ids,
        )
    dtype = student.dtype
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = student_loss(student.model, example, fed, teacher_logits)
    return loss, len(example.token_ids) + len(fed)


def held_out_figures(
    model: Any,
    adapters: dict[str, LoRALinear],
    tokenizer: Any,
    held_out: Sequence[BlockExample],
    recipe: Recipe,
    stop_ids: set[int],
) -> dict[str, Any]:
    """Accuracy of each mode on the held-out prompts, and its answers' agreement with the
    stock model's full-attention ones."""
    runs = held_out_answers(
        model, adapters, held_out, max_new_tokens=recipe.max_answer_tokens, stop_ids=stop_ids
    )
    texts = {
        label: [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
        for label, answers in runs.items()
    }
    reference = texts["stock_full"]
    return {
        "questions": len(held_out),
        **{
            label: {
                "accuracy": round(
                    sum(accuracy(t, e.answers) for t, e in zip(ts, held_out)) / len(held_out), 3
                ),
                "same_as_stock_full": round(sum(a == b for a, b in zip(ts, reference)) / len(held_out), 3),
            }
            for label, ts in texts.items()
        },
    }


def model_card(figures: dict[str, Any]) -> str:
    recipe, held, data = figures["recipe"], figures["held_out"], figures["data"]
    rows = "\n".join(
        f"| {label} | {held[label]['accuracy']:.3f} | {held[label]['same_as_stock_full']:.3f} |"
        for label in ("stock_full", "stock_blocked", "adapted_blocked", "adapted_full")
    )
    return f"""# {figures["base"]}-rag: a LoRA adapter for documents prefilled on their own

Merged into `{figures["base"]}` by the zoo (`--model {figures["base"]}-rag`). It fits the model to
ragspeed's document cache: each document (and the glue between documents) computed after the
prefix alone, the question over all of them. Trained by `ragspeed train-rag`
(ragspeed.training.block_attention): KL to the stock model's full-attention distributions at the
fresh tokens and along its greedy answer, the student seeing the prompt as the document cache
assembles it. No gold answer is a target.

- LoRA rank {recipe["rank"]}, alpha {recipe["alpha"]:g}, on q, k, v, o, gate, up and down of every layer.
- {figures["steps"]} steps of {recipe["accumulate"]} examples ({figures["examples"]} prompts, {figures["tokens"]:,} tokens),
  {figures["wall_seconds"] / 60:.0f} minutes on {figures["threads"]} threads in {figures["dtype"]}; CPU: {figures["cpu"]}.
- Prompts: {recipe["min_documents"]}-{recipe["max_documents"]} documents of a question in a random order, the gold one in
  {recipe["gold_share"]:.0%} of them, under three short system prompts.
- Data: {" and ".join(data["train"])} (CC BY-SA). The first 200 NQ lines,
  `eval rag --limit 200`'s, are never trained on.

## Held out: {held["questions"]} NQ questions ({data["held_out"]}), greedy, in training's precision

| mode | accuracy | answer equal to stock, full attention |
|---|---|---|
{rows}

*blocked* is the document cache's `reuse` policy with glue reused; *full* a plain prefill. The
served figures are `eval rag`'s, in docs/benchmarks.md.
"""
