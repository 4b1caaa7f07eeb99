"""Fidelity of a prefill that reuses document KV, against full prefill on the same prompts.

Terms (gateway.fidelity_gate gives the threshold that reads them):

- *reference*: full prefill's greedy answer to a question (its token ids) and, at each of its
  positions, the next-token distribution it was sampled from;
- a *distribution* is the top `MAX_LOGPROBS` (token id, logprob) pairs of one position, most
  likely first (what the engine returns for `SamplingParams.logprobs`);
- *identical*: a configuration's greedy answer has the reference's token ids;
- *teacher-forced*: the configuration's distribution at position t of the reference, given the
  prompt and the reference's first t tokens. Its greedy run gives these for free up to and
  including the first position where it leaves the reference (its own tokens before it are the
  reference's); each later position costs a one-token request on prompt + reference[:t]
  (`forced_positions`);
- *top-1 agreement*: the share of the reference's positions where both distributions put the
  same token first; *KL*: KL(reference || configuration) at a position, `top_k_kl`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragspeed.ab.stats import paired_bootstrap_difference
from ragspeed.document import Document
from ragspeed.engine.protocol import MAX_LOGPROBS, DocumentCacheOptions, GenerationRequest, SamplingParams
from ragspeed.gateway.prompt import Segments, assemble_prompt

Distribution = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
_FLOOR = 1e-12  # the least probability a bucket is given (a log of 0 is not a number)
_request_ids = itertools.count()


def top_k_kl(reference: Distribution, other: Distribution) -> float:
    """KL(reference || other) in nats over the reference's top-k tokens plus one bucket for the
    rest of the vocabulary. A token of the reference's top k that `other`'s top k lacks gets
    `other`'s k-th probability (an upper bound of its own); merging the tail into one bucket
    can only lower a KL, so this reads low where the distributions differ in their tails."""
    if not reference:
        raise ValueError("a distribution needs at least one token")
    q_of = {token: math.exp(lp) for token, lp in other}
    q_least = math.exp(other[-1][1]) if other else _FLOOR
    kl, p_top, q_top = 0.0, 0.0, 0.0
    for token, logprob in reference:
        p = math.exp(logprob)
        q = q_of.get(token, q_least)
        kl += p * (logprob - math.log(max(q, _FLOOR)))
        p_top, q_top = p_top + p, q_top + q
    p_rest, q_rest = max(1.0 - p_top, 0.0), max(1.0 - q_top, _FLOOR)
    if p_rest > _FLOOR:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def first_divergence(reference: Sequence[int], token_ids: Sequence[int]) -> int:
    """The first position where `token_ids` leaves `reference` (its length when it never does
    within both)."""
    for t, (a, b) in enumerate(zip(reference, token_ids)):
        if a != b:
            return t
    return min(len(reference), len(token_ids))


def forced_positions(reference: Sequence[int], token_ids: Sequence[int]) -> range:
    """The reference positions whose teacher-forced distribution a greedy run of `token_ids`
    did not give: those after its first divergence."""
    return range(first_divergence(reference, token_ids) + 1, len(reference))


@dataclass(frozen=True)
class Generated:
    """One greedy generation: its tokens, each one's distribution, and its time to first token."""

    token_ids: tuple[int, ...]
    distributions: tuple[Distribution, ...]
    ttft_s: float
    recomputed_tokens: int | None = None  # the document cache's fresh tokens


@dataclass(frozen=True)
class QuestionFidelity:
    """One configuration on one question, against the reference."""

    identical: bool
    top1: tuple[bool, ...]  # per reference position
    kl: tuple[float, ...]  # per reference position


def compare(
    reference: Generated,
    greedy: Generated,
    forced: dict[int, Distribution],
    reference_forced: dict[int, Distribution] | None = None,
) -> QuestionFidelity:
    """`greedy`: the configuration's own run; `forced`: its distributions at `forced_positions`;
    `reference_forced`: full prefill's at those positions computed as the forced steps are
    (`policy_fidelity`), else its greedy run's."""
    divergence = first_divergence(reference.token_ids, greedy.token_ids)
    top1, kl = [], []
    for t, ref in enumerate(reference.distributions):
        if t <= divergence and t < len(greedy.distributions):
            dist = greedy.distributions[t]
        else:
            dist, ref = forced[t], (reference_forced or {}).get(t, ref)
        top1.append(ref[0][0] == dist[0][0])
        kl.append(top_k_kl(ref, dist))
    return QuestionFidelity(greedy.token_ids == reference.token_ids, tuple(top1), tuple(kl))


def binomial_ci(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval of a share (exact enough at 30 questions, never outside [0, 1])."""
    if n == 0:
        return (0.0, 1.0)
    share = successes / n
    center = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(center - half, 0.0), min(center + half, 1.0))


def summarize_fidelity(
    questions: Sequence[QuestionFidelity],
    accuracy: Sequence[float] | None = None,
    reference_accuracy: Sequence[float] | None = None,
    *,
    num_resamples: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Identical share (with its Wilson CI), teacher-forced top-1 agreement and mean KL over
    every reference position, and the paired accuracy change (bootstrap CI) when given."""
    n = len(questions)
    identical = sum(q.identical for q in questions)
    top1 = [a for q in questions for a in q.top1]
    kl = [v for q in questions for v in q.kl]
    low, high = binomial_ci(identical, n)
    figures: dict[str, Any] = {
        "num_questions": n,
        "identical": identical / n if n else None,
        "identical_ci": [low, high],
        "num_positions": len(top1),
        "top1_agreement": sum(top1) / len(top1) if top1 else None,
        "kl_mean": sum(kl) / len(kl) if kl else None,
    }
    if accuracy is not None and reference_accuracy is not None and accuracy:
        estimate = paired_bootstrap_difference(
            list(reference_accuracy), list(accuracy), num_resamples=num_resamples, seed=seed
        )
        figures["accuracy"] = sum(accuracy) / len(accuracy)
        figures["accuracy_minus_full"] = estimate.as_dict()
    return figures


# ------------------------------------------------------------- on a native engine (LLMEngine)


def generate(engine: Any, request: GenerationRequest) -> Generated:
    """Run one request alone to its end on an `LLMEngine` (on its own thread: nothing else in
    flight): tokens, distributions, seconds to the first token."""
    start = time.perf_counter()
    engine.add_request(request)
    token_ids: list[int] = []
    distributions: list[Distribution] = []
    ttft, recomputed = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request.request_id:
                continue
            if out.delta.documents is not None:
                recomputed = out.delta.documents.num_recomputed_tokens
            if out.delta.token_ids and ttft is None:
                ttft = time.perf_counter() - start
            token_ids.extend(out.delta.token_ids)
            distributions.extend(lp.top for lp in out.delta.logprobs or ())
    assert ttft is not None, "a request that samples gives a first token"
    return Generated(tuple(token_ids), tuple(distributions), ttft, recomputed)


class QuestionPrompts:
    """One question's prompts, laid out as the gateway lays them out (gateway.prompt): `full`
    as a request without document reuse is tokenized (whole), `spanned` with its documents'
    spans, `reversed` the documents in the other order (to store them before `spanned`)."""

    def __init__(self, tokenizer: Any, system_prompt: str, question: str, documents: Sequence[Document]):
        documents = list(documents)
        segments = Segments(system_prompt, tuple(documents), (), question)
        reversed_segments = Segments(system_prompt, tuple(documents[::-1]), (), question)
        self.full = assemble_prompt(tokenizer, segments, documents)
        self.spanned = assemble_prompt(tokenizer, segments, documents, document_spans=True)
        self.reversed = assemble_prompt(tokenizer, reversed_segments, documents[::-1], document_spans=True)

    @staticmethod
    def request(
        prompt: Any,
        options: DocumentCacheOptions | None,
        salt: str,
        max_tokens: int,
        answer: Sequence[int] = (),
    ) -> GenerationRequest:
        """Greedy, each token with its top-20 distribution; `answer` appended to the prompt
        (teacher forcing); `options` None: full prefill."""
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=MAX_LOGPROBS)
        return GenerationRequest(
            f"fidelity-{next(_request_ids)}",
            tuple(prompt.token_ids) + tuple(answer),
            sampling,
            cache_salt=salt,
            document_spans=prompt.document_spans if options is not None else (),
            document_cache=options,
        )


def policy_fidelity(
    engine: Any,
    prompts: QuestionPrompts,
    reference: Generated,
    options: DocumentCacheOptions,
    salt: str,
    max_tokens: int,
    reference_forced: dict[int, Distribution],
    reference_salt: str,
) -> tuple[QuestionFidelity, Generated]:
    """One policy on one question against `reference`: its greedy run on the spanned prompt,
    then a one-token request per forced position, and full prefill's same step where not yet in
    `reference_forced` (filled here, shared by a question's policies). A forced step computes
    its new tokens as a prefill chunk, while the reference's distributions after its first
    token came from decode steps, which may run other kernels (a GGUF model decodes on its
    quantized blocks and prefills on dense weights): both sides of a forced position are
    computed alike."""
    greedy = generate(engine, prompts.request(prompts.spanned, options, salt, max_tokens))
    forced: dict[int, Distribution] = {}
    for t in forced_positions(reference.token_ids, greedy.token_ids):
        answer = reference.token_ids[:t]
        forced[t] = generate(
            engine, prompts.request(prompts.spanned, options, salt, 1, answer)
        ).distributions[0]
        if t not in reference_forced:
            step = generate(engine, prompts.request(prompts.full, None, reference_salt, 1, answer))
            reference_forced[t] = step.distributions[0]
    return compare(reference, greedy, forced, reference_forced), greedy
