"""Per-document KV caches, kept in RAM and on disk, so a document is prefilled once.

- A *document KV* (`DocumentKV`) is the KV of one retrieved document's tokens: an opaque byte
  payload with its dtype and shape (`[2, num_layers, num_tokens, num_kv_heads, head_dim]`).
  The engine makes and reads the tensors (`torch.frombuffer`); this module never imports torch
  or numpy.
- Its *start position* is the position of the document's first token when the KV was computed.
  The engine places the KV at another position by rotating its keys by the RoPE delta.
- Its *key* (`document_key`) is the sha256 of four parts: the model fingerprint, the tenant's
  `cache_salt` (an empty salt is no salt), the *prefix* token ids the document was computed
  after, and the document's own token ids. Every hit is checked against the stored token ids, so
  a collision costs a miss, never wrong KV.
- The *layout* (`KVLayout`) is what every stored shape must be for n tokens: `[2, num_layers, n,
  num_kv_heads, head_dim]` of the storage dtype. A file or a put of another shape is refused.
- The *RAM tier* is an LRU of entries bounded by `capacity_bytes` of payload. The *disk tier*
  (when a `directory` is given) holds one file per document, `<key>.kv`, an LRU bounded by
  `disk_capacity_bytes` of file size: a hit sets its file's mtime to now, so the order of use
  survives a restart (the index is rebuilt oldest mtime first). A disk hit is promoted into RAM
  as a read-only view over the memory-mapped file (no copy).
- The *server key* is 32 random bytes (`secrets`) in a file of mode 0600 (`load_or_create_key`),
  created on first use. Every file carries an HMAC-SHA256 under it of its header's fields (key,
  fingerprint, token ids, start position, dtype, shape, payload length) and its payload: whoever
  can write the folder but not read the key cannot forge a file another tenant would load.

A file is a 16-byte preamble (magic, format version, header length), a JSON header (those fields
and the HMAC), zero padding, then the payload at an offset aligned to 64 bytes. Files are
written atomically (a temporary file in the same folder, fsync, `os.replace`, fsync of the
folder). A lookup never raises on a bad file: a truncated, forged, corrupt or inconsistent file
(whose HMAC does not verify, or whose shape is not the layout's for its tokens) is logged,
counted in `rejected_files`, deleted (the engine recomputes the document) and missed; a file of
another model (another fingerprint) is missed, kept, and no longer looked at (logged once).
`put` never raises on a disk error either (a full disk): it logs, counts `disk_write_errors`
and returns False, and the RAM copy is still served.

All state is guarded by one lock. Reading, writing and hashing a file's bytes run outside it (a
lookup of a large document takes milliseconds), so a metrics reader in another thread never
waits for them; renames and deletions run under it, to keep the index and the folder in step.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
MAGIC = b"RSDOCKV\x00"
FILE_SUFFIX = ".kv"
KEY_BYTES = 32
KEY_FILE_NAME = "server.key"  # the server key, beside the files it signs
# The payload offset is a multiple of this, so `torch.frombuffer` views are aligned for any
# dtype (and for vector loads); the mmap itself starts on a page boundary.
PAYLOAD_ALIGNMENT = 64

# The engine's dtype names and their item sizes in bytes.
DTYPE_ITEMSIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}

# Magic, format version, header length (little-endian).
_PREAMBLE = struct.Struct("<8sII")
_KEY_DOMAIN = b"ragspeed.document_kv/1"
_HMAC_DOMAIN = b"ragspeed.document_kv.file/2"
# A key becomes a file name: lowercase, so that case-insensitive file systems cannot merge two.
_SAFE_KEY = re.compile(r"[0-9a-z_-]{1,128}")
_TEMPORARY_NAME = re.compile(r"\.[0-9a-z_-]{1,128}\.kv\.[0-9a-f]{32}\.tmp")
# Python 3.13 lets a read-only mmap skip duplicating the file descriptor; before it, each
# mmap-backed entry in RAM holds one descriptor (bounded by the entries the RAM budget holds).
_MMAP_OPTIONS: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def _tagged(tag: bytes, value: bytes) -> bytes:
    # Tag and byte length before each part: no two different tuples share an encoding.
    return tag + struct.pack("<Q", len(value)) + value


def _int64s(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def document_key(
    fingerprint: str, cache_salt: str | None, prefix_token_ids: Sequence[int], token_ids: Sequence[int]
) -> str:
    """The sha256 hex of (model fingerprint, tenant salt, prefix token ids, document token ids),
    each part tagged and length-delimited; an empty `cache_salt` equals None."""
    encoded = b"".join(
        (
            _KEY_DOMAIN,
            _tagged(b"fingerprint", fingerprint.encode()),
            _tagged(b"salt", (cache_salt or "").encode()),
            _tagged(b"prefix", _int64s(prefix_token_ids)),
            _tagged(b"tokens", _int64s(token_ids)),
        )
    )
    return hashlib.sha256(encoded).hexdigest()


def load_or_create_key(path: str | os.PathLike) -> bytes:
    """The server key in `path`: read, or on first use created (32 bytes of `secrets`, mode
    0600, written exclusively so two starting servers agree on one). A key file that others may
    read is made 0600 with a warning; one of another user or another length raises ValueError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        logger.info("document store: created the server key %s", path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        status = os.fstat(fd)
        if hasattr(os, "geteuid") and status.st_uid != os.geteuid():
            # Whoever can write the folder could have put their own key there.
            raise ValueError(f"{path}: the document store key belongs to another user")
        mode = status.st_mode & 0o777
        if mode & 0o077:
            logger.warning("document store: key %s had mode %o; made 0600", path, mode)
            os.fchmod(fd, 0o600)
        key = os.read(fd, KEY_BYTES + 1)
        for _ in range(20):  # another server created it an instant ago and is writing it
            if key:
                break
            time.sleep(0.05)
            key = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:  # a writer killed between create and write, or not our file
        raise ValueError(f"{path}: a document store key is {KEY_BYTES} bytes, found {len(key)}")
    return key


def disk_budget(directory: str | os.PathLike, requested: int, free_share: float = 0.5) -> int:
    """`requested` bytes, bounded by the `.kv` files `directory` already holds plus `free_share`
    of its free disk space (the folder is created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    held = 0
    with os.scandir(directory) as entries:
        for item in entries:
            if item.name.endswith(FILE_SUFFIX):
                with contextlib.suppress(OSError):
                    held += item.stat().st_size
    return min(requested, held + int(shutil.disk_usage(directory).free * free_share))


def _payload_bytes(dtype: str, shape: Sequence[int]) -> int | None:
    """prod(shape) * itemsize(dtype), or None for an unknown dtype."""
    itemsize = DTYPE_ITEMSIZES.get(dtype)
    return None if itemsize is None else math.prod(shape) * itemsize


@dataclass(frozen=True)
class KVLayout:
    """What a stored KV of n tokens must be: `[2, num_layers, n, num_kv_heads, head_dim]` of
    `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        return (2, self.num_layers, num_tokens, self.num_kv_heads, self.head_dim)

    def problem(self, dtype: str, shape: Sequence[int], num_tokens: int) -> str:
        """Why (`dtype`, `shape`) cannot be the KV of `num_tokens` tokens; "" if it can."""
        if dtype != self.dtype or tuple(shape) != self.shape(num_tokens):
            return (
                f"shape {list(shape)} of {dtype} is not the KV of {num_tokens} tokens "
                f"({list(self.shape(num_tokens))} of {self.dtype})"
            )
        return ""


@dataclass(frozen=True)
class DocumentKV:
    """One document's KV: `data` holds prod(shape) items of `dtype`, computed with the
    document's first token at `start_position`. From the disk tier, `data` is a read-only
    memoryview over the mapped file."""

    key: str
    token_ids: tuple[int, ...]
    start_position: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "shape", tuple(int(size) for size in self.shape))
        if self.start_position < 0:
            raise ValueError(f"start_position must be >= 0, got {self.start_position}")
        if any(size < 0 for size in self.shape):
            raise ValueError(f"shape must not be negative, got {self.shape}")
        if isinstance(self.data, memoryview) and not self.data.c_contiguous:
            raise ValueError("data must be a C-contiguous buffer")
        expected = _payload_bytes(self.dtype, self.shape)
        if expected is None:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_ITEMSIZES)}")
        if expected != self.num_bytes:
            raise ValueError(
                f"shape {self.shape} of {self.dtype} is {expected} bytes, data is {self.num_bytes}"
            )

    @property
    def num_bytes(self) -> int:
        return self.data.nbytes if isinstance(self.data, memoryview) else len(self.data)


@dataclass(frozen=True)
class Found:
    """A hit: the entry, and the tier it came from ("ram" or "disk")."""

    entry: DocumentKV
    tier: str


@dataclass(frozen=True)
class DocumentStoreStats:
    """A snapshot of the store; the counters (all but the sizes and capacities) only grow.

    - `hits` = `ram_hits` + `disk_hits`; `misses`: lookups that returned None (absent, other
      token ids, another model's file, or a rejected file). `disk_lookups`: lookups that missed
      RAM and found a file to read (`disk_hits` of them hit).
    - `stored_bytes` / `num_entries`: payload bytes and entries in RAM (disk hits promoted into
      RAM count their payload, though it is mapped: it is what `capacity_bytes` bounds).
    - `disk_bytes` / `num_disk_entries`: size and count of the `.kv` files known to the store.
    - `capacity_bytes` / `disk_capacity_bytes`: the tiers' budgets (-1: the disk's unbounded,
      0: no such tier).
    - `evictions`: entries dropped from RAM for room; `disk_evictions`: files deleted for room.
    - `disk_write_errors`: puts whose file could not be written; `rejected_files`: files deleted
      at lookup as truncated, forged, corrupt or inconsistent; `foreign_files`: files of another
      model, ignored.
    - `load_seconds_total`: time spent reading and verifying files; `puts`: calls of `put`.
    """

    hits: int
    misses: int
    ram_hits: int
    disk_hits: int
    stored_bytes: int
    disk_bytes: int
    num_entries: int
    num_disk_entries: int
    evictions: int
    disk_write_errors: int
    rejected_files: int
    load_seconds_total: float
    puts: int
    disk_evictions: int = 0
    disk_lookups: int = 0
    foreign_files: int = 0
    capacity_bytes: int = 0
    disk_capacity_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    @property
    def ram_hit_rate(self) -> float:
        """RAM hits over all lookups."""
        lookups = self.hits + self.misses
        return self.ram_hits / lookups if lookups else 0.0

    @property
    def disk_hit_rate(self) -> float:
        """Disk hits over the lookups that reached the disk (those RAM missed with a file)."""
        return self.disk_hits / self.disk_lookups if self.disk_lookups else 0.0

    def to_dict(self) -> dict[str, float]:
        """All numbers, the hit rates included, for `EngineClient.stats()` and /metrics."""
        return {
            **asdict(self),
            "hit_rate": self.hit_rate,
            "ram_hit_rate": self.ram_hit_rate,
            "disk_hit_rate": self.disk_hit_rate,
        }


@dataclass(frozen=True)
class _Loaded:
    """What reading one file gave: `entry` when usable; otherwise `outcome` says why not
    ("missing", "foreign", "other_tokens" or "rejected") and `reason` in words."""

    entry: DocumentKV | None
    outcome: str = "ok"
    reason: str = ""
    identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read


def _payload_offset(header_length: int) -> int:
    end = _PREAMBLE.size + header_length
    return -(-end // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def file_hmac(secret: bytes, fields: dict[str, Any], payload: bytes | memoryview) -> str:
    """HMAC-SHA256 under `secret` of a file's header `fields` (canonical JSON, length-delimited)
    and its payload. Costs about 1 ms per MiB (SHA-NI; the GIL is released meanwhile)."""
    mac = hmac.new(secret, _HMAC_DOMAIN, hashlib.sha256)
    mac.update(_tagged(b"header", json.dumps(fields, sort_keys=True).encode()))
    mac.update(_tagged(b"payload", b""))  # the length is in the header; the bytes follow
    mac.update(payload)
    return mac.hexdigest()


def _encode_head(entry: DocumentKV, payload: memoryview, fingerprint: str, secret: bytes) -> bytes:
    """Preamble, JSON header and padding: everything before the payload."""
    fields = {
        "key": entry.key,
        "token_ids": list(entry.token_ids),
        "start_position": entry.start_position,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "fingerprint": fingerprint,
        "payload_bytes": payload.nbytes,
    }
    header = json.dumps({**fields, "hmac": file_hmac(secret, fields, payload)}).encode()
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    return head + bytes(_payload_offset(len(header)) - len(head))


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(item) is int for item in value)


def _header_problem(header: Any) -> str:
    """Why a header is refused before its fields are compared with the lookup's, or "" if fine."""
    if not isinstance(header, dict) or not isinstance(header.get("hmac"), str):
        return "header is not a document record"
    if not (
        isinstance(header.get("fingerprint"), str)
        and isinstance(header.get("key"), str)
        and _is_int_list(header.get("token_ids"))
        and type(header.get("start_position")) is int
        and header["start_position"] >= 0
        and isinstance(header.get("dtype"), str)
        and _is_int_list(header.get("shape"))
        and all(size >= 0 for size in header["shape"])
        and type(header.get("payload_bytes")) is int
    ):
        return "header fields malformed"
    return ""


@dataclass(frozen=True)
class _Expected:
    """What a lookup wants of a file: its key, token ids, model and layout, and the key the
    HMAC must verify under."""

    key: str
    token_ids: tuple[int, ...]
    fingerprint: str
    layout: KVLayout | None
    secret: bytes


def _read_file(path: Path, expected: _Expected) -> _Loaded:
    """Map `path` and check it for a lookup; never raises for a bad file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        return _Loaded(None, "missing", "file vanished")
    except OSError as error:
        return _Loaded(None, "rejected", f"unreadable ({error})")
    try:
        status = os.fstat(fd)
        identity = (status.st_dev, status.st_ino)
        if status.st_size < _PREAMBLE.size:
            return _Loaded(None, "rejected", f"truncated ({status.st_size} bytes)", identity)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_MMAP_OPTIONS)
    except (OSError, ValueError) as error:
        return _Loaded(None, "rejected", f"unreadable ({error})", None)
    finally:
        os.close(fd)
    loaded = _check_mapped(mapped, expected)
    if loaded.entry is None:
        mapped.close()  # no view of it is left on this path
    return replace(loaded, identity=identity)


def _check_mapped(mapped: mmap.mmap, expected: _Expected) -> _Loaded:
    """The header's cheap checks first (a foreign or other-token file is missed without reading
    its payload), then the sizes, then the HMAC over header and payload, which all the rest
    was read from."""
    size = len(mapped)
    magic, version, header_length = _PREAMBLE.unpack(mapped[: _PREAMBLE.size])
    if magic != MAGIC:
        return _Loaded(None, "rejected", "bad magic (not a document KV file)")
    if version != FORMAT_VERSION:
        return _Loaded(None, "rejected", f"format version {version}, expected {FORMAT_VERSION}")
    header_end = _PREAMBLE.size + header_length
    if header_end > size:
        return _Loaded(None, "rejected", f"truncated ({size} bytes, header ends at {header_end})")
    try:
        header = json.loads(mapped[_PREAMBLE.size : header_end])
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        return _Loaded(None, "rejected", f"header unreadable ({error})")
    problem = _header_problem(header)
    if problem:
        return _Loaded(None, "rejected", problem)
    if header["fingerprint"] != expected.fingerprint:
        return _Loaded(None, "foreign", f"made by another model ({header['fingerprint']!r})")
    if header["key"] != expected.key:
        return _Loaded(None, "rejected", f"holds key {header['key']!r}, not its file name's")
    token_ids = tuple(header["token_ids"])
    if token_ids != expected.token_ids:
        return _Loaded(None, "other_tokens", "token ids differ from the requested ones")
    dtype, shape = header["dtype"], header["shape"]
    num_bytes = _payload_bytes(dtype, shape)
    if num_bytes is None:
        return _Loaded(None, "rejected", f"unknown dtype {dtype!r}")
    problem = "" if expected.layout is None else expected.layout.problem(dtype, shape, len(token_ids))
    if problem:
        return _Loaded(None, "rejected", f"wrong shape: {problem}")
    if num_bytes != header["payload_bytes"]:
        return _Loaded(
            None,
            "rejected",
            f"shape mismatch ({shape} of {dtype} is {num_bytes} bytes, payload {header['payload_bytes']})",
        )
    offset = _payload_offset(header_length)
    if size < offset + num_bytes:
        return _Loaded(None, "rejected", f"truncated ({size} bytes, payload ends at {offset + num_bytes})")
    if size > offset + num_bytes:
        return _Loaded(
            None, "rejected", f"payload length mismatch ({size - offset - num_bytes} trailing bytes)"
        )
    payload = memoryview(mapped)[offset : offset + num_bytes]
    fields = {name: value for name, value in header.items() if name != "hmac"}
    # Verified on every load: the only defence against a flipped bit and a forged file alike.
    if not hmac.compare_digest(file_hmac(expected.secret, fields, payload), header["hmac"]):
        payload.release()
        return _Loaded(None, "rejected", "HMAC does not verify under the server key (forged or corrupt)")
    entry = DocumentKV(
        key=expected.key,
        token_ids=token_ids,
        start_position=header["start_position"],
        dtype=dtype,
        shape=tuple(shape),
        data=payload,
    )
    return _Loaded(entry)


def _write_file(path: Path, head: bytes, payload: memoryview) -> None:
    with open(path, "xb") as file:
        file.write(head)
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable; best effort, never raises."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError as error:  # the files are complete; only the folder entry's durability is in doubt
        logger.warning("document store: fsync of %s failed (%s)", directory, error)
    finally:
        os.close(fd)


class DocumentStore:
    """Document KVs by key: an LRU in RAM over `capacity_bytes` of payload (0: no RAM tier),
    and, with a `directory`, one file per document bounded by `disk_capacity_bytes` (None:
    unbounded). Files are read as written by the same `fingerprint` under the same `secret`
    (default: the server key `KEY_FILE_NAME` in the folder, created on first use); with a
    `layout`, every entry's shape and dtype must be the layout's for its tokens.

    The disk tier's index is built once, at construction, from the folder's `.kv` files (oldest
    by mtime first, nothing validated until a lookup); files another process writes later are
    not seen until the next start.
    """

    def __init__(
        self,
        *,
        capacity_bytes: int,
        directory: str | os.PathLike | None = None,
        fingerprint: str = "",
        disk_capacity_bytes: int | None = None,
        layout: KVLayout | None = None,
        secret: bytes | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if disk_capacity_bytes is not None and disk_capacity_bytes < 0:
            raise ValueError(f"disk_capacity_bytes must be >= 0 or None, got {disk_capacity_bytes}")
        self._capacity_bytes = capacity_bytes
        self._disk_capacity_bytes = disk_capacity_bytes
        self._fingerprint = fingerprint
        self._layout = layout
        self._lock = threading.Lock()
        self._ram: OrderedDict[str, DocumentKV] = OrderedDict()  # least recently used first
        self._stored_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file size, least recent first
        self._disk_bytes = 0
        self._hits = self._misses = self._ram_hits = self._disk_hits = 0
        self._evictions = self._disk_evictions = self._disk_write_errors = 0
        self._rejected_files = self._puts = self._disk_lookups = self._foreign_files = 0
        self._load_seconds_total = 0.0
        self._directory = None if directory is None else Path(directory)
        self._secret = b""
        if self._directory is not None:
            self._directory.mkdir(parents=True, exist_ok=True)
            self._secret = (
                secret if secret is not None else load_or_create_key(self._directory / KEY_FILE_NAME)
            )
            if len(self._secret) < 16:
                raise ValueError("the document store's secret must be at least 16 bytes")
            self._scan_directory(self._directory)

    def _scan_directory(self, directory: Path) -> None:
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        num_removed = 0
        with os.scandir(directory) as entries:
            for item in entries:
                if _TEMPORARY_NAME.fullmatch(item.name):
                    # Left by a writer killed before its rename. A live writer in another
                    # process sharing the folder loses only that write (its rename fails).
                    with contextlib.suppress(OSError):
                        os.unlink(item.path)
                        num_removed += 1
                    continue
                stem = item.name[: -len(FILE_SUFFIX)]
                if not item.name.endswith(FILE_SUFFIX) or not _SAFE_KEY.fullmatch(stem):
                    continue
                try:
                    status = item.stat()
                except OSError:  # removed since the listing
                    continue
                found.append((status.st_mtime_ns, stem, status.st_size))
        for _, key, size in sorted(found):
            self._disk[key] = size
            self._disk_bytes += size
        logger.info(
            "document store at %s: %d files, %d bytes; removed %d stale temporary files",
            directory,
            len(self._disk),
            self._disk_bytes,
            num_removed,
        )

    def _path(self, key: str) -> Path:
        assert self._directory is not None
        return self._directory / f"{key}{FILE_SUFFIX}"

    # RAM tier (callers hold the lock).

    def _drop_from_ram(self, key: str) -> None:
        old = self._ram.pop(key, None)
        if old is not None:
            self._stored_bytes -= old.num_bytes

    def _keep_in_ram(self, entry: DocumentKV) -> bool:
        """Insert `entry` as most recent, evicting least recent entries; False if it cannot fit."""
        self._drop_from_ram(entry.key)
        if self._capacity_bytes == 0 or entry.num_bytes > self._capacity_bytes:
            return False
        while self._stored_bytes + entry.num_bytes > self._capacity_bytes:
            _, evicted = self._ram.popitem(last=False)
            self._stored_bytes -= evicted.num_bytes
            self._evictions += 1
        self._ram[entry.key] = entry
        self._stored_bytes += entry.num_bytes
        return True

    # Disk tier (callers hold the lock).

    def _forget_file(self, key: str) -> None:
        size = self._disk.pop(key, None)
        if size is not None:
            self._disk_bytes -= size

    def _delete_file_if_same(self, key: str, identity: tuple[int, int] | None) -> None:
        """Delete the file of `key` if it is still the one read (a put may have replaced it)."""
        path = self._path(key)
        try:
            status = os.stat(path)
        except FileNotFoundError:
            self._forget_file(key)
            return
        except OSError:
            return
        if identity is not None and (status.st_dev, status.st_ino) != identity:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._forget_file(key)

    def _make_disk_room(self, num_bytes: int) -> None:
        assert self._disk_capacity_bytes is not None
        while self._disk and self._disk_bytes + num_bytes > self._disk_capacity_bytes:
            key, size = self._disk.popitem(last=False)
            self._disk_bytes -= size
            self._disk_evictions += 1
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as error:
                logger.warning("document store: could not delete %s for room (%s)", self._path(key), error)

    # Public API.

    def get(self, key: str, token_ids: Sequence[int]) -> DocumentKV | None:
        """The document KV of `key` if its token ids equal `token_ids`, from RAM, else from disk
        (then promoted into RAM); None on a miss."""
        found = self.find(key, token_ids)
        return None if found is None else found.entry

    def find(self, key: str, token_ids: Sequence[int]) -> Found | None:
        """`get`, with the tier the entry came from."""
        wanted = tuple(token_ids)
        on_disk = False
        with self._lock:
            entry = self._ram.get(key)
            if entry is not None:
                if entry.token_ids != wanted:
                    self._misses += 1
                    logger.debug("document store: key %s holds other token ids (a collision): miss", key)
                    return None
                self._ram.move_to_end(key)
                on_disk = key in self._disk
                if on_disk:
                    self._disk.move_to_end(key)
                self._hits += 1
                self._ram_hits += 1
            elif key not in self._disk:
                self._misses += 1
                return None
        if entry is not None:
            if on_disk:
                self._touch(key)
            return Found(entry, "ram")
        path = self._path(key)
        started = time.perf_counter()
        loaded = _read_file(path, _Expected(key, wanted, self._fingerprint, self._layout, self._secret))
        elapsed = time.perf_counter() - started
        with self._lock:
            self._load_seconds_total += elapsed
            self._disk_lookups += loaded.outcome != "missing"
            if loaded.entry is not None:
                self._hits += 1
                self._disk_hits += 1
                if key in self._disk:
                    self._disk.move_to_end(key)
                if key not in self._ram:  # a put since the lookup is newer: keep it
                    self._keep_in_ram(loaded.entry)
            else:
                self._misses += 1
                if loaded.outcome == "rejected":
                    self._rejected_files += 1
                    self._delete_file_if_same(key, loaded.identity)
                elif loaded.outcome == "foreign":
                    # Kept for the model that wrote it; this store no longer looks at it.
                    self._foreign_files += 1
                    self._forget_file(key)
                elif loaded.outcome == "missing" and not path.exists():
                    self._forget_file(key)
        if loaded.entry is not None:
            self._touch(key)
            return Found(loaded.entry, "disk")
        if loaded.outcome == "rejected":
            logger.warning("document store: rejected and deleted %s: %s", path, loaded.reason)
        elif loaded.outcome == "foreign":
            logger.info("document store: ignoring %s from now on: %s", path, loaded.reason)
        else:
            logger.debug("document store: miss on %s: %s", path, loaded.reason)
        return None

    def _touch(self, key: str) -> None:
        """Mark the file of `key` used now: its mtime orders the disk LRU after a restart."""
        with contextlib.suppress(OSError):
            os.utime(self._path(key))

    def put(self, entry: DocumentKV) -> bool:
        """Keep `entry` in RAM (if it fits the capacity) and write it to disk (with a directory).

        True when the file was written, or, without a disk tier, when the entry is in RAM; False
        otherwise (a disk error is logged and counted, never raised). A key that is not a safe
        file name (lowercase letters, digits, `_`, `-`) raises ValueError.
        """
        if not _SAFE_KEY.fullmatch(entry.key):
            raise ValueError(f"document key {entry.key!r} is not a safe file name")
        problem = (
            ""
            if self._layout is None
            else self._layout.problem(entry.dtype, entry.shape, len(entry.token_ids))
        )
        if problem:
            raise ValueError(f"document {entry.key}: {problem}")
        if not isinstance(entry.data, bytes) and not (
            isinstance(entry.data, memoryview) and entry.data.readonly
        ):
            # A writable buffer is the caller's: copy it, so later writes cannot change the
            # stored KV (a read-only view is trusted to stay as it is).
            entry = replace(entry, data=memoryview(entry.data).tobytes())
        with self._lock:
            self._puts += 1
            in_ram = self._keep_in_ram(entry)
        if self._directory is None:
            return in_ram
        return self._write(entry)

    def _write(self, entry: DocumentKV) -> bool:
        path = self._path(entry.key)
        payload = memoryview(entry.data).cast("B")
        head = _encode_head(entry, payload, self._fingerprint, self._secret)
        file_bytes = len(head) + payload.nbytes
        if self._disk_capacity_bytes is not None and file_bytes > self._disk_capacity_bytes:
            logger.debug("document store: %s (%d bytes) exceeds the disk capacity", path, file_bytes)
            return False
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            _write_file(temporary, head, payload)
            with self._lock:
                old_size = self._disk.pop(entry.key, None)
                self._disk_bytes -= old_size or 0
                if self._disk_capacity_bytes is not None:
                    self._make_disk_room(file_bytes)
                try:
                    os.replace(temporary, path)
                except OSError:
                    if old_size is not None:  # the old file is still in place
                        self._disk[entry.key] = old_size
                        self._disk_bytes += old_size
                    raise
                self._disk[entry.key] = file_bytes
                self._disk_bytes += file_bytes
        except OSError as error:  # a full disk, a read-only folder, an I/O error
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            with self._lock:
                self._disk_write_errors += 1
            logger.warning("document store: could not write %s (%s): not on disk", path, error)
            return False
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)
        return True

    def discard(self, key: str) -> None:
        """Forget `key` in RAM and delete its file (if any)."""
        with self._lock:
            self._drop_from_ram(key)
            self._forget_file(key)
            if self._directory is None or not _SAFE_KEY.fullmatch(key):
                return
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as error:
                logger.warning("document store: could not delete %s (%s)", path, error)
                return
        _fsync_directory(path.parent)

    def __contains__(self, key: object) -> bool:
        """In RAM or on disk (the file is not validated)."""
        with self._lock:
            return key in self._ram or key in self._disk

    def __len__(self) -> int:
        """Entries in RAM."""
        with self._lock:
            return len(self._ram)

    @property
    def stats(self) -> DocumentStoreStats:
        with self._lock:
            return DocumentStoreStats(
                hits=self._hits,
                misses=self._misses,
                ram_hits=self._ram_hits,
                disk_hits=self._disk_hits,
                stored_bytes=self._stored_bytes,
                disk_bytes=self._disk_bytes,
                num_entries=len(self._ram),
                num_disk_entries=len(self._disk),
                evictions=self._evictions,
                disk_write_errors=self._disk_write_errors,
                rejected_files=self._rejected_files,
                load_seconds_total=self._load_seconds_total,
                puts=self._puts,
                disk_evictions=self._disk_evictions,
                disk_lookups=self._disk_lookups,
                foreign_files=self._foreign_files,
                capacity_bytes=self._capacity_bytes,
                disk_capacity_bytes=(
                    0
                    if self._directory is None
                    else -1
                    if self._disk_capacity_bytes is None
                    else self._disk_capacity_bytes
                ),
            )
