"""Build a step's flat batch from the scheduler's chunks, run the model, return logits.

The flat batch: decode tokens first (one per request), then each prefill chunk's tokens. For
every token: its id, its position and its slot (where its K/V goes). Only the chunks that
reach their request's last token get logits (`[num_sampling_rows, vocab]`, in chunk order): one
row each, or 1 + k rows for a decode carrying k draft tokens (its last token and every draft).

Threads (CPU): the forward pass runs on `num_threads` torch threads (EngineConfig.num_threads,
by default torch's count when the engine was built), set around each step and restored after;
a step of at most SMALL_STEP_TOKENS tokens runs its small ops on one thread and only its linear
products on `num_threads` (engine.threads says why, and holds the policy). On a CPU shared with other jobs, one
thread in all is faster: each parallel op waits for a descheduled thread there, which can
make a step several times slower than on one thread.
"""

from __future__ import annotations

import torch

from ragspeed.engine.attention import build_metadata, slots, slots_at
from ragspeed.engine.kv_cache import KVCachePool
from ragspeed.engine.models.decoder import DecoderLM
from ragspeed.engine.models.rotary import RotaryEmbedding
from ragspeed.engine.scheduler import SchedulerOutput
from ragspeed.engine.threads import forward_pass


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

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; logits of the sampling chunks, or None when none samples."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_index: list[int] = []
        for chunk in output.chunks:
            start, end = chunk.start, chunk.context_len
            table = chunk.block_table
            drafts = chunk.draft_token_ids
            if chunk.positions:  # scattered: an assembled request's fresh tokens
                token_ids = chunk.request.all_token_ids
                input_ids.extend(token_ids[p] for p in chunk.positions)
                positions.extend(chunk.positions)
                slot_mapping.extend(slots_at(table, chunk.positions, bs))
            else:
                input_ids.extend(chunk.request.all_token_ids[start : end - len(drafts)])
                input_ids.extend(drafts)
                positions.extend(range(start, end))
                slot_mapping.extend(slots(table, start, end, bs))
            if chunk.samples:
                last = len(input_ids) - 1
                sample_index.extend(range(last - len(drafts), last + 1))
        meta = build_metadata(
            decode_tables=[list(c.block_table) for c in output.decodes],
            decode_context_lens=[c.context_len for c in output.decodes],
            prefill_tables=[list(c.block_table) for c in output.prefills],
            prefill_context_lens=[c.context_len for c in output.prefills],
            prefill_num_queries=[c.num_tokens for c in output.prefills],
            prefill_query_positions=[c.positions or None for c in output.prefills],
            slot_mapping=slot_mapping,
            block_size=bs,
            device=self.device,
            dtype=self.model.dtype,
            num_threads=self.num_threads,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        chunk_sizes = [c.num_tokens for c in output.chunks]
        caches = self.kv_pool.k_caches, self.kv_pool.v_caches
        with forward_pass(chunk_sizes, self.num_threads, self.device):
            if not sample_index:
                self.model(ids, self.rotary.lookup(pos), *caches, meta)
                return None
            rows = None
            if len(sample_index) < len(input_ids):
                rows = torch.tensor(sample_index, device=self.device)
            return self.model.sample_logits(ids, self.rotary.lookup(pos), *caches, meta, rows)
