"""Registered prompts persisted to disk: what is registered, and the KV that spares its prefill.

A registered prompt is a *record*, `<name>.prompt.json` (format, name, text, cache salt and a
sha256 of those fields): the truth of what is registered. Its KV, a cache that a restart may
use or recompute, is a *saved prefix* of two files side by side:

- the *tensor file* at `path` (the KV tensors, e.g. safetensors), written by the caller's
  `write_tensors(path, tensors)` and read back by `read_tensors(path)`; this module never
  imports torch;
- the *sidecar* at `path + ".json"`: format version, name, token ids, the model and tokenizer
  fingerprint, the tensor file's size and sha256, and a sha256 of the sidecar's own fields.

Each file is written atomically (a temporary file in the same folder, fsync, `os.replace`, fsync
of the folder), tensor file first. A crash between the two leaves a sidecar whose checksum does
not match the tensor file, which is refused. `load_prefix` never raises on bad files: a missing,
corrupt or mismatched (other model or tokenizer) prefix returns None with a log line, and the
engine simply prefills it again from the record's text.

Registering writes the record first and the prefix after it; deleting removes the prefix first
and the record last. So a process killed at any moment leaves a record (the prompt is there,
and prefilled again if its KV was not complete), or nothing of it. Each atomic write goes
through a temporary `.<file>.<hex>.tmp`; `remove_temporaries` clears those a kill left behind.
A prefix without a record comes from a version that kept the text in the tensor file only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragspeed.prompt_cache.registry import validate_prompt_name

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SIDECAR_SUFFIX = ".json"
RECORD_SUFFIX = ".prompt.json"
RECORD_FORMAT = 1
TEMPORARY_GLOB = ".*.tmp"  # what `_atomic_write` names its temporary files

WriteTensors = Callable[[Path, dict[str, Any]], None]
ReadTensors = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class LoadedPrefix:
    name: str
    token_ids: tuple[int, ...]
    fingerprint: dict[str, Any]
    tensors: dict[str, Any]


@dataclass(frozen=True)
class PromptRecord:
    """A registered prompt as its record file holds it."""

    name: str
    text: str
    cache_salt: str | None = None


def prefix_path(directory: str | os.PathLike, name: str, suffix: str = ".safetensors") -> Path:
    """Where prefix `name` lives in `directory` (the name is validated: it becomes a file name)."""
    return Path(directory) / f"{validate_prompt_name(name)}{suffix}"


def sidecar_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _canonical(value: Any) -> Any:
    """The JSON round trip of a value (tuples become lists), for stable comparisons."""
    return json.loads(json.dumps(value, sort_keys=True))


def _fields_checksum(fields: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _file_sha256(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(temporary_path)`, then fsync and rename over `path`."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def save_prefix(
    path: str | os.PathLike,
    *,
    name: str,
    token_ids: Sequence[int],
    fingerprint: Mapping[str, Any],
    tensors: dict[str, Any],
    write_tensors: WriteTensors,
) -> Path:
    """Persist a pinned prefix atomically: the tensor file at `path`, then its sidecar.

    `fingerprint` (JSON-serializable, e.g. model and tokenizer hashes) must equal the
    `expected_fingerprint` given to `load_prefix` for the prefix to be loaded again. Returns the
    sidecar's path. Errors while writing raise (nothing half-written is left at `path`).
    """
    validate_prompt_name(name)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda temporary: write_tensors(temporary, tensors))
    tensors_sha256, tensors_bytes = _file_sha256(path)
    fields = {
        "format": FORMAT_VERSION,
        "name": name,
        "token_ids": [int(token_id) for token_id in token_ids],
        "fingerprint": _canonical(dict(fingerprint)),
        "tensors_file": path.name,
        "tensors_bytes": tensors_bytes,
        "tensors_sha256": tensors_sha256,
    }
    sidecar = {**fields, "checksum": _fields_checksum(fields)}
    target = sidecar_path(path)
    _atomic_write(target, lambda temporary: temporary.write_text(json.dumps(sidecar)))
    return target


def load_prefix(
    path: str | os.PathLike,
    expected_fingerprint: Mapping[str, Any],
    *,
    read_tensors: ReadTensors,
) -> LoadedPrefix | None:
    """The saved prefix at `path` if it is intact and was made by the expected model and
    tokenizer; otherwise None with a log line (never raises for a bad or missing file)."""
    path = Path(path)
    try:
        sidecar = json.loads(sidecar_path(path).read_text())
    except FileNotFoundError:
        logger.info("no saved prefix at %s", path)
        return None
    except (OSError, ValueError) as error:
        logger.warning("refusing saved prefix %s: unreadable sidecar (%s)", path, error)
        return None
    reason = _sidecar_problem(sidecar, path, expected_fingerprint)
    if reason:
        logger.warning("refusing saved prefix %s: %s", path, reason)
        return None
    try:
        tensors_sha256, tensors_bytes = _file_sha256(path)
    except OSError as error:
        logger.warning("refusing saved prefix %s: unreadable tensor file (%s)", path, error)
        return None
    if (tensors_sha256, tensors_bytes) != (sidecar["tensors_sha256"], sidecar["tensors_bytes"]):
        logger.warning("refusing saved prefix %s: tensor file checksum mismatch (corrupt)", path)
        return None
    try:
        tensors = read_tensors(path)
    except Exception as error:  # a reader failing on a checksummed file: still never fatal
        logger.warning("refusing saved prefix %s: reading tensors failed (%s)", path, error)
        return None
    return LoadedPrefix(
        name=sidecar["name"],
        token_ids=tuple(sidecar["token_ids"]),
        fingerprint=sidecar["fingerprint"],
        tensors=tensors,
    )


def _sidecar_problem(sidecar: Any, path: Path, expected_fingerprint: Mapping[str, Any]) -> str:
    """Why the sidecar is refused, or "" if it is fine."""
    if not isinstance(sidecar, dict) or "checksum" not in sidecar:
        return "sidecar is not a saved-prefix record"
    fields = {key: value for key, value in sidecar.items() if key != "checksum"}
    if _fields_checksum(fields) != sidecar["checksum"]:
        return "sidecar checksum mismatch (corrupt)"
    if fields.get("format") != FORMAT_VERSION:
        return f"format {fields.get('format')!r}, expected {FORMAT_VERSION}"
    if fields.get("tensors_file") != path.name:
        return f"sidecar belongs to {fields.get('tensors_file')!r}"
    if fields.get("fingerprint") != _canonical(dict(expected_fingerprint)):
        return "fingerprint mismatch (the model or tokenizer changed)"
    token_ids = fields.get("token_ids")
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        return "token_ids malformed"
    return ""


def list_saved_prefixes(directory: str | os.PathLike) -> list[Path]:
    """Tensor-file paths in `directory` that have a sidecar, by name (nothing is validated)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        sidecar.with_name(sidecar.name[: -len(SIDECAR_SUFFIX)])
        for sidecar in directory.glob(f"*{SIDECAR_SUFFIX}")
        if not sidecar.name.startswith(".") and not sidecar.name.endswith(RECORD_SUFFIX)
    )


def delete_prefix(path: str | os.PathLike) -> None:
    """Remove a saved prefix (sidecar first, so a half-deleted prefix is never loaded)."""
    path = Path(path)
    sidecar_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    _fsync_directory(path.parent)


# ---------------------------------------------------------------------- prompt records


def record_path(directory: str | os.PathLike, name: str) -> Path:
    return prefix_path(directory, name, RECORD_SUFFIX)


def save_record(directory: str | os.PathLike, record: PromptRecord) -> Path:
    """Write `record` atomically; returns its path."""
    path = record_path(directory, record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {
        "format": RECORD_FORMAT,
        "name": record.name,
        "text": record.text,
        "cache_salt": record.cache_salt,
    }
    body = json.dumps({**fields, "checksum": _fields_checksum(fields)})
    _atomic_write(path, lambda temporary: temporary.write_text(body))
    return path


def load_records(directory: str | os.PathLike) -> list[PromptRecord]:
    """Every intact record in `directory`, by name; a bad one is refused with a log line."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob(f"*{RECORD_SUFFIX}")):
        if path.name.startswith("."):
            continue
        try:
            record = _record(json.loads(path.read_text()), path)
        except (OSError, ValueError) as error:
            logger.warning("refusing prompt record %s: %s", path, error)
            continue
        records.append(record)
    return records


def _record(body: Any, path: Path) -> PromptRecord:
    """The record in a parsed file; ValueError saying what is wrong with it."""
    if not isinstance(body, dict) or "checksum" not in body:
        raise ValueError("not a prompt record")
    fields = {key: value for key, value in body.items() if key != "checksum"}
    if _fields_checksum(fields) != body["checksum"]:
        raise ValueError("checksum mismatch (corrupt)")
    if fields.get("format") != RECORD_FORMAT:
        raise ValueError(f"format {fields.get('format')!r}, expected {RECORD_FORMAT}")
    name, text, salt = fields.get("name"), fields.get("text"), fields.get("cache_salt")
    if not isinstance(name, str) or path.name != f"{name}{RECORD_SUFFIX}":
        raise ValueError(f"the record names {name!r}")
    if not isinstance(text, str) or not text or not (salt is None or isinstance(salt, str)):
        raise ValueError("text or cache_salt malformed")
    return PromptRecord(validate_prompt_name(name), text, salt)


def delete_record(directory: str | os.PathLike, name: str) -> None:
    path = record_path(directory, name)
    path.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def remove_temporaries(directory: str | os.PathLike) -> int:
    """Delete the temporary files that writes interrupted by a kill left; how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    count = 0
    for temporary in directory.glob(TEMPORARY_GLOB):
        temporary.unlink(missing_ok=True)
        count += 1
    return count
