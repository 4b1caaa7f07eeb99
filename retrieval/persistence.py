"""One collection = one file, written atomically and checked on load.

Layout (big-endian):

    magic (16 bytes) | version u32 | meta_len u64 | index_len u64 | meta (UTF-8 JSON)
    | index (faiss bytes) | sha256 of everything before it (32 bytes)

Writing goes to a temporary file in the same directory, is fsync'ed, then `os.replace`d over
the old file (and the directory fsync'ed), so a reader sees the old or the new collection,
never a mix: the metadata and the index can never disagree. Loading refuses a file whose
magic, version, lengths, checksum or JSON is wrong with `CorruptCollectionError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from ragspeed.retrieval.errors import CorruptCollectionError

MAGIC = b"RAGSPEED-COLL\x00\x00\x01"
FORMAT_VERSION = 1
_HEADER = struct.Struct(">IQQ")  # version, meta_len, index_len
_DIGEST_BYTES = 32


def write_atomic(path: Path, data_parts: list[bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in data_parts:
                out.write(part)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def save_collection_file(path: Path, meta: dict[str, Any], index_bytes: bytes) -> int:
    """Write `meta` and `index_bytes` as one checked file; returns its size in bytes."""
    meta_bytes = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    head = MAGIC + _HEADER.pack(FORMAT_VERSION, len(meta_bytes), len(index_bytes))
    digest = hashlib.sha256()
    for part in (head, meta_bytes, index_bytes):
        digest.update(part)
    write_atomic(path, [head, meta_bytes, index_bytes, digest.digest()])
    return len(head) + len(meta_bytes) + len(index_bytes) + _DIGEST_BYTES


def load_collection_file(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    fixed = len(MAGIC) + _HEADER.size
    if len(data) < fixed + _DIGEST_BYTES or not data.startswith(MAGIC):
        raise CorruptCollectionError(str(path), "not a ragspeed collection file (bad magic or truncated)")
    version, meta_len, index_len = _HEADER.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise CorruptCollectionError(
            str(path), f"format version {version}, this build reads {FORMAT_VERSION}"
        )
    expected_len = fixed + meta_len + index_len + _DIGEST_BYTES
    if expected_len != len(data):
        raise CorruptCollectionError(
            str(path), f"length mismatch: header says {expected_len} bytes, file has {len(data)}"
        )
    body_end = len(data) - _DIGEST_BYTES
    if hashlib.sha256(memoryview(data)[:body_end]).digest() != data[body_end:]:
        raise CorruptCollectionError(str(path), "checksum mismatch (file modified or partly written)")
    try:
        meta = json.loads(data[fixed : fixed + meta_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCollectionError(str(path), f"metadata is not valid JSON ({exc})") from exc
    return meta, data[fixed + meta_len : body_end]
