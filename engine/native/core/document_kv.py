"""Documents prefilled once: stored KV placed at any position of a later prompt.

docs/architecture.md, contract 8. Terms:

- *prefix*: a request's prompt tokens before its first document span (the static system prompt
  and the documents' header). A document's KV is computed after it, so the *start position*
  of the document's first token is len(prefix).
- *document KV*: the K and V of a document's tokens at every layer, `[2, num_layers,
  num_tokens, num_kv_heads, head_dim]`, keys rotated at their start position, kept in a
  `DocumentStore` (prompt_cache.document_store) under (model fingerprint, tenant salt, prefix,
  token ids).
- *placing* a document at position s: its keys rotated by s - start position
  (`RotaryEmbedding.shift_keys`, exact), its values copied as they are, into the request's slots.
- *glue*: the tokens between two documents (their separator and number). With the option's
  `glue="reuse"` each piece of glue is stored and placed as a document is (it recurs in every
  request: "[2]" after the prefix is always the same); else it is fresh.
- *fresh tokens*: what is computed in context once the documents are placed: the tokens
  outside every placed span (glue, history, question) but the last, and the *repair*. They
  and the last prompt token are the request's first chunk in the scheduler's step, one
  *scattered* chunk (engine.native.compute.attention: each query sees the keys up to its own position),
  batched with the step's other requests and sampled after its last token.
- *repair policies*: `reuse` repairs nothing; `sink` recomputes each document's first k tokens,
  the ones that, computed alone, served as its attention sink (EPIC); `blend` recomputes the
  document tokens whose keys deviate most from their in-context keys at layer 1, a ratio r of
  them, through the later layers (CacheBlend: layers 0-1 are recomputed for every token to
  measure the deviation).

A document the store does not have is computed on first sight by a *document prefill*: a
prefill-only sub-request of prefix + document, queued ahead of the request, whose KV is captured
before its blocks are freed. Concurrent requests wait on the same document prefill. A request is
admitted only when none of its documents is in flight (`Request.blockers`).

The store (`open_document_store`) is sized for a corpus by default: its RAM tier a quarter of
available memory (at most 4 GiB), its disk tier in the model cache folder (8 GiB, at most half
the folder's free space), every file under the server key's HMAC and checked against the
model's KV layout (prompt_cache.document_store).

Placed KV is not a full prefill's: an assembled request's blocks from the first one it computes
on enter the prefix cache under a variant of its options (`Request.cache_variant`, set at
admission), found only by requests assembled with the same options (a repeat, a chat's next
turn) and never by a plain prefill.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.attention_metadata import slots as slot_ids
from ragspeed.engine.native.core.document_plan import DocumentPlan
from ragspeed.engine.native.core.kv_cache import available_memory_bytes
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.request import Request
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk
from ragspeed.engine.protocol import DocumentCacheOptions, GenerationRequest
from ragspeed.prompt_cache.document_store import (
    DocumentKV,
    DocumentStore,
    KVLayout,
    disk_budget,
    document_key,
)

logger = logging.getLogger(__name__)

STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# The layer whose key deviation ranks tokens for `blend` (CacheBlend's choice: layer 1).
BLEND_LAYER = 1
# The RAM tier by default: this share of available memory, at most RAM_CAP_BYTES.
RAM_SHARE = 0.25
RAM_CAP_BYTES = 4 * 2**30
# The disk tier takes at most this share of its folder's free space (at start-up).
DISK_FREE_SHARE = 0.5
DOCUMENTS_FOLDER = "documents"  # in the model cache folder, for document_cache_dir "auto"

_sub_ids = itertools.count()


@dataclass
class _InFlight:
    """A document prefill and the requests waiting on it."""

    request_id: str
    is_document: bool  # not glue
    waiters: list[tuple[Request, int]] = field(default_factory=list)  # (request, span index)


def placed_spans(
    spans: tuple[tuple[int, int], ...], glue: str
) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]]:
    """The spans placed from the store, in order, and which of them are documents: the
    documents' spans, and with `glue="reuse"` the glue between each two of them."""
    between = [(end, start) for (_, end), (start, _) in zip(spans, spans[1:]) if start > end]
    placed = tuple(sorted([*spans, *between])) if glue == "reuse" else tuple(spans)
    documents = set(spans)
    return placed, tuple(span in documents for span in placed)


def document_fingerprint(engine_fingerprint: dict[str, Any], storage_dtype: str) -> str:
    """What must be equal for document KV to be valid: the model, tokenizer, weights' kind and
    KV layout per token (not the block size: documents are stored by token)."""
    fields = {k: v for k, v in engine_fingerprint.items() if k != "kv_shape"}
    shape = engine_fingerprint.get("kv_shape") or []
    fields["kv_token_shape"] = [shape[1], shape[3], shape[4]] if len(shape) == 5 else shape
    fields["storage_dtype"] = storage_dtype
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def ram_budget(requested: int | None) -> int:
    """`requested` bytes, or by default RAM_SHARE of available memory, at most RAM_CAP_BYTES."""
    if requested is not None:
        return requested
    try:
        available = available_memory_bytes("cpu")
    except RuntimeError:  # no /proc/meminfo
        return 256 * 2**20
    return min(int(available * RAM_SHARE), RAM_CAP_BYTES)


def document_folder(setting: str | None) -> Path | None:
    """The disk tier's folder: "auto" is `<model cache>/documents`; None is RAM only."""
    if setting is None:
        return None
    if setting == "auto":
        from ragspeed.engine.native.loading.model_zoo import default_cache_dir

        return default_cache_dir() / DOCUMENTS_FOLDER
    return Path(setting).expanduser()


def open_document_store(config: EngineConfig, fingerprint: str, kv_pool_shape: Any) -> DocumentStore:
    """The engine's document store, by `config`'s document_cache_* options, for KV of the pool's
    layout (`[2, L, num_blocks, block_size, H, D]`) in the storage dtype."""
    layout = KVLayout(
        num_layers=int(kv_pool_shape[1]),
        num_kv_heads=int(kv_pool_shape[4]),
        head_dim=int(kv_pool_shape[5]),
        dtype=config.document_cache_dtype,
    )
    capacity = ram_budget(config.document_cache_bytes)
    directory = document_folder(config.document_cache_dir)
    disk_capacity = None
    disk_line = ""
    if directory is not None:
        disk_capacity = disk_budget(directory, config.document_cache_disk_bytes, DISK_FREE_SHARE)
        disk_line = f", disk {directory} {disk_capacity / 2**20:.0f} MiB (asked {config.document_cache_disk_bytes / 2**20:.0f})"
    store = DocumentStore(
        capacity_bytes=capacity,
        directory=directory,
        fingerprint=fingerprint,
        disk_capacity_bytes=disk_capacity,
        layout=layout,
    )
    logger.info("document store: RAM %.0f MiB%s", capacity / 2**20, disk_line)
    return store


class DocumentKVCache:
    """The engine's half of document KV reuse: plans, document prefills, assembly. Everything
    runs on the engine thread; `stats` may be read from any."""

    def __init__(
        self,
        store: DocumentStore,
        *,
        fingerprint: str,
        runner: ModelRunner,
        make_prefill: Callable[[str, list[int], str | None], Request],
        storage_dtype: str = "float16",
    ):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"document cache dtype must be one of {', '.join(STORAGE_DTYPES)}")
        self.store = store
        self.fingerprint = fingerprint
        self.runner = runner
        self.make_prefill = make_prefill  # (request id, prompt token ids, salt) -> prefill-only Request
        self.storage_dtype = storage_dtype
        self._in_flight: dict[str, _InFlight] = {}
        # Document prefills no request waits for any more (theirs was aborted): the engine
        # aborts them before its next step.
        self.orphans: list[str] = []
        self.num_assembled = 0
        self.num_documents_placed = 0
        self.num_documents_computed = 0
        self.num_recomputed_tokens = 0
        self.assemble_seconds = 0.0

    # ------------------------------------------------------------------ planning

    def plan(
        self, request: Request, options: DocumentCacheOptions, spans: tuple[tuple[int, int], ...]
    ) -> list[Request]:
        """Attach a plan to `request`; returns the document prefills to queue before it
        (prefill-only requests built by `make_prefill`)."""
        tokens = request.prompt_token_ids
        prefix = tokens[: spans[0][0]]
        placed, is_document = placed_spans(spans, options.glue)
        keys = tuple(
            document_key(self.fingerprint, request.cache_salt, prefix, tokens[s:e]) for s, e in placed
        )
        plan = DocumentPlan(
            options,
            placed,
            is_document,
            keys,
            [None] * len(placed),
            [len(prefix)] * len(placed),
            self.storage_dtype,
        )
        request.document_plan = plan
        prefills: list[Request] = []
        for index, ((start, end), key) in enumerate(zip(placed, keys)):
            counted = plan.is_document[index]
            found = self.store.find(key, tokens[start:end])
            if found is not None:
                entry = found.entry
                plan.kv[index] = _tensor(entry)
                plan.start_positions[index] = entry.start_position
                plan.num_hit += counted
                if found.tier == "ram":
                    plan.num_hit_ram += counted
                    plan.bytes_ram += entry.num_bytes
                else:
                    plan.num_hit_disk += counted
                    plan.bytes_disk += entry.num_bytes
                continue
            in_flight = self._in_flight.get(key)
            if in_flight is None:
                in_flight = _InFlight(f"{request.request_id}#doc{next(_sub_ids)}", counted)
                self._in_flight[key] = in_flight
                sub = self.make_prefill(in_flight.request_id, prefix + tokens[start:end], request.cache_salt)
                sub.document_key, sub.document_start = key, len(prefix)
                prefills.append(sub)
                plan.num_computed += counted
            else:
                plan.num_hit += counted  # computed once, for another request in flight
                plan.num_hit_in_flight += counted
            in_flight.waiters.append((request, index))
            request.blockers.add(key)
        # Documents prefilled side by side would each compute the prefix: the first prefill
        # computes it into the prefix cache, and the others wait for it.
        if len(prefills) > 1:
            first = prefills[0].document_key
            assert first is not None  # set above
            for sub in prefills[1:]:
                sub.blockers.add(first)
                self._in_flight[first].waiters.append((sub, -1))
        return prefills

    def num_stored_tokens(self, request: GenerationRequest, after: int = 0) -> int:
        """Tokens of `request`'s placed spans from `after` on whose KV is stored or being
        computed: an estimate another thread may ask for (nothing is touched or counted)."""
        spans = request.document_spans
        if request.document_cache is None or not spans:
            return 0
        tokens = request.prompt_token_ids
        prefix = tokens[: spans[0][0]]
        placed, _ = placed_spans(spans, request.document_cache.glue)
        stored = 0
        for start, end in placed:
            if start < after:
                continue
            key = document_key(self.fingerprint, request.cache_salt, prefix, tokens[start:end])
            if key in self.store or key in self._in_flight:
                stored += end - start
        return stored

    def capture(self, sub: Request, block_table: list[int]) -> None:
        """A document prefill computed its last token: store its KV, hand it to its waiters."""
        key, start = sub.document_key, sub.document_start
        assert key is not None
        token_ids = tuple(sub.prompt_token_ids[start:])
        slots = _slots(block_table, start, len(sub.prompt_token_ids), self.runner.block_size)
        kv = self.runner.read_kv(slots)
        kv = kv.to(STORAGE_DTYPES[self.storage_dtype]).cpu().contiguous()  # [2, L, n, H, D]
        entry = DocumentKV(
            key=key,
            token_ids=token_ids,
            start_position=start,
            dtype=self.storage_dtype,
            shape=tuple(kv.shape),
            data=kv.view(-1).view(torch.uint8).numpy().data,  # a memoryview of the array
        )
        self.store.put(entry)
        in_flight = self._in_flight.get(key)
        self.num_documents_computed += in_flight is not None and in_flight.is_document
        self._resolve(key, kv, start)

    def release(self, request: Request) -> None:
        """A request left the engine (finished, aborted) or was preempted. A document prefill
        that ends without its KV leaves its waiters to compute that document in context; a
        request that leaves while its documents are in flight makes orphans of the document
        prefills no other request waits for."""
        if not request.is_finished:
            return
        key = request.document_key
        if key is not None:
            if self._in_flight.get(key) is not None and self._in_flight[key].request_id == request.request_id:
                logger.info("document prefill %s ended without KV: computed in context", request.request_id)
                self._resolve(key, None, 0)
            return
        for key in request.blockers:
            in_flight = self._in_flight.get(key)
            if in_flight is None:
                continue
            in_flight.waiters = [(w, i) for w, i in in_flight.waiters if w is not request]
            if not any(i >= 0 for _, i in in_flight.waiters):  # only other prefills wait on it
                self.orphans.append(in_flight.request_id)

    def _resolve(self, key: str, kv: torch.Tensor | None, start_position: int) -> None:
        in_flight = self._in_flight.pop(key, None)
        if in_flight is None:
            return
        for waiter, index in in_flight.waiters:
            waiter.blockers.discard(key)
            plan = waiter.document_plan
            if index >= 0 and plan is not None:
                plan.kv[index] = kv
                plan.start_positions[index] = start_position

    # ------------------------------------------------------------------ assembly

    @torch.inference_mode()
    def assemble(self, request: Request, block_table: list[int]) -> list[int]:
        """Place the documents from `request.num_computed_tokens` (its prefix-cache hit) on;
        returns the positions left to compute, in the scheduler's step: the fresh tokens and
        the last prompt token (after which the step samples). blend computes its fresh tokens
        here (its two passes), and leaves only the last."""
        plan = request.document_plan
        assert plan is not None and not request.blockers
        t0 = time.perf_counter()
        first = request.num_computed_tokens
        last = request.num_prompt_tokens - 1
        placed = self._place(plan, block_table, first, last)
        if plan.options.policy == "blend":
            recomputed = self._blend(request, block_table, first, last, placed)
            fresh = []
        else:
            fresh = [p for p in range(first, last) if not placed[p]]
            fresh = sorted(set(fresh) | set(self._sink(plan, first, last, placed)))
            recomputed = len(fresh)
        plan.num_recomputed_tokens = recomputed
        self.num_assembled += 1
        self.num_recomputed_tokens += recomputed
        self.assemble_seconds += time.perf_counter() - t0
        return [*fresh, last]

    def _place(self, plan: DocumentPlan, block_table: list[int], first: int, last: int) -> list[bool]:
        """Copy each known document's KV into its span (from `first`, before `last`), its keys
        rotated to their new place; which positions [0, last) now hold placed KV."""
        placed = [False] * last
        for (start, end), kv, stored_start, is_document in zip(
            plan.spans, plan.kv, plan.start_positions, plan.is_document
        ):
            begin, stop = max(start, first), min(end, last)
            if kv is None or begin >= stop:
                continue
            kv = kv[:, :, begin - start : stop - start]  # [2, L, n, H, D]
            slots = _slots(block_table, begin, stop, self.runner.block_size)
            self.runner.place_kv(kv, slots, start - stored_start)
            placed[begin:stop] = [True] * (stop - begin)
            self.num_documents_placed += is_document
        return placed

    @staticmethod
    def _sink(plan: DocumentPlan, first: int, last: int, placed: list[bool]) -> list[int]:
        """sink's repair: each placed document's first `num_tokens` positions (not glue's)."""
        k = plan.options.num_tokens if plan.options.policy == "sink" else 0
        return [
            p
            for (start, end), is_document in zip(plan.spans, plan.is_document)
            if is_document
            for p in range(max(start, first), min(start + k, end, last))
            if placed[p]
        ]

    def _blend(
        self, request: Request, block_table: list[int], first: int, last: int, placed: list[bool]
    ) -> int:
        """blend's repair: every position through layers 0 .. BLEND_LAYER; then the fresh tokens
        and the placed ones whose layer-BLEND_LAYER keys moved most (a ratio of them) through
        the rest. Returns the tokens computed through every layer."""
        if first >= last:  # the prefix-cache hit reaches the last token: nothing to repair
            return 0
        positions = list(range(first, last))
        runner, num_layers = self.runner, self.runner.num_layers
        split = min(BLEND_LAYER + 1, num_layers)
        slots = _slots(block_table, first, last, runner.block_size)
        reused_keys = runner.read_kv(slots, BLEND_LAYER).float()  # [n, H, D]
        table = tuple(block_table)
        hidden, residual = runner.run_chunk(_scattered(request, positions, table), layers=(0, split))
        deviation = (runner.read_kv(slots, BLEND_LAYER).float() - reused_keys).norm(dim=(1, 2))
        is_placed = torch.tensor([placed[p] for p in positions], dtype=torch.bool)
        num_placed = int(is_placed.sum())
        assert request.document_plan is not None
        num_pick = round(request.document_plan.options.ratio * num_placed)
        keep = ~is_placed  # fresh tokens always go on
        if num_pick:
            ranked = (
                deviation.masked_fill(~is_placed.to(deviation.device), float("-inf")).topk(num_pick).indices
            )
            keep[ranked.cpu()] = True
        rows = keep.nonzero().view(-1)
        if len(rows) and split < num_layers:
            runner.run_chunk(
                _scattered(request, [positions[i] for i in rows.tolist()], table),
                layers=(split, num_layers),
                stream=(hidden[rows.to(hidden.device)], residual[rows.to(hidden.device)]),
            )
        return len(rows)

    # ------------------------------------------------------------------ figures

    def stats(self) -> dict[str, float]:
        store = self.store.stats
        return {
            "document_cache_hits": float(store.hits),
            "document_cache_misses": float(store.misses),
            "document_cache_ram_hits": float(store.ram_hits),
            "document_cache_disk_hits": float(store.disk_hits),
            "document_cache_disk_lookups": float(store.disk_lookups),
            "document_cache_hit_rate": store.hit_rate,
            "document_cache_ram_hit_rate": store.ram_hit_rate,
            "document_cache_disk_hit_rate": store.disk_hit_rate,
            "document_cache_stored_bytes": float(store.stored_bytes),
            "document_cache_disk_bytes": float(store.disk_bytes),
            "document_cache_capacity_bytes": float(store.capacity_bytes),
            "document_cache_disk_capacity_bytes": float(store.disk_capacity_bytes),
            "document_cache_entries": float(store.num_entries),
            "document_cache_disk_entries": float(store.num_disk_entries),
            "document_cache_evictions": float(store.evictions),
            "document_cache_disk_evictions": float(store.disk_evictions),
            "document_cache_load_seconds": float(store.load_seconds_total),
            "document_cache_rejected_files": float(store.rejected_files),
            "document_cache_foreign_files": float(store.foreign_files),
            "document_cache_requests_assembled": float(self.num_assembled),
            "document_cache_documents_placed": float(self.num_documents_placed),
            "document_cache_documents_computed": float(self.num_documents_computed),
            "document_cache_recomputed_tokens": float(self.num_recomputed_tokens),
            "document_cache_assemble_seconds": float(self.assemble_seconds),
        }


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    return torch.tensor(slot_ids(block_table, start, end, block_size), dtype=torch.long)


def _scattered(request: Request, positions: list[int], block_table: tuple[int, ...]) -> ScheduledChunk:
    """`request`'s tokens at `positions` (ascending) as one scattered chunk: each sees the keys
    up to its own position, placed or computed."""
    return ScheduledChunk(request, positions[0], len(positions), block_table, positions=tuple(positions))


def _tensor(entry: DocumentKV) -> torch.Tensor:
    """A stored entry as a tensor over its payload (zero copy; a disk entry is read-only)."""
    with warnings.catch_warnings():  # torch warns of read-only buffers; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(entry.data, dtype=STORAGE_DTYPES[entry.dtype])
    return flat.view(entry.shape)
