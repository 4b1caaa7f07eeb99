"""Pinned prefixes of one `LLMEngine`: pin after a prefill, save to disk, restore at start-up.

The torch/safetensors half of `prompt_cache.store` (which owns the atomic, checksummed files and
never imports torch). A saved prefix holds:

- `kv`: the KV of its pinned blocks, `[2 (K, V), num_layers, num_blocks, block_size,
  num_kv_heads, head_dim]` (the pool's layout with only those blocks);
- the token ids (sidecar) and the registered text and cache salt (safetensors metadata);
- a fingerprint of the model (config, weight-file headers, sizes and edge bytes), the
  tokenizer (its serialized vocabulary and merges), the KV dtype and the block size: a prefix
  saved by any other model, tokenizer or layout is refused with a log line, never loaded.

Every function here touches the engine's block manager or KV pool, so it must run on the
engine's own thread (`NativeEngine.call`).

Restoring follows `KVCacheManager`'s recipe: `allocate_slots(tmp, n)`, copy the KV into those
blocks, `cache_blocks(tmp, token_ids, n)`, `pin(token_ids)`, `free(tmp)`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ragspeed.prompt_cache.store import (
    delete_prefix,
    list_saved_prefixes,
    load_prefix,
    prefix_path,
    save_prefix,
)

logger = logging.getLogger(__name__)

_EDGE_BYTES = 1 << 20  # bytes hashed at each end of every weight file
_restore_ids = itertools.count()


@dataclass(frozen=True)
class PinnedPrefix:
    """A prefix whose full blocks carry a pin reference in the engine's block manager."""

    name: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # as returned by KVCacheManager.pin (pass back to unpin)
    text: str = ""
    cache_salt: str | None = None


def _write_tensors(path: Path, tensors: dict[str, Any]) -> None:
    metadata = tensors.get("__metadata__") or {}
    save_file(
        {k: v.contiguous() for k, v in tensors.items() if k != "__metadata__"}, str(path), metadata=metadata
    )


def _read_tensors(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as file:
        out: dict[str, Any] = {key: file.get_tensor(key) for key in file.keys()}
        out["__metadata__"] = dict(file.metadata() or {})
    return out


def _file_fingerprint(path: Path) -> str:
    """sha256 of the size and the first and last MiB: catches a swapped or retrained weight file
    without reading gigabytes at every start-up (a change confined to the middle of a file of
    the same size goes unnoticed; config.json and the safetensors header are hashed whole)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as file:
        digest.update(file.read(_EDGE_BYTES))
        if size > _EDGE_BYTES:
            file.seek(max(size - _EDGE_BYTES, _EDGE_BYTES))
            digest.update(file.read(_EDGE_BYTES))
    return digest.hexdigest()


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256((content + "\0" + str(template)).encode()).hexdigest()


def engine_fingerprint(engine: Any) -> dict[str, Any]:
    """What must be equal for saved KV to be valid in this engine (see the module docstring)."""
    path = Path(engine.loaded.path)
    weights = sorted(path.glob("*.safetensors"))
    config = path / "config.json"
    model = hashlib.sha256()
    if config.is_file():
        model.update(config.read_bytes())
    for weight_file in weights:
        model.update(weight_file.name.encode())
        model.update(_file_fingerprint(weight_file).encode())
    kv = engine.kv_pool.kv
    return {
        "model": model.hexdigest(),
        "tokenizer": _tokenizer_fingerprint(engine.tokenizer),
        "kv_shape": [
            int(kv.shape[0]),
            int(kv.shape[1]),
            int(kv.shape[3]),
            int(kv.shape[4]),
            int(kv.shape[5]),
        ],
        "kv_dtype": str(kv.dtype),
        "quantization": engine.config.quantization,
    }


# ---------------------------------------------------------------------- engine-thread operations


def pin_prefix(engine: Any, token_ids: tuple[int, ...], cache_salt: str | None) -> tuple[int, ...]:
    """Pin the cached full blocks of `token_ids` (prefill it first, e.g. with `warm`)."""
    return tuple(engine.manager.pin(list(token_ids), cache_salt))


def unpin_prefix(engine: Any, block_ids: tuple[int, ...]) -> None:
    engine.manager.unpin(list(block_ids))


def restore_prefix(
    engine: Any, token_ids: tuple[int, ...], kv: torch.Tensor, cache_salt: str | None
) -> tuple[int, ...] | None:
    """Put saved KV (`[2, L, n, block_size, H, D]`) back into the pool as cached, pinned blocks
    of `token_ids`' first n full blocks. None when the pool has no room now."""
    manager, block_size = engine.manager, engine.manager.block_size
    num_blocks = int(kv.shape[2])
    num_tokens = num_blocks * block_size
    if num_blocks == 0 or num_tokens > len(token_ids):
        return ()
    request_id = f"restore-{next(_restore_ids)}"
    block_ids = manager.allocate_slots(request_id, num_tokens)
    if block_ids is None:
        return None
    try:
        # Blocks already cached from the same prefix keep theirs; the copy covers the rest.
        index = torch.tensor(manager.block_table(request_id), dtype=torch.long)
        pool = engine.kv_pool.kv  # [2, L, num_blocks_total, block_size, H, D]
        pool.index_copy_(2, index.to(pool.device), kv.to(pool.device, pool.dtype))
        manager.cache_blocks(request_id, list(token_ids), num_tokens, cache_salt)
        return tuple(manager.pin(list(token_ids[:num_tokens]), cache_salt))
    finally:
        manager.free(request_id)


def export_kv(engine: Any, block_ids: tuple[int, ...]) -> torch.Tensor:
    """The KV of `block_ids`, `[2, L, len(block_ids), block_size, H, D]`, copied out."""
    index = torch.tensor(block_ids, dtype=torch.long, device=engine.kv_pool.kv.device)
    return engine.kv_pool.kv.index_select(2, index).cpu()


# ---------------------------------------------------------------------- files


class PrefixStore:
    """Pinned prefixes of one engine in one folder (`prompt_cache_dir`)."""

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        self.directory = Path(directory)
        self.fingerprint = fingerprint

    def save(self, prefix: PinnedPrefix, kv: torch.Tensor) -> Path:
        metadata = {"text": prefix.text, "cache_salt": json.dumps(prefix.cache_salt)}
        return save_prefix(
            prefix_path(self.directory, prefix.name),
            name=prefix.name,
            token_ids=prefix.token_ids,
            fingerprint=self.fingerprint,
            tensors={"kv": kv, "__metadata__": metadata},
            write_tensors=_write_tensors,
        )

    def load_all(self) -> list[tuple[PinnedPrefix, torch.Tensor]]:
        """Every intact prefix of this model and tokenizer (others refused with a log line)."""
        out = []
        for path in list_saved_prefixes(self.directory):
            loaded = load_prefix(path, self.fingerprint, read_tensors=_read_tensors)
            if loaded is None:
                continue
            metadata = loaded.tensors.get("__metadata__", {})
            kv = loaded.tensors.get("kv")
            try:
                salt = json.loads(metadata.get("cache_salt", "null"))
            except ValueError:
                salt = None
            if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
                logger.warning("refusing saved prefix %s: no KV tensor of 6 dimensions", path)
                continue
            prefix = PinnedPrefix(
                name=loaded.name,
                token_ids=loaded.token_ids,
                block_ids=(),
                text=metadata.get("text", ""),
                cache_salt=salt,
            )
            out.append((prefix, kv))
        return out

    def delete(self, name: str) -> None:
        delete_prefix(prefix_path(self.directory, name))
