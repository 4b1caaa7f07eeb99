"""Train a causal LM (from scratch, or on from a saved one) on packed rows of tokens, on the
CPU, within a time budget.

The data arrives as *pieces*: token ids with a parallel loss mask (1 where the token is a
target). A language-modelling document is all targets; a chat example has targets only on the
assistant's reply and its <|end|>, so passages shown in prompts are read, not memorised.
Pieces are packed greedily into rows of `seq_len` (padding masked out), so an answer always
sits in the same row as the documents it copies from.

`train_loop` is the one loop (budget, cosine learning rate, packing, logging); its caller gives
the loss of a batch: `train_causal_lm` the masked next-token loss, the draft distillation
(ragspeed.training.distill) the KD loss.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class Piece:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1: predict this token; 0: context only

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.loss_mask)


@dataclass(frozen=True)
class Phase:
    """A stretch of training at one sequence length; `time_fraction` of the whole budget."""

    seq_len: int
    batch_size: int
    time_fraction: float
    make_pieces: Callable[[random.Random], list[Piece]]  # a fresh shuffled epoch of pieces


@dataclass(frozen=True)
class TrainingConfig:
    max_minutes: float = 20.0
    max_steps: int | None = None  # stop earlier than the time budget (tests, reproducible runs)
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    num_threads: int = 2
    log_every: int = 25


@dataclass
class TrainingLog:
    steps: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss since last log)

    @property
    def final_loss(self) -> float:
        return self.losses[-1][1] if self.losses else math.nan


def pack_rows(pieces: Sequence[Piece], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy packing of whole pieces into rows; returns ids and masks, both [num_rows, seq_len]."""
    rows_ids: list[list[int]] = []
    rows_mask: list[list[int]] = []
    ids: list[int] = []
    mask: list[int] = []
    for piece in pieces:
        if len(piece.token_ids) > seq_len:
            continue  # callers cut documents to seq_len; an over-long chat example is dropped
        if len(ids) + len(piece.token_ids) > seq_len:
            rows_ids.append(ids + [pad_id] * (seq_len - len(ids)))
            rows_mask.append(mask + [0] * (seq_len - len(mask)))
            ids, mask = [], []
        ids += piece.token_ids
        mask += piece.loss_mask
    if ids:
        rows_ids.append(ids + [pad_id] * (seq_len - len(ids)))
        rows_mask.append(mask + [0] * (seq_len - len(mask)))
    return torch.tensor(rows_ids, dtype=torch.long), torch.tensor(rows_mask, dtype=torch.long)


def masked_lm_loss(logits: torch.Tensor, token_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    # logits: [batch, seq_len, vocab]; position t predicts token t+1 where mask[t+1] is 1.
    targets = token_ids[:, 1:].masked_fill(loss_mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100
    )


def scheduled_learning_rate(config: TrainingConfig, step: int, progress: float) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return config.min_learning_rate + (config.learning_rate - config.min_learning_rate) * cosine


def adamw(params: list[torch.nn.Parameter], config: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=config.learning_rate,
        betas=(0.9, config.adam_beta2),
    )


def train_loop(
    params: list[torch.nn.Parameter],
    step_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]],
    phases: Sequence[Phase],
    config: TrainingConfig,
    *,
    budget_s: float,
    rng: random.Random,
    pad_id: int,
    log: Callable[[str], None] = print,
    loss_name: str = "loss",
) -> TrainingLog:
    """AdamW on `params` over the packed rows of each phase, in turn, within the budget: the
    learning rate follows a cosine over it (progress = elapsed / budget, or step / max_steps
    when that ends sooner). `step_loss(token_ids, loss_mask)` (both [batch, seq_len]) returns a
    batch's loss and the number of tokens it counts."""
    if not phases:
        raise ValueError("phases must not be empty")
    optimizer = adamw(params, config)
    total_fraction = sum(phase.time_fraction for phase in phases)
    training_log = TrainingLog()
    start = time.perf_counter()
    phase_end_s = 0.0
    loss_sum, loss_count = 0.0, 0

    def progress() -> float:
        by_time = (time.perf_counter() - start) / budget_s
        by_steps = training_log.steps / config.max_steps if config.max_steps else 0.0
        return max(by_time, by_steps)

    def out_of_budget() -> bool:
        return progress() >= 1.0

    for phase in phases:
        phase_end_s += budget_s * phase.time_fraction / total_fraction
        log(f"phase seq_len={phase.seq_len} batch={phase.batch_size} until {phase_end_s:.0f}s")
        while time.perf_counter() - start < phase_end_s and not out_of_budget():
            for token_ids, loss_mask in _batches(phase, rng, pad_id):
                if time.perf_counter() - start >= phase_end_s or out_of_budget():
                    break
                lr = scheduled_learning_rate(config, training_log.steps, progress())
                loss, num_tokens = _optimizer_step(
                    optimizer, params, step_loss, token_ids, loss_mask, lr, config.grad_clip
                )
                training_log.steps += 1
                training_log.tokens += num_tokens
                loss_sum += loss
                loss_count += 1
                if training_log.steps % config.log_every == 0:
                    mean_loss = loss_sum / loss_count
                    training_log.losses.append((training_log.steps, mean_loss))
                    loss_sum, loss_count = 0.0, 0
                    elapsed = time.perf_counter() - start
                    log(
                        f"step {training_log.steps} {loss_name} {mean_loss:.3f} lr {lr:.2e} "
                        f"{training_log.tokens / elapsed:.0f} tok/s {elapsed:.0f}s"
                    )
    if loss_count:
        training_log.losses.append((training_log.steps, loss_sum / loss_count))
    training_log.wall_seconds = time.perf_counter() - start
    return training_log


def _batches(phase: Phase, rng: random.Random, pad_id: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of the phase's pieces packed into rows, shuffled, in batches of token ids and
    loss mask (both [batch, seq_len])."""
    row_ids, row_mask = pack_rows(phase.make_pieces(rng), phase.seq_len, pad_id)
    order = torch.randperm(row_ids.size(0), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    for first in range(0, len(order) - phase.batch_size + 1, phase.batch_size):
        batch = order[first : first + phase.batch_size]
        yield row_ids[batch], row_mask[batch]


def _optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    step_loss: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]],
    token_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lr: float,
    grad_clip: float,
) -> tuple[float, int]:
    """One AdamW step at learning rate `lr`, gradients clipped: the batch's loss and tokens."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss, num_tokens = step_loss(token_ids, loss_mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return loss.item(), num_tokens


def train_causal_lm(
    source: PretrainedConfig | Path,
    phases: Sequence[Phase],
    config: TrainingConfig,
    *,
    pad_id: int,
    log: Callable[[str], None] = print,
) -> tuple[PreTrainedModel, TrainingLog]:
    """Train a fresh model of a config, or go on training the model saved in a folder
    (train_loop, masked next-token loss)."""
    if not phases:
        raise ValueError("phases must not be empty")
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.num_threads)
    rng = random.Random(config.seed)
    if isinstance(source, Path):
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(source, dtype=torch.float32)
    model.train()

    def step_loss(token_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = model(input_ids=token_ids).logits
        return masked_lm_loss(logits, token_ids, loss_mask), int(token_ids.numel())

    training_log = train_loop(
        list(model.parameters()),
        step_loss,
        phases,
        config,
        budget_s=config.max_minutes * 60.0,
        rng=rng,
        pad_id=pad_id,
        log=log,
    )
    model.eval()
    return model, training_log


@torch.no_grad()
def evaluate_loss(
    model: PreTrainedModel, pieces: Sequence[Piece], seq_len: int, pad_id: int, batch_size: int = 8
) -> float:
    """Mean masked next-token loss over `pieces` (token-weighted)."""
    row_ids, row_mask = pack_rows(pieces, seq_len, pad_id)
    total, count = 0.0, 0
    for first in range(0, row_ids.size(0), batch_size):
        token_ids, loss_mask = row_ids[first : first + batch_size], row_mask[first : first + batch_size]
        num_targets = int(loss_mask[:, 1:].sum())
        if num_targets == 0:
            continue
        loss = masked_lm_loss(model(input_ids=token_ids).logits, token_ids, loss_mask)
        total += loss.item() * num_targets
        count += num_targets
    return total / max(count, 1)


@torch.no_grad()
def target_accuracy(
    model: PreTrainedModel, pieces: Sequence[Piece], seq_len: int, pad_id: int, batch_size: int = 8
) -> float:
    """Share of the targets of `pieces` that the model's greedy next token gets right, teacher
    forced: for copying pieces, the share of copied tokens prompt lookup would have accepted."""
    row_ids, row_mask = pack_rows(pieces, seq_len, pad_id)
    hits, count = 0, 0
    for first in range(0, row_ids.size(0), batch_size):
        token_ids, loss_mask = row_ids[first : first + batch_size], row_mask[first : first + batch_size]
        predicted = model(input_ids=token_ids).logits[:, :-1].argmax(-1)
        targets = loss_mask[:, 1:] == 1
        hits += int((predicted == token_ids[:, 1:])[targets].sum())
        count += int(targets.sum())
    return hits / max(count, 1)
