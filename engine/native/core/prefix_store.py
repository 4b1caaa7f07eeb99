"""Pinned prefixes of one `LLMEngine`: pin after a prefill, save to disk, restore at start-up.

The torch/safetensors half of `prompt_cache.store` (which owns the atomic, checksummed files and
the prompt records, and never imports torch). A saved prefix holds:

- `kv`: the KV of its pinned blocks, `[2 (K, V), num_layers, num_blocks, block_size,
  num_kv_heads, head_dim]` (the pool's layout with only those blocks);
- the token ids (sidecar) and the registered text and cache salt (safetensors metadata);
- a fingerprint of the model (config, and a full sha256 of every weight file), the tokenizer
  (its serialized vocabulary and merges), the prefill's precision (its path and the model's
  dtype: bf16 products give other KV than fp32 ones), the KV dtype and the block size: a prefix
  saved by any other model, tokenizer, precision or layout, or whose KV has another shape than
  the fingerprint says, is refused with a log line, never loaded (its prompt is prefilled again).

A weight file's sha256 is computed once per (path, size, mtime) and kept in
`<model cache>/weight-sha256.json` (`WeightHashes`), so a later start reads no weights to
fingerprint them (hashing SmolLM2-135M's converted weights takes about a second).

Every function here touches the engine's block manager or KV pool, so it must run on the
engine's own thread (`NativeEngine.call`).

Restoring follows `KVCacheManager`'s recipe: `allocate_slots(tmp, n)`, copy the KV into those
blocks, `cache_blocks(tmp, token_ids, n)`, `pin(token_ids)`, `free(tmp)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ragspeed.prompt_cache.store import (
    PromptRecord,
    delete_prefix,
    delete_record,
    list_saved_prefixes,
    load_prefix,
    load_records,
    prefix_path,
    remove_temporaries,
    save_prefix,
    save_record,
)

logger = logging.getLogger(__name__)

WEIGHT_HASHES_FILE = "weight-sha256.json"
_READ_BYTES = 8 << 20  # bytes read at a time when hashing a weight file
_restore_ids = itertools.count()


@dataclass(frozen=True)
class PinnedPrefix:
    """A prefix whose full blocks carry a pin reference in the engine's block manager."""

    name: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # as returned by KVCacheManager.pin (pass back to unpin)
    text: str = ""
    cache_salt: str | None = None


@dataclass(frozen=True)
class SavedPrompt:
    """A registered prompt found on disk: its record, and its KV where that is usable (else
    None: the prompt must be prefilled again)."""

    record: PromptRecord
    token_ids: tuple[int, ...] | None = None
    kv: torch.Tensor | None = None


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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class WeightHashes:
    """Full sha256s of weight files, kept in one JSON file by resolved path with the size and
    mtime they were computed at: a file whose size or mtime changed is hashed again. The file
    is rewritten atomically; a lost update (two processes at once) costs a rehash, never a
    wrong hash. An unreadable or unwritable cache file is ignored: the hash is then computed."""

    def __init__(self, path: Path | None):
        self.path = path

    def _load(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def sha256(self, weight_file: Path) -> str:
        status = weight_file.stat()
        name = str(weight_file.resolve())
        stamp = {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
        known = self._load().get(name)
        if isinstance(known, dict) and {k: known.get(k) for k in stamp} == stamp:
            digest = known.get("sha256")
            if isinstance(digest, str):
                return digest
        digest = file_sha256(weight_file)
        if self.path is not None:
            hashes = {**self._load(), name: {**stamp, "sha256": digest}}
            temporary = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                temporary.write_text(json.dumps(hashes, indent=1, sort_keys=True), encoding="utf-8")
                os.replace(temporary, self.path)
            except OSError as error:
                logger.warning("could not keep weight hashes in %s (%s)", self.path, error)
                with contextlib.suppress(OSError):
                    temporary.unlink(missing_ok=True)
        return digest


def default_weight_hashes() -> WeightHashes:
    from ragspeed.engine.native.loading.model_zoo import default_cache_dir

    return WeightHashes(default_cache_dir() / WEIGHT_HASHES_FILE)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        content = backend.to_str()
    else:
        content = json.dumps(sorted(tokenizer.get_vocab().items()))
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256((content + "\0" + str(template)).encode()).hexdigest()


def engine_fingerprint(engine: Any, hashes: WeightHashes | None = None) -> dict[str, Any]:
    """What must be equal for saved KV to be valid in this engine (see the module docstring).
    `hashes`: where weight files' sha256s are kept (default: the model cache's)."""
    hashes = hashes if hashes is not None else default_weight_hashes()
    path = Path(engine.loaded.path)
    weights = sorted(path.glob("*.safetensors"))
    config = path / "config.json"
    model = hashlib.sha256()
    if config.is_file():
        model.update(config.read_bytes())
    for weight_file in weights:
        model.update(weight_file.name.encode())
        model.update(hashes.sha256(weight_file).encode())
    choice = getattr(engine, "prefill_choice", None)
    return {
        "model": model.hexdigest(),
        "tokenizer": _tokenizer_fingerprint(engine.tokenizer),
        "kv_shape": engine_fingerprint_shape(engine),
        "kv_dtype": str(engine.kv_pool.kv.dtype),
        "quantization": engine.loaded.quantization,
        # The precision KV is computed at: the prefill's products and the model's own dtype.
        "prefill": None if choice is None else choice.name,
        "model_dtype": str(engine.runner.model.dtype),
    }


def _layout(shape: Any) -> list[int]:
    """A KV shape without its block count: (2, layers, block size, heads, head dim)."""
    return [int(shape[i]) for i in (0, 1, 3, 4, 5)]


def engine_fingerprint_shape(engine: Any) -> list[int]:
    """The pool's KV layout (`_layout`)."""
    return _layout(engine.kv_pool.kv.shape)


def kv_problem(kv: Any, shape: list[int], dtype: str, num_tokens: int) -> str:
    """Why saved `kv` cannot be the KV of `num_tokens` tokens in a pool of `shape` and `dtype`
    (`engine_fingerprint_shape`); "" if it can."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6:
        return "no KV tensor of 6 dimensions"
    if _layout(kv.shape) != list(shape) or str(kv.dtype) != dtype:
        return f"KV of shape {list(kv.shape)} and {kv.dtype}, expected {shape} (blocks at 2) and {dtype}"
    if kv.shape[2] * kv.shape[3] > num_tokens:
        return f"KV of {kv.shape[2] * kv.shape[3]} tokens for {num_tokens} token ids"
    return ""


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
    problem = kv_problem(kv, engine_fingerprint_shape(engine), str(engine.kv_pool.kv.dtype), len(token_ids))
    if problem:
        raise ValueError(f"saved KV does not fit this engine: {problem}")
    num_blocks = int(kv.shape[2])
    num_tokens = num_blocks * block_size
    if num_blocks == 0:
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
    """Registered prompts of one engine in one folder (`prompt_cache_dir`): their records, and
    the KV of their pinned blocks."""

    def __init__(self, directory: str | Path, fingerprint: dict[str, Any]):
        self.directory = Path(directory)
        self.fingerprint = fingerprint

    def save_record(self, record: PromptRecord) -> None:
        save_record(self.directory, record)

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

    def load_all(self) -> list[SavedPrompt]:
        """Every registered prompt in the folder, with its KV where that is intact and made by
        this model, tokenizer and layout (else refused with a log line, `kv` None). Removes the
        temporary files of interrupted writes first."""
        removed = remove_temporaries(self.directory)
        if removed:
            logger.info("removed %d temporary file(s) of interrupted writes in %s", removed, self.directory)
        records = {record.name: record for record in load_records(self.directory)}
        prefixes = {}
        for path in list_saved_prefixes(self.directory):
            loaded = load_prefix(path, self.fingerprint, read_tensors=_read_tensors)
            if loaded is None:
                continue
            kv = loaded.tensors.get("kv")
            shape, dtype = self.fingerprint["kv_shape"], self.fingerprint["kv_dtype"]
            problem = kv_problem(kv, shape, dtype, len(loaded.token_ids))
            if problem:
                logger.warning("refusing saved prefix %s: %s", path, problem)
                continue
            if loaded.name not in records:
                adopted = self._adopt(loaded.name, loaded.tensors.get("__metadata__", {}))
                if adopted is None:
                    continue
                records[loaded.name] = adopted
            prefixes[loaded.name] = loaded
        out = []
        for name in sorted(records):
            loaded = prefixes.get(name)
            if loaded is None:
                out.append(SavedPrompt(records[name]))
            else:
                out.append(SavedPrompt(records[name], loaded.token_ids, loaded.tensors["kv"]))
        return out

    def _adopt(self, name: str, metadata: dict[str, str]) -> PromptRecord | None:
        """A record for a prefix saved before records existed, from the text in its tensor
        file; None (and the prefix deleted) when it has none."""
        text = metadata.get("text", "")
        if not text:
            logger.warning("deleting saved prefix %s: no prompt record and no text", name)
            delete_prefix(prefix_path(self.directory, name))
            return None
        try:
            salt = json.loads(metadata.get("cache_salt", "null"))
        except ValueError:
            salt = None
        record = PromptRecord(name, text, salt if isinstance(salt, str) else None)
        save_record(self.directory, record)
        logger.info("saved prompt %s: record written from its KV file", name)
        return record

    def delete(self, name: str) -> None:
        """The KV first, the record last: a kill in between leaves the prompt registered."""
        delete_prefix(prefix_path(self.directory, name))
        delete_record(self.directory, name)
