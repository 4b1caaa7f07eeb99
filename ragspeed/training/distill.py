"""`ragspeed train-draft`: distil a 1-2 layer draft model from the demo target (or any Llama).

The draft shares the target's tokenizer, hidden size, heads and vocabulary; it starts from the
target's embedding (tied to its LM head), final norm and a few of its layers (the first and the
last by default), so training starts from a model that already maps hidden states to tokens.

Data (`--data-dir`, the demo's seeded train / held-out split, ragspeed.training.corpus):
- *text*: language-modelling rows of passages and WikiText articles (ragspeed.training.demo);
- *chat*: the demo's chat examples (extractive, repeat, generic; ragspeed.training.examples);
- *continuations*: prompts (the start of a passage as plain text, or a chat prompt over
  passages) continued by the target itself, greedy or sampled at temperature 1, through the
  native engine: the sequences the draft must predict when it serves.
Loss: knowledge distillation, KL(p_target || q_draft) of the next-token distributions at
temperature 1, at every real position of the packed rows. The target runs beside the draft
(no gradient), so its full distribution is matched, not just its argmax.

Figures: final KD loss; held-out *greedy agreement* (the share of positions of held-out target
continuations where the draft's argmax equals the target's next token, teacher-forced); and the
*engine acceptance*: accepted / drafted tokens of the native engine speculating with the draft
on held-out prompts (greedy, k = 4, adaptive).
"""

from __future__ import annotations

import json
import math
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ragspeed.training.corpus import load_corpus
from ragspeed.training.demo import ChatEncoder, chunk_documents, encode_documents, make_chat_pieces
from ragspeed.training.examples import make_extractive_example, make_generic_example, make_repeat_example
from ragspeed.training.trainer import Phase, Piece, TrainingConfig, TrainingLog, train_loop

# Files of the target's folder that are not the draft's own (weights, config, card).
_OWN_FILES = ("config.json", "README.md")


@dataclass(frozen=True)
class DistillRecipe:
    num_hidden_layers: int = 2
    init_from_layers: tuple[int, ...] = (0, -1)  # target layers copied in (negative: from the end)
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
    num_eval_prompts: int = 16  # held-out prompts (half text, half chat) for both figures
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


def build_draft(target: PreTrainedModel, recipe: DistillRecipe) -> PreTrainedModel:
    """A `recipe.num_hidden_layers` copy of the target's architecture, initialised from the
    target's embedding, final norm and `init_from_layers` (the rest at random)."""
    config = replace_config(target.config, num_hidden_layers=recipe.num_hidden_layers)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        num_target_layers = len(target.model.layers)
        for draft_layer, source in zip(draft.model.layers, recipe.init_from_layers):
            draft_layer.load_state_dict(target.model.layers[source % num_target_layers].state_dict())
    draft.tie_weights()
    return draft


def replace_config(config, **changes):
    return config.__class__.from_dict({**config.to_dict(), **changes, "tie_word_embeddings": True})


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
    log: Callable[[str], None] = print,
) -> TrainingLog:
    """The shared training loop (ragspeed.training.trainer.train_loop) on the KD loss, one phase
    of `recipe.seq_len`-token rows."""
    torch.manual_seed(config.seed)
    draft.train()

    def step_loss(token_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            target_logits = target(input_ids=token_ids).logits
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
    draft: PreTrainedModel, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> float:
    """Share of continuation positions where the draft's argmax (teacher-forced on prompt +
    continuation) equals the target's greedy next token."""
    hits = total = 0
    for prompt, continuation in pairs:
        if not continuation:
            continue
        ids = torch.tensor([list(prompt) + list(continuation)])
        logits = draft(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [len(continuation), vocab]
        hits += int((logits.argmax(dim=-1) == torch.tensor(continuation)).sum())
        total += len(continuation)
    return hits / max(total, 1)


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
    from ragspeed.engine.llm_engine import LLMEngine
    from ragspeed.engine.protocol import GenerationRequest, SamplingParams

    engine = LLMEngine(
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


def save_draft(draft: PreTrainedModel, target_dir: Path, out_dir: Path) -> None:
    """HF folder: bf16 safetensors (config says float32: load it so), and the target's
    tokenizer and generation config copied unchanged."""
    draft.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    draft.to(torch.float32)
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


def distill_draft(
    target_dir: Path,
    out_dir: Path,
    *,
    data_dir: Path,
    minutes: float = 12.0,
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
    training = replace(
        recipe.training,
        max_minutes=minutes,
        max_steps=max_steps,
        seed=seed,
        num_threads=num_threads or recipe.training.num_threads,
    )
    torch.set_num_threads(training.num_threads)
    target_dir = Path(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    corpus = load_corpus(Path(data_dir), seed=0)  # the demo's split: held-out text stays unseen
    rng = random.Random(seed)
    budget_s = minutes * 60.0
    max_model_len = recipe.seq_len + recipe.max_new_tokens

    # 1. the target's own continuations of text and chat prompts
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.llm_engine import LLMEngine

    generator = LLMEngine(
        EngineConfig(
            model=str(target_dir),
            max_model_len=max_model_len,
            num_kv_cache_tokens=recipe.generation_batch * max_model_len,
            seed=seed,
        ),
        tokenizer=tokenizer,
    )
    prompt_limit = recipe.seq_len - recipe.max_new_tokens
    train_texts = list(corpus.train_passages)
    rng.shuffle(train_texts)
    prompts = text_prompts(tokenizer, train_texts, recipe.prompt_tokens)
    prompts += chat_prompts(
        tokenizer, corpus.train_passages, rng, len(prompts), recipe.max_chat_passages, prompt_limit
    )
    rng.shuffle(prompts)
    generation_start = time.perf_counter()
    pairs = generate_continuations(
        generator,
        prompts,
        max_new_tokens=recipe.max_new_tokens,
        sampled_fraction=recipe.sampled_fraction,
        batch_size=recipe.generation_batch,
        seed=seed,
        deadline=generation_start + budget_s * recipe.generation_fraction,
    )
    generation_s = time.perf_counter() - generation_start
    log(f"{len(pairs)} target continuations in {generation_s:.0f}s")

    # 2. knowledge distillation on continuations, text and chat rows
    continuation_pieces = [Piece(p + c, (1,) * (len(p) + len(c))) for p, c in pairs]
    num_continuation_tokens = sum(len(p.token_ids) for p in continuation_pieces)
    lm_texts = list(corpus.train_passages + corpus.train_articles)
    text_pieces = chunk_documents(encode_documents(tokenizer, lm_texts), recipe.seq_len)
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

    draft = build_draft(target, recipe)
    remaining_s = max(budget_s - (time.perf_counter() - started), 1.0)
    training_log = train_kd(
        target,
        draft,
        make_pieces,
        recipe,
        training,
        pad_id=tokenizer.pad_token_id,
        budget_s=remaining_s,
        log=log,
    )

    # 3. figures on held-out prompts, then the folder
    eval_rng = random.Random(seed + 1)
    num_text = recipe.num_eval_prompts // 2
    eval_prompts = text_prompts(tokenizer, corpus.heldout_passages, recipe.prompt_tokens)[:num_text]
    eval_prompts += chat_prompts(
        tokenizer,
        corpus.heldout_passages,
        eval_rng,
        recipe.num_eval_prompts - len(eval_prompts),
        recipe.max_chat_passages,
        prompt_limit,
    )
    eval_pairs = generate_continuations(
        generator,
        eval_prompts,
        max_new_tokens=recipe.max_new_tokens,
        sampled_fraction=0.0,
        batch_size=recipe.generation_batch,
        seed=seed,
    )
    agreement = greedy_agreement(draft, eval_pairs)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        save_draft(draft, target_dir, staging)
        acceptance = engine_acceptance(
            target_dir,
            staging,
            eval_prompts,
            max_tokens=min(64, recipe.max_new_tokens),
            max_model_len=max_model_len,
        )
        log(
            f"kd {training_log.final_loss:.3f}; held-out greedy agreement {agreement:.3f}; "
            f"engine acceptance {acceptance['acceptance_rate']:.3f}"
        )
        figures = {
            "command": command or f"ragspeed train-draft --minutes {minutes:g} --seed {seed}",
            "target": str(target_dir),
            "minutes": minutes,
            "seed": seed,
            "num_threads": training.num_threads,
            "generation_seconds": round(generation_s, 1),
            "num_continuations": len(pairs),
            "continuation_tokens": num_continuation_tokens,
            "training_wall_seconds": round(training_log.wall_seconds, 1),
            "total_wall_seconds": round(time.perf_counter() - started, 1),
            "steps": training_log.steps,
            "tokens_seen": training_log.tokens,
            "first_kd_loss": round(training_log.losses[0][1], 4) if training_log.losses else math.nan,
            "final_kd_loss": round(training_log.final_loss, 4),
            "heldout_greedy_agreement": round(agreement, 4),
            "heldout_num_tokens": sum(len(c) for _, c in eval_pairs),
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
    return f"""# ragspeed-demo-draft

A {c.num_hidden_layers}-layer draft model distilled from `{Path(figures["target"]).name}` for speculative
decoding (`--speculative draft --draft-model ragspeed-demo-draft`). It shares the target's
tokenizer (copied unchanged) and is useful only as that model's proposer.

## How it was made

```
{figures["command"]}
```

- Model: LlamaForCausalLM, {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate {c.intermediate_size},
  {c.num_attention_heads} heads, {c.num_key_value_heads} KV heads, tied embeddings; {figures["num_parameters"]:,} parameters.
  Initialised from the target's embedding, final norm and layers {list(recipe.init_from_layers)}.
  Weights stored in bf16 ({figures["size_bytes"] / 1e6:.1f} MB in all); `config.json` says float32.
- Data (`wiki_passages.txt` and `wikitext2_raw_test.txt`, the demo's train split): {figures["num_continuations"]} continuations generated by the
  target ({figures["continuation_tokens"]:,} tokens with their prompts; {recipe.sampled_fraction:.0%} sampled at temperature 1, the rest
  greedy; prompts: the first {recipe.prompt_tokens} tokens of passages, and chat prompts of the demo's examples
  over up to {recipe.max_chat_passages} passages), in {figures["generation_seconds"]:.0f} s; plus language-modelling rows of passages and
  WikiText articles ({recipe.text_ratio:g}x as many tokens) and the demo's chat examples ({recipe.chat_ratio:g}x).
- Loss: knowledge distillation, KL(target || draft) of next-token distributions at temperature 1,
  every real position of {recipe.seq_len}-token rows, {recipe.batch_size} rows per step.
- Training: AdamW (lr {recipe.training.learning_rate:g} to {recipe.training.min_learning_rate:g}, cosine over the time
  budget, warm-up {recipe.training.warmup_steps} steps), seed {figures["seed"]}, {figures["steps"]} steps, {figures["tokens_seen"]:,} tokens,
  {figures["training_wall_seconds"]:.0f} s of training ({figures["total_wall_seconds"]:.0f} s in all) on {figures["machine"]},
  {figures["num_threads"]} thread(s). The step count depends on the machine's speed (the budget is time).

## Results

| figure | value |
|---|---|
| KD loss, first logged (mean of {recipe.training.log_every} steps) | {figures["first_kd_loss"]:.3f} |
| final KD loss (mean of the last {recipe.training.log_every} steps) | {figures["final_kd_loss"]:.3f} |
| held-out greedy agreement (draft argmax = target's greedy next token, per token, {figures["heldout_num_tokens"]} tokens) | {figures["heldout_greedy_agreement"]:.3f} |
| engine acceptance rate (native engine, greedy, k = 4, {recipe.num_eval_prompts} held-out prompts) | {figures["engine_acceptance_rate"]:.3f} |
| engine mean accepted length (per verification) | {figures["engine_mean_accepted_length"]:.2f} |

KD loss by step: {losses}.

License of the data: CC BY-SA 3.0 (Wikipedia) / GFDL (WikiText-2).
"""
