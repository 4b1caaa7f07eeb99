"""`ragspeed train-demo`: tokenizer, data mix, training and model card of the bundled demo model.

Two phases (nano-GPT style pre-training, then a long-context stretch, as real models do):
phase 1 packs rows of 512 tokens with extractive examples over 1-3 passages; phase 2 packs rows
of 3072 tokens with examples over up to 20 passages, so positions as long as a RAG prompt of
the NQ set (about 2.5-3k demo tokens) are trained. `chat_token_fraction` of each epoch's
tokens (60% by default) are chat examples (ragspeed.training.examples), the rest
language-modelling text.
"""

from __future__ import annotations

import json
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import (
    BatchEncoding,
    GenerationConfig,
    GenerationMixin,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from ragspeed.training.corpus import Corpus, load_corpus
from ragspeed.training.examples import (
    ExtractiveExample,
    Message,
    make_extractive_example,
    make_generic_example,
    make_passage_example,
    make_repeat_example,
)
from ragspeed.training.tokenizer import save_tokenizer, train_tokenizer
from ragspeed.training.trainer import (
    Phase,
    Piece,
    TrainingConfig,
    evaluate_loss,
    target_accuracy,
    train_causal_lm,
)


@dataclass(frozen=True)
class DemoRecipe:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # (seq_len, batch_size, time_fraction, max_passages per extractive example)
    phases: tuple[tuple[int, int, float, int], ...] = ((512, 2, 0.9, 3), (3072, 1, 0.1, 20))
    chat_token_fraction: float = 0.6  # of each epoch's tokens
    generic_example_fraction: float = 0.1  # of chat examples
    repeat_example_fraction: float = 0.3  # of chat examples: copy a whole passage
    # One thread: on a CPU shared with other jobs, two OpenMP threads spin waiting for each other,
    # which can make training several times slower than on one thread.
    training: TrainingConfig = TrainingConfig(
        learning_rate=3e-3, min_learning_rate=3e-4, warmup_steps=30, log_every=10, num_threads=1
    )

    def model_config(self, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


class ChatEncoder:
    """Renders chat examples through the chat template into pieces masked to the reply."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer = tokenizer

    def encode(self, prompt_messages: Sequence[Message], reply: str) -> Piece:
        prompt = self.tokenizer.apply_chat_template(
            list(prompt_messages), tokenize=False, add_generation_prompt=True
        )
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        # Encoded apart, as at inference: generation starts right after the assistant header.
        reply_ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Piece(tuple(prompt_ids + reply_ids), (0,) * len(prompt_ids) + (1,) * len(reply_ids))


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[list[int]]:
    """bos + text + eos per document (the tokenizer's post-processor adds bos)."""
    # The backend tokenizer directly: articles are longer than model_max_length, on purpose.
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts))
    return [encoding.ids + [tokenizer.eos_token_id] for encoding in encodings]


def chunk_documents(documents: Sequence[Sequence[int]], seq_len: int) -> list[Piece]:
    pieces = []
    for ids in documents:
        for first in range(0, len(ids), seq_len):
            chunk = tuple(ids[first : first + seq_len])
            if len(chunk) > 1:
                pieces.append(Piece(chunk, (1,) * len(chunk)))
    return pieces


def make_chat_piece(
    corpus_passages: Sequence[str],
    lm_texts: Sequence[str],
    encoder: ChatEncoder,
    rng: random.Random,
    *,
    max_passages: int,
    generic_fraction: float,
    repeat_fraction: float,
) -> Piece | None:
    """One chat example of a kind drawn by the fractions (the rest extractive); None when the
    drawn example found no unique key."""
    draw = rng.random()
    example: ExtractiveExample | None
    if draw < repeat_fraction:
        example = make_repeat_example(corpus_passages, rng, max_passages=min(max_passages, 3))
    elif draw < repeat_fraction + generic_fraction:
        *prompt, reply = make_generic_example(lm_texts, rng)
        return encoder.encode(prompt, reply["content"])
    else:
        example = make_extractive_example(corpus_passages, rng, max_passages=max_passages)
    return None if example is None else encoder.encode(example.messages, example.answer)


def make_chat_pieces(
    corpus_passages: Sequence[str],
    lm_texts: Sequence[str],
    encoder: ChatEncoder,
    rng: random.Random,
    *,
    num_tokens: int,
    **kinds,
) -> list[Piece]:
    """Chat examples (make_chat_piece, keyword arguments `kinds`) until `num_tokens` tokens."""
    pieces: list[Piece] = []
    total = 0
    while total < num_tokens:
        piece = make_chat_piece(corpus_passages, lm_texts, encoder, rng, **kinds)
        if piece is not None:
            pieces.append(piece)
            total += len(piece.token_ids)
    return pieces


def build_phases(recipe: DemoRecipe, corpus: Corpus, tokenizer: PreTrainedTokenizerFast) -> list[Phase]:
    encoder = ChatEncoder(tokenizer)
    lm_documents = encode_documents(tokenizer, corpus.train_passages + corpus.train_articles)
    lm_tokens = sum(len(ids) for ids in lm_documents)
    chat_tokens = int(lm_tokens * recipe.chat_token_fraction / (1.0 - recipe.chat_token_fraction))
    lm_texts = corpus.train_passages + corpus.train_articles

    def make_phase(seq_len: int, batch_size: int, fraction: float, max_passages: int) -> Phase:
        def make_pieces(rng: random.Random) -> list[Piece]:
            pieces = chunk_documents(lm_documents, seq_len)
            pieces += make_chat_pieces(
                corpus.train_passages,
                lm_texts,
                encoder,
                rng,
                num_tokens=chat_tokens,
                max_passages=max_passages,
                generic_fraction=recipe.generic_example_fraction,
                repeat_fraction=recipe.repeat_example_fraction,
            )
            rng.shuffle(pieces)
            return pieces

        return Phase(seq_len=seq_len, batch_size=batch_size, time_fraction=fraction, make_pieces=make_pieces)

    return [make_phase(*spec) for spec in recipe.phases]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message]) -> torch.Tensor:
    """[1, num_prompt_tokens]: `messages` through the chat template, the reply's turn opened."""
    encoded = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert isinstance(encoded, BatchEncoding)  # return_dict=True
    return encoded["input_ids"]


class Generator(Protocol):
    """What the evaluation needs of a model: Hugging Face's `generate`."""

    def generate(self, inputs: torch.Tensor, **kwargs: Any) -> Any: ...


def greedy_reply_ids(
    model: Generator, tokenizer: PreTrainedTokenizerFast, prompt_ids: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """[num_reply_tokens]: the greedy continuation of the one prompt in `prompt_ids`."""
    output = model.generate(
        prompt_ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return output[0, prompt_ids.shape[1] :]


@torch.no_grad()
def generate_reply(
    model: Generator,
    tokenizer: PreTrainedTokenizerFast,
    messages: Sequence[Message],
    max_new_tokens: int = 80,
) -> str:
    reply_ids = greedy_reply_ids(model, tokenizer, chat_prompt_ids(tokenizer, messages), max_new_tokens)
    text = tokenizer.decode(reply_ids, skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence
    return text


def copy_exact_match(
    model: Generator,
    tokenizer: PreTrainedTokenizerFast,
    passages: Sequence[str],
    *,
    num_examples: int,
    max_passages: int,
    seed: int,
) -> float:
    """Share of held-out extractive examples whose greedy reply is exactly the sentence."""
    rng = random.Random(seed)
    hits = total = 0
    while total < num_examples:
        example = make_extractive_example(passages, rng, max_passages=max_passages)
        if example is None:
            continue
        total += 1
        hits += generate_reply(model, tokenizer, example.messages).strip() == example.answer
    return hits / total


SAMPLE_MESSAGES: tuple[Message, ...] = (
    {"role": "system", "content": "Answer using the documents."},
    {
        "role": "user",
        "content": "Documents:\n[1] The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad "
        "Röntgen, of Germany. John Bardeen is the only laureate to win the prize twice.\n\n"
        "[2] Deadpool 2 is scheduled to be released in the United States on May 18, 2018.\n\n"
        'Quote the sentence that mentions "Bardeen".',
    },
)


def save_demo_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """HF format; weights stored in bf16 to stay small, config says float32 (load it so: bf16
    matmuls are very slow on CPUs without native bf16)."""
    model.bfloat16().save_pretrained(str(out_dir), safe_serialization=True)
    model.float()
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    ).save_pretrained(str(out_dir))
    save_tokenizer(tokenizer, out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors are written owner-only


@torch.no_grad()
def copied_share(
    model: Generator, tokenizer: PreTrainedTokenizerFast, examples: Sequence, max_new_tokens: int = 48
) -> float:
    """Copying in free generation: over greedy replies to `examples`, the share of reply tokens
    (after the first) that occur in the prompt right after the reply's token before them. A
    reply that loops on itself scores ~0; teacher-forced accuracy says nothing of either."""
    hits = count = 0
    for example in examples:
        prompt = chat_prompt_ids(tokenizer, example.messages)
        reply = greedy_reply_ids(model, tokenizer, prompt, max_new_tokens).tolist()
        ids = prompt[0].tolist()
        pairs = set(zip(ids, ids[1:]))
        hits += sum(pair in pairs for pair in zip(reply, reply[1:]))
        count += max(len(reply) - 1, 0)
    return hits / max(count, 1)


def evaluate_demo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    corpus: Corpus,
    *,
    num_examples: int,
    seed: int,
) -> dict:
    """The model card's figures, on the held-out split: language modelling, copying a sentence
    (greedy, exact match), the share of a whole-passage quote's tokens predicted right
    (teacher-forced), and the share of a greedy passage quote's tokens copied from the prompt
    (copied_share)."""
    assert isinstance(model, GenerationMixin)  # a causal LM, as the trainer builds
    pad_id = tokenizer.pad_token_id
    heldout_documents = encode_documents(tokenizer, corpus.heldout_passages + corpus.heldout_articles)
    rng = random.Random(seed + 3)
    encoder = ChatEncoder(tokenizer)
    quotes = [
        example
        for example in (
            make_passage_example(corpus.heldout_passages, rng, max_passages=3)
            for _ in range(2 * num_examples)
        )
        if example
    ]
    return {
        "heldout_lm_loss": round(
            evaluate_loss(model, chunk_documents(heldout_documents, 512), 512, pad_id), 4
        ),
        "copy_exact_match_1_3_passages": round(
            copy_exact_match(
                model,
                tokenizer,
                corpus.heldout_passages,
                num_examples=num_examples,
                max_passages=3,
                seed=seed + 1,
            ),
            3,
        ),
        "copy_exact_match_1_20_passages": round(
            copy_exact_match(
                model,
                tokenizer,
                corpus.heldout_passages,
                num_examples=max(1, num_examples // 5),
                max_passages=20,
                seed=seed + 2,
            ),
            3,
        ),
        "passage_quote_token_accuracy": round(
            target_accuracy(
                model, [encoder.encode(q.messages, q.answer) for q in quotes[:num_examples]], 1024, pad_id
            ),
            3,
        ),
        "passage_quote_copied_share": round(copied_share(model, tokenizer, quotes[:num_examples]), 3),
        "sample_reply": generate_reply(model, tokenizer, SAMPLE_MESSAGES),
    }


def train_demo(
    out_dir: Path,
    *,
    data_dir: Path,
    minutes: float = 20.0,
    max_steps: int | None = None,
    seed: int = 0,
    num_threads: int | None = None,
    num_eval_examples: int = 30,
    log: Callable[[str], None] = print,
) -> dict:
    """Train the demo model from scratch and write it (with its model card) to `out_dir`,
    replaced atomically. Returns the figures of the model card."""
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    started = time.perf_counter()
    recipe = DemoRecipe()
    recipe = replace(
        recipe,
        training=replace(
            recipe.training,
            max_minutes=minutes,
            max_steps=max_steps,
            seed=seed,
            num_threads=num_threads or recipe.training.num_threads,
        ),
    )
    corpus = load_corpus(Path(data_dir), seed=seed)
    tokenizer = train_tokenizer(corpus.train_passages + corpus.train_articles, vocab_size=recipe.vocab_size)
    log(f"tokenizer: {len(tokenizer)} tokens")
    phases = build_phases(recipe, corpus, tokenizer)
    model, training_log = train_causal_lm(
        recipe.model_config(tokenizer), phases, recipe.training, pad_id=tokenizer.pad_token_id, log=log
    )

    figures = evaluate_demo(model, tokenizer, corpus, num_examples=num_eval_examples, seed=seed)
    log(
        f"held-out loss {figures['heldout_lm_loss']:.3f}; copy exact match {figures['copy_exact_match_1_3_passages']:.2f} (1-3 passages), "
        f"{figures['copy_exact_match_1_20_passages']:.2f} (1-20); copied tokens right: passage quotes "
        f"{figures['passage_quote_token_accuracy']:.2f}; greedy passage quotes copied {figures['passage_quote_copied_share']:.2f}"
    )

    return _write_demo(
        Path(out_dir),
        model,
        tokenizer,
        recipe,
        corpus,
        figures,
        training_log,
        minutes=minutes,
        seed=seed,
        started=started,
    )


def _write_demo(
    out_dir: Path,
    model: Any,
    tokenizer: Any,
    recipe: DemoRecipe,
    corpus: Corpus,
    figures: dict,
    training_log: Any,
    *,
    minutes: float,
    seed: int,
    started: float,
) -> dict:
    """Save the model in a staging folder, add the run's figures (`started`: its
    time.perf_counter() at the start), write the card, and put the folder in `out_dir`'s place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    save_demo_model(model, tokenizer, staging)
    figures.update(
        {
            "minutes": minutes,
            "seed": seed,
            "training_wall_seconds": round(training_log.wall_seconds, 1),
            "total_wall_seconds": round(time.perf_counter() - started, 1),
            "steps": training_log.steps,
            "tokens_seen": training_log.tokens,
            "final_train_loss": round(training_log.final_loss, 4),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "size_bytes": sum(f.stat().st_size for f in staging.iterdir()),
            "losses": training_log.losses,
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {recipe.training.num_threads} threads",
        }
    )
    (staging / "README.md").write_text(model_card(recipe, corpus, model.config, figures))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return figures


def _data_description(recipe: DemoRecipe, corpus: Corpus) -> str:
    phases = "; ".join(
        f"{seq} tokens x {batch} rows, {frac:.0%} of the time, up to {mp} passages"
        for seq, batch, frac, mp in recipe.phases
    )
    return f"""- Data: `wiki_passages.txt` ({len(corpus.train_passages)} passages for training,
  {len(corpus.heldout_passages)} held out) and `wikitext2_raw_test.txt` ({len(corpus.train_articles)} articles for training,
  {len(corpus.heldout_articles)} held out; WikiText tokenisation undone), as language modelling, plus
  chat examples rendered through the chat template ({recipe.chat_token_fraction:.0%} of the tokens): extractive ones (passages, then
  'Quote the sentence that mentions "X".' or 'What do the documents say about X?', answered by
  that sentence copied exactly), {recipe.repeat_example_fraction:.0%} 'Repeat document N word for word.'
  (a whole passage copied), {recipe.generic_example_fraction:.0%} generic turns. Loss only on replies for chat examples.
  Phases: {phases}."""


def _learning_rates(training: TrainingConfig) -> str:
    if training.learning_rate == training.min_learning_rate:
        return f"{training.learning_rate:g}, constant"
    return f"{training.learning_rate:g} to {training.min_learning_rate:g}, cosine over the time budget"


def model_card(recipe: DemoRecipe, corpus: Corpus, config, figures: dict) -> str:
    losses = ", ".join(
        f"{step}: {loss:.2f}" for step, loss in figures["losses"][:: max(1, len(figures["losses"]) // 12)]
    )
    training = recipe.training
    return f"""# ragspeed-demo

A tiny Llama trained by ragspeed itself, so that `ragspeed serve` works offline. It is a test
model, not a useful assistant.

## How it was made

```
ragspeed train-demo --out OUT --data-dir DATA --minutes {figures["minutes"]:g} --seed {figures["seed"]}
```

{_data_description(recipe, corpus)}
- Tokenizer: byte-level BPE, {config.vocab_size} tokens, trained on the training split. Special
  tokens `<|pad|>` 0, `<|bos|>` 1, `<|end|>` 2 (eos, ends every reply), `<|system|>`, `<|user|>`,
  `<|assistant|>`. Chat: `<|bos|><|system|>\\n...<|end|>\\n<|user|>\\n...<|end|>\\n<|assistant|>\\n`.
- Model: LlamaForCausalLM, {config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate
  {config.intermediate_size}, {config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, tied embeddings,
  {config.max_position_embeddings} positions; {figures["num_parameters"]:,} parameters.
  Weights stored in bf16 ({figures["size_bytes"] / 1e6:.1f} MB in all); `config.json` says float32:
  load in float32 (bf16 matmuls are very slow on CPUs without bf16 units).
- Training: AdamW (lr {_learning_rates(training)}, warm-up {training.warmup_steps} steps, weight decay {training.weight_decay:g}, beta2 {training.adam_beta2:g}), seed
  {figures["seed"]}. {figures["steps"]} steps, {figures["tokens_seen"]:,} tokens,
  {figures["training_wall_seconds"]:.0f} s of training ({figures["total_wall_seconds"]:.0f} s in all) on {figures["machine"]}.
  The step count depends on the machine's speed (the budget is time).

## Results

| figure (held-out data) | value |
|---|---|
| final training loss (mean of the last {training.log_every} steps) | {figures["final_train_loss"]:.3f} |
| language-modelling loss (512-token rows) | {figures["heldout_lm_loss"]:.3f} |
| copy a sentence, exact match, 1-3 passages | {figures["copy_exact_match_1_3_passages"]:.2f} |
| copy a sentence, exact match, 1-20 passages | {figures["copy_exact_match_1_20_passages"]:.2f} |
| quote a passage: copied tokens predicted right (teacher-forced) | {figures["passage_quote_token_accuracy"]:.2f} |
| quote a passage, greedy: reply tokens copied from the prompt (copied_share) | {figures["passage_quote_copied_share"]:.2f} |

Training loss by step: {losses}.

Sample (greedy) for a two-passage prompt asking to quote the sentence that mentions "Bardeen":

> {figures["sample_reply"]}

License of the data: CC BY-SA 3.0 (Wikipedia) / GFDL (WikiText-2).
"""
