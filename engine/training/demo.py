"""`ragspeed train-demo`: tokenizer, data mix, training and model card of the bundled demo model.

Two phases (nano-GPT style pre-training, then a long-context stretch, as real models do):
phase 1 packs rows of 512 tokens with extractive examples over 1-3 passages; phase 2 packs rows
of 3072 tokens with examples over up to 20 passages, so positions as long as a RAG prompt of
the NQ set (about 2.5-3k demo tokens) are trained. Half the tokens of each epoch are
language-modelling text, half chat examples (engine.training.examples).

That *base* stage leaves a model that does not copy from its context, and prompt-lookup
speculation needs one that does. Two more stages, each continuing a saved model (`--init`), are
experiments towards one, not yet a recipe that gives it: *copy*, the synthetic induction
curriculum of engine.training.copying (it teaches induction on repeated random patterns, and
unlearns language), then *finetune*, the base data mix again in longer rows with whole-passage
quotes and pattern rows mixed in. Measured (2-core CPU, from the bundled model): copy, ~1,940
steps, pattern accuracy 0.91 on its own alphabet, language-modelling loss 5.9 -> 16.6; finetune,
25 minutes, loss back to 6.3, copied tokens of held-out passage quotes 0.11 (the base model:
0.08), and greedy replies that repeat one token. The bundled model is the base stage's.
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

import torch
from transformers import GenerationConfig, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

from engine.training.corpus import Corpus, load_corpus
from engine.training.copying import frequent_tokens, pairs_piece, pattern_piece
from engine.training.examples import (
    Message,
    make_extractive_example,
    make_generic_example,
    make_passage_example,
    make_repeat_example,
)
from engine.training.tokenizer import save_tokenizer, train_tokenizer
from engine.training.trainer import Phase, Piece, TrainingConfig, evaluate_loss, target_accuracy, train_causal_lm

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "ragspeed-demo"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"


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
    passage_example_fraction: float = 0.0  # of chat examples: quote the passage that mentions a key
    pattern_token_fraction: float = 0.0  # of each epoch's tokens: repeated random patterns
    pattern_alphabet_size: int = 2048  # their tokens: the most frequent ordinary ones
    # One thread: on a CPU shared with other jobs, two OpenMP threads spin waiting for each other
    # (measured 5x slower than one thread under a load of 10 on 2 cores).
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
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )


@dataclass(frozen=True)
class CopyRecipe:
    """Stage `copy` (engine.training.copying): pairs rows for the first `pairs_fraction` of the
    budget, then pattern rows. A constant learning rate after warm-up: the induction phase
    change comes late (after ~1,100 pattern steps on the dev CPU) and a decaying rate delays it."""

    seq_len: int = 256
    batch_size: int = 16
    alphabet_size: int = 512  # the most frequent ordinary tokens of the training text
    pairs_fraction: float = 0.1
    rows_per_epoch: int = 256
    training: TrainingConfig = TrainingConfig(
        learning_rate=2e-3, min_learning_rate=2e-3, warmup_steps=30, weight_decay=0.0, adam_beta2=0.98,
        log_every=25, num_threads=2,
    )


# Stage `finetune`: the base data mix in rows as long as a RAG prompt of a few documents, with
# whole-passage quotes and pattern rows, from the copy stage's model at a lower learning rate.
FINETUNE_RECIPE = DemoRecipe(
    phases=((1024, 4, 1.0, 5),),
    repeat_example_fraction=0.2,
    passage_example_fraction=0.3,
    pattern_token_fraction=0.15,
    training=TrainingConfig(learning_rate=1e-3, min_learning_rate=1e-4, warmup_steps=30, log_every=10, num_threads=2),
)
STAGES = ("base", "copy", "finetune")


class ChatEncoder:
    """Renders chat examples through the chat template into pieces masked to the reply."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer = tokenizer

    def encode(self, prompt_messages: Sequence[Message], reply: str) -> Piece:
        prompt = self.tokenizer.apply_chat_template(list(prompt_messages), tokenize=False, add_generation_prompt=True)
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


def make_chat_pieces(
    corpus_passages: Sequence[str],
    lm_texts: Sequence[str],
    encoder: ChatEncoder,
    rng: random.Random,
    *,
    num_tokens: int,
    max_passages: int,
    generic_fraction: float,
    repeat_fraction: float,
    passage_fraction: float = 0.0,
) -> list[Piece]:
    pieces: list[Piece] = []
    total = 0
    while total < num_tokens:
        draw = rng.random()
        if draw < repeat_fraction:
            repeat = make_repeat_example(corpus_passages, rng, max_passages=min(max_passages, 3))
            piece = encoder.encode(repeat.messages, repeat.answer)
        elif draw < repeat_fraction + generic_fraction:
            *prompt, reply = make_generic_example(lm_texts, rng)
            piece = encoder.encode(prompt, reply["content"])
        elif draw < repeat_fraction + generic_fraction + passage_fraction:
            passage = make_passage_example(corpus_passages, rng, max_passages=max_passages)
            if passage is None:
                continue
            piece = encoder.encode(passage.messages, passage.answer)
        else:
            example = make_extractive_example(corpus_passages, rng, max_passages=max_passages)
            if example is None:
                continue
            piece = encoder.encode(example.messages, example.answer)
        pieces.append(piece)
        total += len(piece.token_ids)
    return pieces


def build_phases(recipe: DemoRecipe, corpus: Corpus, tokenizer: PreTrainedTokenizerFast) -> list[Phase]:
    encoder = ChatEncoder(tokenizer)
    lm_documents = encode_documents(tokenizer, corpus.train_passages + corpus.train_articles)
    lm_tokens = sum(len(ids) for ids in lm_documents)
    chat_tokens = int(lm_tokens * recipe.chat_token_fraction / (1.0 - recipe.chat_token_fraction))
    lm_texts = corpus.train_passages + corpus.train_articles
    pattern_tokens = int((lm_tokens + chat_tokens) * recipe.pattern_token_fraction / (1.0 - recipe.pattern_token_fraction))
    alphabet = frequent_tokens(lm_documents, recipe.pattern_alphabet_size, first_ordinary=_first_ordinary(tokenizer)) if pattern_tokens else []

    def make_phase(seq_len: int, batch_size: int, fraction: float, max_passages: int) -> Phase:
        def make_pieces(rng: random.Random) -> list[Piece]:
            pieces = chunk_documents(lm_documents, seq_len)
            pieces += make_chat_pieces(
                corpus.train_passages, lm_texts, encoder, rng,
                num_tokens=chat_tokens, max_passages=max_passages,
                generic_fraction=recipe.generic_example_fraction,
                repeat_fraction=recipe.repeat_example_fraction,
                passage_fraction=recipe.passage_example_fraction,
            )
            total = 0
            while total < pattern_tokens:  # of every length up to the row's: copies from far back too
                pieces.append(pattern_piece(alphabet, rng.randint(seq_len // 4, seq_len), tokenizer.bos_token_id, rng))
                total += len(pieces[-1].token_ids)
            rng.shuffle(pieces)
            return pieces

        return Phase(seq_len=seq_len, batch_size=batch_size, time_fraction=fraction, make_pieces=make_pieces)

    return [make_phase(*spec) for spec in recipe.phases]


def _first_ordinary(tokenizer: PreTrainedTokenizerFast) -> int:
    return max(tokenizer.all_special_ids) + 1


def build_copy_phases(recipe: CopyRecipe, corpus: Corpus, tokenizer: PreTrainedTokenizerFast) -> list[Phase]:
    documents = encode_documents(tokenizer, corpus.train_passages + corpus.train_articles)
    alphabet = frequent_tokens(documents, recipe.alphabet_size, first_ordinary=_first_ordinary(tokenizer))

    def phase(make_piece, fraction: float) -> Phase:
        def make_pieces(rng: random.Random) -> list[Piece]:
            return [make_piece(alphabet, recipe.seq_len, tokenizer.bos_token_id, rng) for _ in range(recipe.rows_per_epoch)]

        return Phase(seq_len=recipe.seq_len, batch_size=recipe.batch_size, time_fraction=fraction, make_pieces=make_pieces)

    return [phase(pairs_piece, recipe.pairs_fraction), phase(pattern_piece, 1.0 - recipe.pairs_fraction)]


@torch.no_grad()
def generate_reply(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], max_new_tokens: int = 80) -> str:
    prompt_ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    output = model.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, prompt_ids.shape[1] :], skip_special_tokens=True)


def copy_exact_match(model, tokenizer, passages: Sequence[str], *, num_examples: int, max_passages: int, seed: int) -> float:
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
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    model.to(torch.float32)
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


def evaluate_demo(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, corpus: Corpus, *, num_examples: int, seed: int) -> dict:
    """The model card's figures, on the held-out split: language modelling, copying a sentence
    (greedy, exact match), and the share of copied tokens predicted right, teacher-forced, on
    whole-passage quotes and on repeated random patterns (what prompt lookup would accept)."""
    pad_id = tokenizer.pad_token_id
    heldout_documents = encode_documents(tokenizer, corpus.heldout_passages + corpus.heldout_articles)
    rng = random.Random(seed + 3)
    encoder = ChatEncoder(tokenizer)
    quotes = [example for example in (make_passage_example(corpus.heldout_passages, rng, max_passages=3) for _ in range(2 * num_examples)) if example]
    alphabet = frequent_tokens(heldout_documents, CopyRecipe.alphabet_size, first_ordinary=_first_ordinary(tokenizer))
    return {
        "heldout_lm_loss": round(evaluate_loss(model, chunk_documents(heldout_documents, 512), 512, pad_id), 4),
        "copy_exact_match_1_3_passages": round(copy_exact_match(model, tokenizer, corpus.heldout_passages, num_examples=num_examples, max_passages=3, seed=seed + 1), 3),
        "copy_exact_match_1_20_passages": round(copy_exact_match(model, tokenizer, corpus.heldout_passages, num_examples=max(1, num_examples // 5), max_passages=20, seed=seed + 2), 3),
        "passage_quote_token_accuracy": round(target_accuracy(model, [encoder.encode(q.messages, q.answer) for q in quotes[:num_examples]], 1024, pad_id), 3),
        "pattern_token_accuracy": round(target_accuracy(model, [pattern_piece(alphabet, 256, tokenizer.bos_token_id, rng) for _ in range(32)], 256, pad_id), 3),
        "sample_reply": generate_reply(model, tokenizer, SAMPLE_MESSAGES),
    }


def check_stage(stage: str, init: Path | None) -> None:
    """ValueError "option: message" unless `stage` and `init` go together."""
    if stage not in STAGES:
        raise ValueError(f"stage: must be one of {', '.join(STAGES)}, got {stage!r}")
    if stage == "base" and init is not None:
        raise ValueError("init: the base stage trains from scratch; init is for the copy and finetune stages")
    if stage != "base" and init is None:
        raise ValueError(f"init: the {stage} stage goes on training a saved model: name its folder")
    if init is not None and not (Path(init) / "config.json").is_file():
        raise ValueError(f"init: no saved model in {init} (no config.json)")


def train_demo(
    out_dir: Path = DEMO_MODEL_DIR,
    *,
    data_dir: Path = DEFAULT_DATA_DIR,
    minutes: float = 20.0,
    max_steps: int | None = None,
    seed: int = 0,
    num_threads: int | None = None,
    num_eval_examples: int = 30,
    stage: str = "base",
    init: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Train the demo model and write it (with its model card) to `out_dir`, replaced atomically:
    stage `base` from scratch, stages `copy` and `finetune` going on from the model in `init`
    (its tokenizer kept). Returns the figures of the model card."""
    if minutes <= 0:
        raise ValueError(f"minutes must be positive, got {minutes}")
    check_stage(stage, init)
    started = time.perf_counter()
    recipe = {"base": DemoRecipe(), "copy": CopyRecipe(), "finetune": FINETUNE_RECIPE}[stage]
    recipe = replace(recipe, training=replace(recipe.training, max_minutes=minutes, max_steps=max_steps, seed=seed,
        num_threads=num_threads or recipe.training.num_threads))
    corpus = load_corpus(Path(data_dir), seed=seed)
    if init is None:
        tokenizer = train_tokenizer(corpus.train_passages + corpus.train_articles, vocab_size=recipe.vocab_size)
        log(f"tokenizer: {len(tokenizer)} tokens")
        source = recipe.model_config(tokenizer)
        earlier_card = None
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(init))
        source = Path(init)
        card_path = Path(init) / "README.md"
        earlier_card = card_path.read_text() if card_path.is_file() else None
    phases = build_copy_phases(recipe, corpus, tokenizer) if stage == "copy" else build_phases(recipe, corpus, tokenizer)
    model, training_log = train_causal_lm(source, phases, recipe.training, pad_id=tokenizer.pad_token_id, log=log)

    figures = evaluate_demo(model, tokenizer, corpus, num_examples=num_eval_examples, seed=seed)
    log(f"held-out loss {figures['heldout_lm_loss']:.3f}; copy exact match {figures['copy_exact_match_1_3_passages']:.2f} (1-3 passages), "
        f"{figures['copy_exact_match_1_20_passages']:.2f} (1-20); copied tokens right: passage quotes "
        f"{figures['passage_quote_token_accuracy']:.2f}, patterns {figures['pattern_token_accuracy']:.2f}")

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    save_demo_model(model, tokenizer, staging)
    figures.update({
        "stage": stage,
        "init": None if init is None else str(init),
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
    })
    (staging / "README.md").write_text(model_card(recipe, corpus, model.config, figures, earlier_card))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    return figures


def _data_description(recipe: DemoRecipe | CopyRecipe, corpus: Corpus) -> str:
    if isinstance(recipe, CopyRecipe):
        return f"""- Data: synthetic rows (`engine.training.copying`) over the {recipe.alphabet_size} most frequent
  ordinary tokens of the training text, {recipe.seq_len} tokens a row, {recipe.batch_size} rows a step: *pairs*
  (`bos a a b b ...`, loss on every second token) for the first {recipe.pairs_fraction:.0%} of the time, then
  *patterns* (bos and a random pattern of 8-32 tokens repeated to fill the row, loss on the repeats)."""
    phases = "; ".join(f"{seq} tokens x {batch} rows, {frac:.0%} of the time, up to {mp} passages" for seq, batch, frac, mp in recipe.phases)
    extra = ""
    if recipe.passage_example_fraction:
        extra += f""", {recipe.passage_example_fraction:.0%} 'Quote the passage that mentions "X".' and
  similar (the whole passage that contains X copied)"""
    if recipe.pattern_token_fraction:
        extra += f"""; plus repeated random patterns (as in the copy stage, over the
  {recipe.pattern_alphabet_size} most frequent tokens, a quarter to a whole row long) for {recipe.pattern_token_fraction:.0%} of the tokens"""
    return f"""- Data: `../shared/data/wiki_passages.txt` ({len(corpus.train_passages)} passages for training,
  {len(corpus.heldout_passages)} held out) and `wikitext2_raw_test.txt` ({len(corpus.train_articles)} articles for training,
  {len(corpus.heldout_articles)} held out; WikiText tokenisation undone), as language modelling, plus
  chat examples rendered through the chat template ({recipe.chat_token_fraction:.0%} of the tokens): extractive ones (passages, then
  'Quote the sentence that mentions "X".' or 'What do the documents say about X?', answered by
  that sentence copied exactly), {recipe.repeat_example_fraction:.0%} 'Repeat document N word for word.'
  (a whole passage copied), {recipe.generic_example_fraction:.0%} generic turns{extra}. Loss only on replies for chat examples.
  Phases: {phases}."""


def _learning_rates(training: TrainingConfig) -> str:
    if training.learning_rate == training.min_learning_rate:
        return f"{training.learning_rate:g}, constant"
    return f"{training.learning_rate:g} to {training.min_learning_rate:g}, cosine over the time budget"


def model_card(recipe: DemoRecipe | CopyRecipe, corpus: Corpus, config, figures: dict, earlier_card: str | None) -> str:
    """The card of this stage; an earlier stage's card (the init model's) follows it."""
    losses = ", ".join(f"{step}: {loss:.2f}" for step, loss in figures["losses"][:: max(1, len(figures["losses"]) // 12)])
    stage_flags = "" if figures["stage"] == "base" else f" --stage {figures['stage']} --init {figures['init']}"
    training = recipe.training
    card = f"""# ragspeed-demo

A tiny Llama trained by ragspeed itself, so that `ragspeed serve` works offline and speculative
decoding has a model that copies from its context. It is a test model, not a useful assistant.

## How it was made{'' if figures['stage'] == 'base' else f" (stage {figures['stage']}; the earlier stages below)"}

```
ragspeed train-demo{stage_flags} --minutes {figures['minutes']:g} --seed {figures['seed']}
```

{_data_description(recipe, corpus)}
- Tokenizer: byte-level BPE, {config.vocab_size} tokens, trained on the training split. Special
  tokens `<|pad|>` 0, `<|bos|>` 1, `<|end|>` 2 (eos, ends every reply), `<|system|>`, `<|user|>`,
  `<|assistant|>`. Chat: `<|bos|><|system|>\\n...<|end|>\\n<|user|>\\n...<|end|>\\n<|assistant|>\\n`.
- Model: LlamaForCausalLM, {config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate
  {config.intermediate_size}, {config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, tied embeddings,
  {config.max_position_embeddings} positions; {figures['num_parameters']:,} parameters.
  Weights stored in bf16 ({figures['size_bytes'] / 1e6:.1f} MB in all); `config.json` says float32:
  load in float32 (bf16 matmuls are very slow on CPUs without bf16 units).
- Training: AdamW (lr {_learning_rates(training)}, warm-up {training.warmup_steps} steps, weight decay {training.weight_decay:g}, beta2 {training.adam_beta2:g}), seed
  {figures['seed']}. {figures['steps']} steps, {figures['tokens_seen']:,} tokens,
  {figures['training_wall_seconds']:.0f} s of training ({figures['total_wall_seconds']:.0f} s in all) on {figures['machine']}.
  The step count depends on the machine's speed (the budget is time).

## Results

| figure (held-out data) | value |
|---|---|
| final training loss (mean of the last {training.log_every} steps) | {figures['final_train_loss']:.3f} |
| language-modelling loss (512-token rows) | {figures['heldout_lm_loss']:.3f} |
| copy a sentence, exact match, 1-3 passages | {figures['copy_exact_match_1_3_passages']:.2f} |
| copy a sentence, exact match, 1-20 passages | {figures['copy_exact_match_1_20_passages']:.2f} |
| quote a passage: copied tokens predicted right (teacher-forced) | {figures['passage_quote_token_accuracy']:.2f} |
| repeated random patterns: repeats predicted right | {figures['pattern_token_accuracy']:.2f} |

Training loss by step: {losses}.

Sample (greedy) for a two-passage prompt asking to quote the sentence that mentions "Bardeen":

> {figures['sample_reply']}

License of the data: CC BY-SA 3.0 (Wikipedia) / GFDL (WikiText-2).
"""
    if earlier_card:
        body = earlier_card[earlier_card.index("## ") :] if "## " in earlier_card else earlier_card
        body = "\n".join("#" + line if line.startswith("#") else line for line in body.splitlines())
        card += f"\n## Earlier stages (the card of the model this one went on from)\n\n{body}\n"
    return card
