"""`ragspeed train-draft`: distil a 1-2 layer draft model from a target (the default model, the
demo model, or any Llama).

The draft shares the target's tokenizer, hidden size, heads and input vocabulary; it starts from
the target's embedding, final norm and a few of its layers (its first ones by default),
so training starts from a model that already maps hidden states to tokens.

*Sub-vocabulary head* (FR-Spec, arXiv 2502.14856; `DistillRecipe.draft_vocab_size`, default
4,096 tokens): the draft's LM head scores only the most frequent tokens of the target's own
continuations and the training text (`frequency_sub_vocab`), row i scoring target token d2t[i].
A draft step reads the whole head, and the target's is most of a small draft's weights
(SmolLM2-135M: 576 x 49,152 = 28M, against 7M in two layers); 4,096 rows are a twelfth of it,
covering most of what the target writes (the card reports the held-out coverage). The head
starts as the target's (tied) embedding rows of those tokens; the input embedding stays whole,
so the draft reads every target id. Distillation matches the target's distribution restricted to
the sub-vocabulary and renormalised (its argmax there is what the draft should propose). The
folder stores `draft_vocab_size` in config.json and `d2t` (int64) beside the weights; the native
engine maps drafts back to target ids (engine.native.core.spec_decode.draft). transformers cannot load such a
folder (its head is not vocabulary-sized): it is the native engine's draft only.

Data (`--data-dir`, the demo's seeded train / held-out split, ragspeed.training.corpus):
- *text*: language-modelling rows of passages and WikiText articles (ragspeed.training.demo);
- *chat*: the demo's chat examples (extractive, repeat, generic; ragspeed.training.examples);
- *continuations*: prompts continued by the target itself, greedy or sampled at temperature 1,
  through the native engine: the sequences the draft must predict when it serves. Prompts: the
  start of a passage as plain text, a chat prompt of the demo's examples over passages, and RAG
  prompts (`nq_dev.jsonl` of the data folder when it is there: a question's first documents,
  then bench spec's instruction to quote the passage that answers, or to answer), `rag_share` of
  every stretch of the generation order (`interleave`), so a time cut keeps the mix while they
  last. The first `num_heldout_rag` questions (bench spec's prompts) are never trained on.
Loss: knowledge distillation, KL(p_target || q_draft) of the next-token distributions at
temperature 1, at every real position of the packed rows. The target runs beside the draft
(no gradient), so its full distribution is matched, not just its argmax.

Figures: final KD loss; held-out *greedy agreement* (the share of positions of held-out target
continuations where the draft's argmax, mapped to a target id, equals the target's next token,
teacher-forced); *sub-vocabulary coverage* (the share of those tokens inside the draft's
vocabulary: agreement's ceiling); and the *engine acceptance*: accepted / drafted tokens of the
native engine speculating with the draft on held-out prompts (text, chat and RAG; greedy, k = 4,
adaptive).
"""

from __future__ import annotations

import json
import math
import platform
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from ragspeed.training.corpus import load_corpus
from ragspeed.training.demo import ChatEncoder, chunk_documents, encode_documents, make_chat_pieces
from ragspeed.training.examples import make_extractive_example, make_generic_example, make_repeat_example
from ragspeed.training.trainer import Phase, Piece, TrainingConfig, TrainingLog, train_loop

T = TypeVar("T")

# Files of the target's folder that are not the draft's own (weights, config, card, and the
# manifest of a target converted from GGUF, engine.native.loading.gguf).
_OWN_FILES = ("config.json", "README.md", "ragspeed_gguf.json")


@dataclass(frozen=True)
class DistillRecipe:
    num_hidden_layers: int = 2
    init_from_layers: tuple[int, ...] = (0, 1)  # target layers copied in (negative: from the end)
    seq_len: int = 512
    batch_size: int = 2
    prompt_tokens: int = 48  # text prompts: the first tokens of a passage (bos included)
    max_new_tokens: int = 96  # continuation length
    max_chat_passages: int = 2
    generation_fraction: float = 0.25  # of the time budget, for the target's continuations
    generation_batch: int = 16
    sampled_fraction: float = 0.25  # continuations sampled at temperature 1 (else greedy)
    # Tokens of each epoch by source, relative to the continuations' tokens.
    text_ratio: float = 1.0
    chat_ratio: float = 0.5
    num_eval_prompts: int = 16  # held-out prompts (text, chat, RAG as rag_share) for the figures
    # Rows of the draft's LM head: the most frequent target tokens; None: the whole vocabulary.
    draft_vocab_size: int | None = 4096
    # Share of RAG prompts among the continuations (where nq_dev.jsonl is), the rest text and
    # chat prompts half and half.
    rag_share: float = 0.4
    max_rag_documents: int = 2  # a RAG prompt's documents: 1 .. this, the first of the question's
    num_heldout_rag: int = 16  # nq_dev's first questions (bench spec's prompts): evaluation only
    training: TrainingConfig = TrainingConfig(
        learning_rate=2e-3, min_learning_rate=2e-4, warmup_steps=20, log_every=10, num_threads=1
    )


# ---------------------------------------------------------------------- prompts


def text_prompts(tokenizer, texts: Sequence[str], num_tokens: int) -> list[tuple[int, ...]]:
    """Plain-text continuation prompts: bos + the first tokens of each text (no eos)."""
    return [tuple(ids[:num_tokens]) for ids in encode_documents(tokenizer, texts) if len(ids) > num_tokens]


def chat_prompt(tokenizer, messages: Sequence[dict]) -> tuple[int, ...]:
    """A chat prompt with the generation header, tokenised as ChatEncoder does at training."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def chat_prompts(
    tokenizer,
    passages: Sequence[str],
    rng: random.Random,
    num_prompts: int,
    max_passages: int,
    max_tokens: int,
) -> list[tuple[int, ...]]:
    """Prompts of the demo's chat examples (extractive, repeat, generic), without their replies."""
    prompts: list[tuple[int, ...]] = []
    texts = list(passages)
    while len(prompts) < num_prompts:
        draw = rng.random()
        if draw < 0.3:
            messages = make_repeat_example(texts, rng, max_passages=max_passages).messages
        elif draw < 0.4:
            messages = make_generic_example(texts, rng)[:-1]  # drop the reply
        else:
            example = make_extractive_example(texts, rng, max_passages=max_passages)
            if example is None:
                continue
            messages = example.messages
        prompt = chat_prompt(tokenizer, messages)
        if len(prompt) <= max_tokens:
            prompts.append(prompt)
    return prompts


# RAG prompts: bench spec's (ragspeed.bench.spec: the answer quoted from the documents), and a
# free answer, as the gateway's users ask.
RAG_STYLES: tuple[tuple[str, str], ...] = (
    (
        "Answer the question by quoting the documents.",
        "Quote the passage that answers the question: {question}",
    ),
    ("Answer the question using the documents.", "Question: {question}"),
)
RAG_FILE = "nq_dev.jsonl"


def read_rag_examples(data_dir: Path) -> list[dict]:
    """The questions of `nq_dev.jsonl` (each with its documents) in file order; [] without it."""
    path = Path(data_dir) / RAG_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def rag_prompts(
    tokenizer,
    examples: Sequence[dict],
    rng: random.Random,
    *,
    max_documents: int,
    max_tokens: int,
) -> list[tuple[int, ...]]:
    """Chat prompts of bench spec's layout: the question's first 1 .. max_documents documents
    numbered, then a RAG_STYLES instruction; those over max_tokens are left out."""
    prompts = []
    for example in examples:
        system, instruction = RAG_STYLES[rng.randrange(len(RAG_STYLES))]
        docs = example["documents"][: rng.randint(1, max_documents)]
        body = "\n\n".join(f"[{i}] {d['title']}: {d['text']}" for i, d in enumerate(docs, 1))
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": body + "\n\n" + instruction.format(question=example["question"])},
        ]
        prompt = chat_prompt(tokenizer, messages)
        if len(prompt) <= max_tokens:
            prompts.append(prompt)
    return prompts


def interleave(groups: Sequence[Sequence[T]], shares: Sequence[float]) -> list[T]:
    """The groups' items merged so that every prefix holds them about in `shares` (a group
    that runs out leaves the rest to the others)."""
    taken = [0] * len(groups)
    merged: list[T] = []
    while True:
        open_groups = [g for g in range(len(groups)) if taken[g] < len(groups[g]) and shares[g] > 0]
        if not open_groups:
            return merged
        g = min(open_groups, key=lambda g: (taken[g] + 1) / shares[g])
        merged.append(groups[g][taken[g]])
        taken[g] += 1


def frequency_sub_vocab(
    continuations: Sequence[Sequence[int]],
    texts: Sequence[Sequence[int]],
    size: int,
    always: Sequence[int] = (),
) -> tuple[int, ...]:
    """The `size` target ids ranked first by frequency (FR-Spec): a token's share of the
    target's continuation tokens plus its share of the text tokens (each source weighs the
    same however long), `always` (special tokens: eos ends answers) included; ascending, so a
    tie of the draft's logits breaks toward the lower id, as the target's argmax does."""
    scores: defaultdict[int, float] = defaultdict(float)
    for stream in (continuations, texts):
        counts = Counter(t for ids in stream for t in ids)
        total = sum(counts.values())
        for token, count in counts.items():
            scores[token] += count / total
    chosen = list(dict.fromkeys(always))[:size]
    chosen_set = set(chosen)
    for token, _ in sorted(scores.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) == size:
            break
        if token not in chosen_set:
            chosen.append(token)
            chosen_set.add(token)
    return tuple(sorted(chosen))


def generate_continuations(
    engine,
    prompts: Sequence[tuple[int, ...]],
    *,
    max_new_tokens: int,
    sampled_fraction: float,
    batch_size: int,
    seed: int,
    deadline: float = math.inf,
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, target continuation) pairs through the native engine, batch by batch, until the
    prompts or the time (`deadline`, perf_counter seconds) run out."""
    from ragspeed.engine.protocol import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    pairs = []
    for first in range(0, len(prompts), batch_size):
        if time.perf_counter() >= deadline:
            break
        requests = []
        for i, prompt in enumerate(prompts[first : first + batch_size]):
            sampled = rng.random() < sampled_fraction
            params = SamplingParams(
                max_tokens=max_new_tokens,
                temperature=1.0 if sampled else 0.0,
                seed=rng.randrange(2**31) if sampled else None,
            )
            requests.append(GenerationRequest(f"distill-{first + i}", prompt, params))
        outputs = engine.generate(requests)
        pairs += [(r.prompt_token_ids, tuple(outputs[r.request_id]["token_ids"])) for r in requests]
    return pairs


# ---------------------------------------------------------------------- model


def build_draft(
    target: PreTrainedModel, recipe: DistillRecipe, d2t: Sequence[int] | None = None
) -> PreTrainedModel:
    """A `recipe.num_hidden_layers` copy of the target's architecture, initialised from the
    target's embedding, final norm and `init_from_layers` (the rest at random). With `d2t`,
    its LM head has a row per id of it, starting as the target's LM-head rows of those ids;
    else the head is tied to the embedding."""
    changes: dict[str, Any] = {
        "num_hidden_layers": recipe.num_hidden_layers,
        "tie_word_embeddings": d2t is None,
    }
    if d2t is not None:
        changes["draft_vocab_size"] = len(d2t)
    config = replace_config(target.config, **changes)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        num_target_layers = len(target.model.layers)
        for draft_layer, source in zip(draft.model.layers, recipe.init_from_layers):
            draft_layer.load_state_dict(target.model.layers[source % num_target_layers].state_dict())
        if d2t is not None:
            rows = target.get_output_embeddings().weight[torch.tensor(list(d2t))]  # [len(d2t), hidden]
            draft.lm_head = torch.nn.Linear(config.hidden_size, len(d2t), bias=False)
            draft.lm_head.weight.copy_(rows)
    if d2t is None:
        draft.tie_weights()
    return draft


def replace_config(config, **changes):
    return config.__class__.from_dict({**config.to_dict(), **changes})


def kd_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of KL(p_target || q_draft), temperature 1.
    logits [batch, seq_len, vocab]; mask [batch, seq_len] (1 at real tokens)."""
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)
    target_logp = F.log_softmax(target_logits.float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - draft_logp)).sum(dim=-1)  # [batch, seq_len]
    weights = mask.float()
    return (kl * weights).sum() / weights.sum().clamp(min=1.0)


def train_kd(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    make_pieces: Callable[[random.Random], list[Piece]],
    recipe: DistillRecipe,
    config: TrainingConfig,
    *,
    pad_id: int,
    budget_s: float,
    d2t: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
) -> TrainingLog:
    """The shared training loop (ragspeed.training.trainer.train_loop) on the KD loss, one phase
    of `recipe.seq_len`-token rows. With `d2t` (a sub-vocabulary head) the target's logits are
    those of its ids: softmax over them is the target's distribution restricted and renormalised."""
    torch.manual_seed(config.seed)
    draft.train()
    # The target's head rows of the sub-vocabulary, [len(d2t), hidden]: its logits of those ids
    # alone, a twelfth of the full head's product (SmolLM2-135M's head is a fifth of its forward).
    head_rows = None if d2t is None else target.get_output_embeddings().weight[torch.tensor(list(d2t))]

    def step_loss(token_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            if head_rows is None:
                target_logits = target(input_ids=token_ids).logits
            else:
                hidden = target.model(input_ids=token_ids).last_hidden_state  # [batch, seq_len, hidden]
                target_logits = F.linear(hidden, head_rows)  # [batch, seq_len, len(d2t)]
        return kd_loss(draft(input_ids=token_ids).logits, target_logits, mask), int(mask.sum())

    phase = Phase(
        seq_len=recipe.seq_len, batch_size=recipe.batch_size, time_fraction=1.0, make_pieces=make_pieces
    )
    training_log = train_loop(
        [p for p in draft.parameters() if p.requires_grad],
        step_loss,
        [phase],
        config,
        budget_s=budget_s,
        rng=random.Random(config.seed),
        pad_id=pad_id,
        log=log,
        loss_name="kd",
    )
    draft.eval()
    return training_log


# ---------------------------------------------------------------------- figures


@torch.no_grad()
def greedy_agreement(
    draft: PreTrainedModel,
    pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    d2t: Sequence[int] | None = None,
) -> float:
    """Share of continuation positions where the draft's argmax (teacher-forced on prompt +
    continuation; a head row mapped through `d2t`) equals the target's greedy next token."""
    to_ids = None if d2t is None else torch.tensor(list(d2t))
    hits = total = 0
    for prompt, continuation in pairs:
        if not continuation:
            continue
        ids = torch.tensor([list(prompt) + list(continuation)])
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [len(continuation), rows]
        best = logits.argmax(dim=-1)
        if to_ids is not None:
            best = to_ids[best]
        hits += int((best == torch.tensor(continuation)).sum())
        total += len(continuation)
    return hits / max(total, 1)


def sub_vocab_coverage(
    pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], d2t: Sequence[int] | None
) -> float:
    """Share of the continuations' tokens inside the draft's vocabulary (1.0 for a full head)."""
    tokens = [t for _, continuation in pairs for t in continuation]
    if d2t is None or not tokens:
        return 1.0
    inside = set(d2t)
    return sum(t in inside for t in tokens) / len(tokens)


def engine_acceptance(
    target_path: Path,
    draft_path: Path,
    prompts: Sequence[tuple[int, ...]],
    *,
    max_tokens: int,
    max_model_len: int,
) -> dict[str, float]:
    """Acceptance of the draft in the native engine (greedy, k = 4, adaptive), one request at a time."""
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.protocol import GenerationRequest, SamplingParams

    engine = build_llm_engine(
        EngineConfig(
            model=str(target_path),
            speculative="draft",
            draft_model=str(draft_path),
            max_model_len=max_model_len,
            num_kv_cache_tokens=8 * max_model_len,
        )
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.generate([GenerationRequest(f"accept-{i}", prompt, params)])
    stats = engine.stats()
    return {
        "acceptance_rate": stats["spec_acceptance_rate"],
        "mean_accepted_length": stats["spec_mean_accepted_length"],
    }


# ---------------------------------------------------------------------- the command


def save_draft(
    draft: PreTrainedModel, target_dir: Path, out_dir: Path, d2t: Sequence[int] | None = None
) -> None:
    """HF folder: bf16 safetensors (config says float32: load it so), with `d2t` (int64) beside
    the weights for a sub-vocabulary head, and the target's tokenizer and generation config
    copied unchanged."""
    draft.bfloat16().save_pretrained(str(out_dir), safe_serialization=True)
    draft.float()
    if d2t is not None:
        weights_path = out_dir / "model.safetensors"
        weights = load_file(str(weights_path))
        weights["d2t"] = torch.tensor(list(d2t), dtype=torch.long)
        save_file(weights, str(weights_path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in Path(target_dir).iterdir():
        if (
            path.is_file()
            and path.name not in _OWN_FILES
            and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin"))
        ):
            shutil.copy(path, out_dir / path.name)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors are written owner-only


@dataclass(frozen=True)
class _Continuations:
    """The target's continuations of the training prompts (prompt, continuation) and their
    count by kind of prompt (text, chat, rag)."""

    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]
    by_kind: Counter
    seconds: float


@dataclass(frozen=True)
class _HeldOut:
    """The draft's figures on held-out prompts: the prompts, the target's greedy continuations,
    the draft's greedy agreement and its sub-vocabulary's coverage of them."""

    prompts: list[tuple[int, ...]]
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]
    agreement: float
    coverage: float


def distill_draft(
    target_dir: Path,
    out_dir: Path,
    *,
    data_dir: Path,
    minutes: float = 55.0,
    max_steps: int | None = None,
    seed: int = 0,
    num_threads: int | None = None,
    recipe: DistillRecipe | None = None,
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Distil a draft of `target_dir` and write it, with its model card, to `out_dir` (replaced
    atomically). `minutes` is the budget of generation + training. Returns the card's figures."""
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    started = time.perf_counter()
    recipe = recipe or DistillRecipe()
    training = replace(recipe.training, max_minutes=minutes, max_steps=max_steps, seed=seed)
    training = replace(training, num_threads=num_threads or recipe.training.num_threads)
    torch.set_num_threads(training.num_threads)
    target_dir = Path(target_dir)
    tokenizer, target = _load_target(target_dir)
    vocab_size = target.config.vocab_size
    if recipe.draft_vocab_size is not None and not 0 < recipe.draft_vocab_size:
        raise ValueError(f"draft_vocab_size must be positive, got {recipe.draft_vocab_size}")
    corpus = load_corpus(Path(data_dir), seed=0)  # the demo's split: held-out text stays unseen
    rag_examples = read_rag_examples(Path(data_dir))
    budget_s = minutes * 60.0

    # 1. the target's own continuations of text, chat and RAG prompts
    generator = _generator(target_dir, tokenizer, recipe, seed)
    rng = random.Random(seed)
    continuations = _generate_training_continuations(
        generator, tokenizer, corpus, rag_examples, recipe, rng, seed, budget_s * recipe.generation_fraction
    )
    log(
        f"{len(continuations.pairs)} target continuations in {continuations.seconds:.0f}s"
        f" ({dict(continuations.by_kind)})"
    )

    # 2. the sub-vocabulary, then knowledge distillation on continuations, text and chat rows
    d2t, make_pieces = _training_rows(tokenizer, corpus, continuations, recipe, vocab_size, log)
    draft = build_draft(target, recipe, d2t)
    remaining_s = max(budget_s - (time.perf_counter() - started), 1.0)
    pad_id = tokenizer.pad_token_id
    training_log = train_kd(
        target, draft, make_pieces, recipe, training, pad_id=pad_id, budget_s=remaining_s, d2t=d2t, log=log
    )

    # 3. figures on held-out prompts, then the folder
    held_out = _held_out_figures(generator, tokenizer, corpus, rag_examples, recipe, draft, d2t, seed)
    figures = {
        "command": command or f"ragspeed train-draft --minutes {minutes:g} --seed {seed}",
        "target": str(target_dir),
        "name": Path(out_dir).name,
        "minutes": minutes,
        "seed": seed,
        "num_threads": training.num_threads,
        **_data_figures(d2t, vocab_size, continuations),
        "training_wall_seconds": round(training_log.wall_seconds, 1),
    }
    return _write_draft(
        Path(out_dir), target_dir, draft, d2t, recipe, figures, training_log, held_out, started, log
    )


def _generator(target_dir: Path, tokenizer: Any, recipe: DistillRecipe, seed: int) -> Any:
    """The native engine that writes the target's continuations."""
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.native.core.factory import build_llm_engine

    max_model_len = recipe.seq_len + recipe.max_new_tokens
    return build_llm_engine(
        EngineConfig(
            model=str(target_dir),
            max_model_len=max_model_len,
            num_kv_cache_tokens=recipe.generation_batch * max_model_len,
            seed=seed,
        ),
        tokenizer=tokenizer,
    )


def _data_figures(
    d2t: tuple[int, ...] | None, vocab_size: int, continuations: _Continuations
) -> dict[str, Any]:
    """The draft's vocabulary and the continuations it was distilled on."""
    return {
        "draft_vocab_size": len(d2t) if d2t is not None else vocab_size,
        "target_vocab_size": vocab_size,
        "generation_seconds": round(continuations.seconds, 1),
        "num_continuations": len(continuations.pairs),
        "continuations_by_kind": dict(continuations.by_kind),
        "continuation_tokens": sum(len(p) + len(c) for p, c in continuations.pairs),
    }


def _load_target(target_dir: Path) -> tuple[PreTrainedTokenizerFast, PreTrainedModel]:
    """The target's fast tokenizer (refused before the model loads when it has none) and its
    model, fp32, frozen."""
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        # The text pieces are encoded by the fast tokenizer's backend (demo.encode_documents).
        raise ValueError(f"{target_dir}: distillation needs a fast tokenizer (tokenizer.json), found none")
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return tokenizer, target


def _generate_training_continuations(
    generator: Any,
    tokenizer: Any,
    corpus: Any,
    rag_examples: list[dict],
    recipe: DistillRecipe,
    rng: random.Random,
    seed: int,
    budget_s: float,
) -> _Continuations:
    """Text, chat and RAG prompts interleaved by `recipe.rag_share`, continued by the target
    until `budget_s` is spent."""
    prompt_limit = recipe.seq_len - recipe.max_new_tokens
    train_texts = list(corpus.train_passages)
    rng.shuffle(train_texts)
    text = text_prompts(tokenizer, train_texts, recipe.prompt_tokens)
    chat = chat_prompts(
        tokenizer, corpus.train_passages, rng, len(text), recipe.max_chat_passages, prompt_limit
    )
    train_rag = list(rag_examples[recipe.num_heldout_rag :])
    rng.shuffle(train_rag)
    rag = rag_prompts(
        tokenizer, train_rag, rng, max_documents=recipe.max_rag_documents, max_tokens=prompt_limit
    )
    text_and_chat = [("text", p) for p in text] + [("chat", p) for p in chat]
    rng.shuffle(text_and_chat)
    rag_share = recipe.rag_share
    tagged = interleave([text_and_chat, [("rag", p) for p in rag]], (1.0 - rag_share, rag_share))
    generation_start = time.perf_counter()
    pairs = generate_continuations(
        generator,
        [p for _, p in tagged],
        max_new_tokens=recipe.max_new_tokens,
        sampled_fraction=recipe.sampled_fraction,
        batch_size=recipe.generation_batch,
        seed=seed,
        deadline=generation_start + budget_s,
    )
    generated = Counter(kind for kind, _ in tagged[: len(pairs)])  # prompts are taken in order
    return _Continuations(pairs, generated, time.perf_counter() - generation_start)


def _training_rows(
    tokenizer: Any,
    corpus: Any,
    continuations: _Continuations,
    recipe: DistillRecipe,
    vocab_size: int,
    log: Callable[[str], None],
) -> tuple[tuple[int, ...] | None, Callable[[random.Random], list[Piece]]]:
    """The draft's sub-vocabulary (None: the target's whole one), and the rows of one epoch:
    the continuations, then language-modelling rows of text and chat rows, in proportion."""
    pairs = continuations.pairs
    lm_texts = list(corpus.train_passages + corpus.train_articles)
    encoded_texts = encode_documents(tokenizer, lm_texts)
    d2t = None
    if recipe.draft_vocab_size is not None and recipe.draft_vocab_size < vocab_size:
        d2t = frequency_sub_vocab(
            [c for _, c in pairs], encoded_texts, recipe.draft_vocab_size, always=tokenizer.all_special_ids
        )
        log(f"sub-vocabulary: {len(d2t)} of {vocab_size} tokens")
    continuation_pieces = [Piece(p + c, (1,) * (len(p) + len(c))) for p, c in pairs]
    num_continuation_tokens = sum(len(p.token_ids) for p in continuation_pieces)
    text_pieces = chunk_documents(encoded_texts, recipe.seq_len)
    encoder = ChatEncoder(tokenizer)

    def make_pieces(epoch_rng: random.Random) -> list[Piece]:
        pieces = list(continuation_pieces)
        text = list(text_pieces)
        epoch_rng.shuffle(text)
        budget = max(num_continuation_tokens, 1) * recipe.text_ratio
        while text and budget > 0:
            budget -= len(text[-1].token_ids)
            pieces.append(text.pop())
        pieces += [
            # all positions are distilled, not just the reply
            Piece(piece.token_ids, (1,) * len(piece.token_ids))
            for piece in make_chat_pieces(
                corpus.train_passages,
                lm_texts,
                encoder,
                epoch_rng,
                num_tokens=int(max(num_continuation_tokens, 1) * recipe.chat_ratio),
                max_passages=recipe.max_chat_passages,
                generic_fraction=0.1,
                repeat_fraction=0.3,
            )
        ]
        epoch_rng.shuffle(pieces)
        return pieces

    return d2t, make_pieces


def _held_out_figures(
    generator: Any,
    tokenizer: Any,
    corpus: Any,
    rag_examples: list[dict],
    recipe: DistillRecipe,
    draft: PreTrainedModel,
    d2t: tuple[int, ...] | None,
    seed: int,
) -> _HeldOut:
    """Held-out text, RAG and chat prompts (`recipe.num_eval_prompts` in all), the target's
    greedy continuations, and how well the draft predicts them."""
    eval_rng = random.Random(seed + 1)
    prompt_limit = recipe.seq_len - recipe.max_new_tokens
    num_rag = round(recipe.num_eval_prompts * recipe.rag_share) if rag_examples else 0
    num_text = (recipe.num_eval_prompts - num_rag) // 2
    prompts = text_prompts(tokenizer, corpus.heldout_passages, recipe.prompt_tokens)[:num_text]
    prompts += rag_prompts(
        tokenizer,
        rag_examples[: recipe.num_heldout_rag],
        eval_rng,
        max_documents=recipe.max_rag_documents,
        max_tokens=prompt_limit,
    )[:num_rag]
    prompts += chat_prompts(
        tokenizer,
        corpus.heldout_passages,
        eval_rng,
        recipe.num_eval_prompts - len(prompts),
        recipe.max_chat_passages,
        prompt_limit,
    )
    pairs = generate_continuations(
        generator,
        prompts,
        max_new_tokens=recipe.max_new_tokens,
        sampled_fraction=0.0,
        batch_size=recipe.generation_batch,
        seed=seed,
    )
    return _HeldOut(prompts, pairs, greedy_agreement(draft, pairs, d2t), sub_vocab_coverage(pairs, d2t))


def _write_draft(
    out_dir: Path,
    target_dir: Path,
    draft: PreTrainedModel,
    d2t: tuple[int, ...] | None,
    recipe: DistillRecipe,
    figures: dict[str, Any],
    training_log: Any,
    held_out: _HeldOut,
    started: float,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Save the draft in a staging folder, measure the engine's acceptance of it, write its
    card, and put the folder in `out_dir`'s place. Returns `figures` completed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        save_draft(draft, target_dir, staging, d2t)
        acceptance = engine_acceptance(
            target_dir,
            staging,
            held_out.prompts,
            max_tokens=min(64, recipe.max_new_tokens),
            max_model_len=recipe.seq_len + recipe.max_new_tokens,
        )
        log(
            f"kd {training_log.final_loss:.3f}; held-out greedy agreement {held_out.agreement:.3f}"
            f" (sub-vocabulary coverage {held_out.coverage:.3f}); engine acceptance"
            f" {acceptance['acceptance_rate']:.3f}"
        )
        figures = {
            **figures,
            "total_wall_seconds": round(time.perf_counter() - started, 1),
            "steps": training_log.steps,
            "tokens_seen": training_log.tokens,
            "first_kd_loss": round(training_log.losses[0][1], 4) if training_log.losses else math.nan,
            "final_kd_loss": round(training_log.final_loss, 4),
            "heldout_greedy_agreement": round(held_out.agreement, 4),
            "heldout_sub_vocab_coverage": round(held_out.coverage, 4),
            "heldout_num_tokens": sum(len(c) for _, c in held_out.pairs),
            "num_eval_prompts": len(held_out.prompts),
            "engine_acceptance_rate": round(acceptance["acceptance_rate"], 4),
            "engine_mean_accepted_length": round(acceptance["mean_accepted_length"], 3),
            "num_parameters": sum(p.numel() for p in draft.parameters()),
            "size_bytes": sum(f.stat().st_size for f in staging.iterdir()),
            "losses": training_log.losses,
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        }
        (staging / "README.md").write_text(model_card(recipe, draft, figures))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return figures


def model_card(recipe: DistillRecipe, draft: PreTrainedModel, figures: dict) -> str:
    c = draft.config
    losses = ", ".join(
        f"{step}: {loss:.2f}" for step, loss in figures["losses"][:: max(1, len(figures["losses"]) // 12)]
    )
    name, target = figures["name"], Path(figures["target"]).name
    sub_vocab = figures["draft_vocab_size"] < figures["target_vocab_size"]
    head = (
        f"an LM head over a sub-vocabulary of {figures['draft_vocab_size']:,} of the target's"
        f" {figures['target_vocab_size']:,} tokens (the most frequent in its continuations and the training text;"
        " `d2t` in model.safetensors maps head rows to target ids, `draft_vocab_size` in config.json), initialised"
        " from the target's LM-head rows of those tokens; only ragspeed's native engine loads it"
        if sub_vocab
        else "tied embeddings"
    )
    by_kind = ", ".join(f"{kind} {count}" for kind, count in figures["continuations_by_kind"].items())
    return f"""# {name}

A {c.num_hidden_layers}-layer draft model distilled from `{target}` for speculative
decoding (`--speculative draft --draft-model {name}`). It shares the target's
tokenizer (copied unchanged) and is useful only as that model's proposer.

## How it was made

```
{figures["command"]}
```

- Model: LlamaForCausalLM, {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate {c.intermediate_size},
  {c.num_attention_heads} heads, {c.num_key_value_heads} KV heads; {head}; {figures["num_parameters"]:,} parameters.
  Initialised from the target's embedding, final norm and layers {list(recipe.init_from_layers)}.
  Weights stored in bf16 ({figures["size_bytes"] / 1e6:.1f} MB in all); `config.json` says float32.
- Data (`wiki_passages.txt`, `wikitext2_raw_test.txt` (the demo's train split) and `nq_dev.jsonl` past its first
  {recipe.num_heldout_rag} questions): {figures["num_continuations"]} continuations generated by the target ({by_kind};
  {figures["continuation_tokens"]:,} tokens with their prompts; {recipe.sampled_fraction:.0%} sampled at temperature 1, the rest
  greedy; prompts: the first {recipe.prompt_tokens} tokens of passages, chat prompts of the demo's examples
  over up to {recipe.max_chat_passages} passages, and RAG prompts over a question's first 1 to {recipe.max_rag_documents} documents), in
  {figures["generation_seconds"]:.0f} s; plus language-modelling rows of passages and WikiText articles
  ({recipe.text_ratio:g}x as many tokens) and the demo's chat examples ({recipe.chat_ratio:g}x).
- Loss: knowledge distillation, KL(target || draft) of next-token distributions at temperature 1
  (the target's restricted to the draft's vocabulary and renormalised), every real position of
  {recipe.seq_len}-token rows, {recipe.batch_size} rows per step.
- Training: AdamW (lr {recipe.training.learning_rate:g} to {recipe.training.min_learning_rate:g}, cosine over the time
  budget, warm-up {recipe.training.warmup_steps} steps), seed {figures["seed"]}, {figures["steps"]} steps, {figures["tokens_seen"]:,} tokens,
  {figures["training_wall_seconds"]:.0f} s of training ({figures["total_wall_seconds"]:.0f} s in all) on {figures["machine"]},
  {figures["num_threads"]} thread(s). The step count depends on the machine's speed (the budget is time).

## Results

Held out: {figures["num_eval_prompts"]} prompts (passages of the demo's held-out split; RAG prompts of nq_dev's first
{recipe.num_heldout_rag} questions, which `ragspeed bench spec` times), greedy continuations of the target.

| figure | value |
|---|---|
| KD loss, first logged (mean of {recipe.training.log_every} steps) | {figures["first_kd_loss"]:.3f} |
| final KD loss (mean of the last {recipe.training.log_every} steps) | {figures["final_kd_loss"]:.3f} |
| held-out greedy agreement (draft argmax = target's greedy next token, per token, {figures["heldout_num_tokens"]} tokens) | {figures["heldout_greedy_agreement"]:.3f} |
| held-out sub-vocabulary coverage (target tokens the draft can propose) | {figures["heldout_sub_vocab_coverage"]:.3f} |
| engine acceptance rate (native engine, greedy, k = 4) | {figures["engine_acceptance_rate"]:.3f} |
| engine mean accepted length (per verification) | {figures["engine_mean_accepted_length"]:.2f} |

KD loss by step: {losses}.

License of the data: CC BY-SA 3.0 (Wikipedia) / GFDL (WikiText-2); Natural Questions: CC BY-SA 3.0.
"""
