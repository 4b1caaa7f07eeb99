"""Build a step's flat batch from the scheduler's chunks, run the model, return logits.

The flat batch: decode tokens first (one per request), then each prefill chunk's tokens. For
every token: its id, its position and its slot (where its K/V goes). Only the chunks that
reach their request's last token get logits (`[num_sampling_rows, vocab]`, in chunk order): one
row each, or 1 + k rows for a decode carrying k draft tokens (its last token and every draft).
The batch and its attention metadata are written into tensors kept across steps
(engine.native.compute.step_buffers), so a decode step makes no tensor of its own.

Threads (CPU): the forward pass runs on `num_threads` torch threads (EngineConfig.num_threads,
by default torch's count when the engine was built), set around each step and restored after;
a step of at most SMALL_STEP_TOKENS tokens runs its small ops on one thread and only its linear
products on `num_threads` (engine.native.compute.threads says why, and holds the policy). A step of decodes
alone runs on `num_threads` or one fewer, whichever its timings show faster for its batch size
(engine.native.compute.threads.DecodeThreads: in a server, every token also wakes the event loop). On a CPU shared with other jobs, one
thread in all is faster: each parallel op waits for a descheduled thread there, which can
make a step several times slower than on one thread.

Outside the scheduler's steps, the runner computes one chunk for whoever needs rows of a
request through some layers (`run_chunk`: the document cache's blend, engine.native.core.document_kv) or
every row's logits (`chunk_logits`: the quality gate's windows, engine.native.core.window_logits), runs a
draft model's greedy steps in one call of the CPU kernels (`greedy_steps`), and it writes and
reads a request's KV by slot (`place_kv`, `read_kv`: placed and captured documents).
Those go through the same batch building, metadata, threads and model as a step, so what a step
learns they get.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ragspeed.engine.native.compute.attention_metadata import (
    AttentionMetadata,
    build_metadata,
    slots,
    slots_at,
)
from ragspeed.engine.native.compute.cpu_kernels.decoder import FusedDecoder
from ragspeed.engine.native.compute.cpu_kernels.placement import place_kernel_applies, place_kv
from ragspeed.engine.native.compute.step_buffers import StepBuffers
from ragspeed.engine.native.compute.threads import DecodeThreads, forward_pass
from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.core.scheduler_output import ScheduledChunk, SchedulerOutput
from ragspeed.engine.native.models.decoder import DecoderLM
from ragspeed.engine.native.models.rotary import RotaryEmbedding


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        rotary: RotaryEmbedding,
        kv_pool: KVCachePool,
        device: torch.device | str,
        num_threads: int | None = None,
    ):
        self.model = model
        self.num_threads = num_threads or torch.get_num_threads()
        self.rotary = rotary
        self.kv_pool = kv_pool
        self.block_size = kv_pool.block_size
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        self.buffers = StepBuffers(rotary.freqs_cis, self.block_size)
        self.decode_threads = DecodeThreads()
        # Prefill chunks' attention in the CPU kernel (engine.native.compute.attention); False: SDPA's, its
        # reference (`ragspeed bench prefill` times both).
        self.prefill_kernel = True
        # Its products on int16 (AttentionMetadata.int16_attention): the precision stage sets it
        # where the model passes the quality gate with them (engine.native.core.precision).
        self.int16_attention = False

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A buffer's view (CPU) where the model runs."""
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def execute(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; logits of the sampling chunks, or None when none samples. The logits
        may be a buffer the next step overwrites."""
        if not output.prefills and self._on_cpu:
            fused = self.model._fused_decoder()
            if fused is not None and fused.head is not None and fused.embeds:
                decodes = output.decodes
                if all(not c.request.prefill_only for c in decodes):
                    return self._fused_decodes(fused, decodes)
        return self._execute(output)

    def _fused_decodes(self, fused: FusedDecoder, decodes: tuple[ScheduledChunk, ...]) -> torch.Tensor:
        """A step of decodes alone, every one sampling, in one call of the fused decoder: the
        logits [num_decodes, vocab]. No torch op runs, so neither torch's threads nor autograd's
        mode are touched; the kernels get the engine's threads."""
        bs = self.block_size
        starts = [c.start for c in decodes]
        tables = [c.block_table for c in decodes]
        self.buffers.tokens(
            [c.request.all_token_ids[c.start] for c in decodes],
            [table[p // bs] * bs + p % bs for table, p in zip(tables, starts)],
            [(p, 1) for p in starts],
        )
        self.buffers.kernel_rows(tables, [p + 1 for p in starts])
        caches = self.kv_pool.k_caches, self.kv_pool.v_caches
        batch = len(decodes)
        threads = self.decode_threads.pick(batch, self.num_threads)
        start = time.perf_counter()
        logits = fused.decode_logits(self.buffers, batch, bs, *caches, threads)
        self.decode_threads.observe(batch, threads, time.perf_counter() - start)
        return logits

    @torch.inference_mode()
    def _execute(self, output: SchedulerOutput) -> torch.Tensor | None:
        """`execute`, layer by layer or in the fused decoder's call as the model decides."""
        ids, freqs_cis, meta, sample_index = self._inputs(output)
        chunk_sizes = [c.num_tokens for c in output.chunks]
        caches = self.kv_pool.k_caches, self.kv_pool.v_caches
        with forward_pass(chunk_sizes, self.num_threads, self.device):
            if not sample_index:
                self.model(ids, freqs_cis, *caches, meta)
                return None
            rows = None
            if len(sample_index) < len(ids):
                rows = torch.tensor(sample_index, device=self.device)
            return self.model.sample_logits(ids, freqs_cis, *caches, meta, rows)

    @torch.inference_mode()
    def run_chunk(
        self,
        chunk: ScheduledChunk,
        *,
        layers: tuple[int, int] | None = None,
        stream: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk's rows (its request's tokens at its positions) through `layers` (first,
        end; default all), from the tokens' embeddings or from the residual `stream` (hidden,
        residual) that the layers before `first` left: (hidden, residual) after the last layer
        run, whose sum is the residual stream there (`DecoderLM.run_layers`). Each layer run
        writes the rows' K/V at their slots."""
        ids, freqs_cis, meta, _ = self._inputs(SchedulerOutput((), (chunk,)))
        first, end = layers or (0, self.num_layers)
        k_caches, v_caches = self.kv_pool.k_caches[first:end], self.kv_pool.v_caches[first:end]
        with forward_pass([chunk.num_tokens], self.num_threads, self.device):
            hidden, residual = (self.model.embed(ids), None) if stream is None else stream
            return self.model.run_layers(hidden, residual, freqs_cis, k_caches, v_caches, meta, first)

    @torch.inference_mode()
    def chunk_logits(self, chunk: ScheduledChunk, *, decode_kernels: bool | None = None) -> torch.Tensor:
        """fp32 logits of every row of one chunk, [num_tokens, num_logits]: the forward (its
        K/V written) and the LM head over all of them. `decode_kernels`: every product on the
        blocked decode kernels (True), on the prefill's (False), or as a step of this size
        would run it (None; engine.native.compute.threads.forward_pass)."""
        ids, freqs_cis, meta, _ = self._inputs(SchedulerOutput((), (chunk,)))
        caches = self.kv_pool.k_caches, self.kv_pool.v_caches
        with forward_pass([chunk.num_tokens], self.num_threads, self.device, decode_kernels):
            return self.model.compute_logits(self.model(ids, freqs_cis, *caches, meta))

    @property
    def runs_greedy_steps(self) -> bool:
        """Whether `greedy_steps` runs this model: ragspeed's CPU kernels hold all of it, its
        embedding and LM head too (engine.native.compute.cpu_kernels.decoder)."""
        fused = self.model._fused_decoder()
        return fused is not None and fused.greedy

    def greedy_steps(
        self,
        fed: list[list[int]],
        positions: list[int],
        block_tables: torch.Tensor,  # [num_sequences, max_blocks] int64
        num_steps: list[int],
        *,
        vocab_size: int,
        d2t: torch.Tensor | None,
        min_confidence: float,
    ) -> list[list[int]]:
        """Greedy tokens of each sequence, in one call of ragspeed's CPU kernels: it is fed its
        `fed` tokens from `positions` on (their K/V written), then proposes up to `num_steps`
        tokens, each fed back but the last, stopping early under `min_confidence` (a draft
        model's proposal: engine.native.core.spec_decode.draft). The argmax runs over the first
        `vocab_size` logits, a row mapped to a token id through `d2t` where given."""
        fused = self.model._fused_decoder()
        assert fused is not None and fused.greedy, "runs_greedy_steps says when this runs"
        return fused.greedy_steps(
            self.rotary.freqs_cis,
            vocab_size,
            d2t,
            self.kv_pool.k_caches,
            self.kv_pool.v_caches,
            block_tables,
            self.block_size,
            fed,
            positions,
            num_steps,
            min_confidence,
            self.num_threads,
        )

    def place_kv(self, kv: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        """Write K/V of `n` tokens ([2, num_layers, n, num_kv_heads, head_dim], any float dtype)
        at `slots` ([n] int64), the keys rotated `delta` positions further
        (RotaryEmbedding.shift_keys: exact): a stored document placed at a new position."""
        pool = self.kv_pool
        if place_kernel_applies(kv, pool.by_slot):
            place_kv(kv, self.rotary.shift_rotation(delta), slots, pool.by_slot, self.num_threads)
            return
        kv, slots = kv.to(pool.kv.device), slots.to(pool.kv.device)
        keys = self.rotary.shift_keys(kv[0], delta)  # [num_layers, n, num_kv_heads, head_dim] fp32
        pool.write(torch.stack((keys.to(pool.kv.dtype), kv[1].to(pool.kv.dtype))), slots)

    def read_kv(self, slots: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """K/V at `slots` ([n] int64) in the pool's dtype: [2, num_layers, n, num_kv_heads,
        head_dim]; or, for one `layer`, its keys [n, num_kv_heads, head_dim]."""
        return self.kv_pool.read(slots, layer)

    @property
    def num_layers(self) -> int:
        return len(self.kv_pool.k_caches)

    def _inputs(
        self, output: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """A step's flat batch in the step buffers, where the model runs: token ids [n],
        rotations [n, 1, head_dim/2], the attention metadata, and the rows that sample."""
        bs = self.block_size
        input_ids: list[int] = []
        position_spans: list[tuple[int, int]] = []  # (first position, count), in batch order
        slot_mapping: list[int] = []
        sample_index: list[int] = []
        for chunk in output.chunks:
            start, end = chunk.start, chunk.context_len
            table = chunk.block_table
            drafts = chunk.draft_token_ids
            if chunk.positions:  # scattered: an assembled request's fresh tokens
                token_ids = chunk.request.all_token_ids
                input_ids.extend(token_ids[p] for p in chunk.positions)
                position_spans.extend((p, 1) for p in chunk.positions)
                slot_mapping.extend(slots_at(table, chunk.positions, bs))
            else:
                input_ids.extend(chunk.request.all_token_ids[start : end - len(drafts)])
                input_ids.extend(drafts)
                position_spans.append((start, end - start))
                slot_mapping.extend(slots(table, start, end, bs))
            if chunk.samples:
                last = len(input_ids) - 1
                sample_index.extend(range(last - len(drafts), last + 1))
        ids, freqs_cis, slots_t = self.buffers.tokens(input_ids, slot_mapping, position_spans)
        meta = self._metadata(output, self._on_device(slots_t))
        return self._on_device(ids), self._on_device(freqs_cis), meta, sample_index

    def _metadata(self, output: SchedulerOutput, slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The step's AttentionMetadata (engine.native.compute.attention_metadata.build_metadata), its tensors views of
        the step buffers."""
        decodes, prefills = output.decodes, output.prefills
        return build_metadata(
            decode_tables=[c.block_table for c in decodes],
            decode_context_lens=[c.context_len for c in decodes],
            prefill_tables=[list(c.block_table) for c in prefills],
            prefill_context_lens=[c.context_len for c in prefills],
            prefill_num_queries=[c.num_tokens for c in prefills],
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            device=self.device,
            dtype=self.model.dtype,
            num_threads=self.num_threads,
            prefill_query_positions=[c.positions or None for c in prefills],
            kernel_rows=self._kernel_rows,
            prefill_kernel=self.prefill_kernel,
            prefill_num_drafts=[len(c.draft_token_ids) for c in prefills],
            int16_attention=self.int16_attention,
        )

    def _kernel_rows(
        self, tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention_metadata.KernelRows in the step buffers, where the model runs."""
        tables_t, lens_t = self.buffers.kernel_rows(tables, context_lens)
        return self._on_device(tables_t), self._on_device(lens_t)
