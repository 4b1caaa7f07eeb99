"""The document KV store: keys, the RAM LRU, and the disk tier's files (written here byte by
byte where a test needs a bad one; the torch side is the engine's test)."""

import errno
import json
import logging
import os
import struct
import subprocess
import sys
import threading

import pytest

from ragspeed.prompt_cache import document_store
from ragspeed.prompt_cache.document_store import (
    DocumentKV,
    DocumentStore,
    KVLayout,
    document_key,
    file_hmac,
    load_or_create_key,
)

FINGERPRINT = "bench-135m:abc"
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16")
PREFIX = (7,)
TOKENS = (11, 12, 13)


def payload(num_bytes: int, seed: int = 0) -> bytes:
    return bytes((seed + 31 * index) % 251 for index in range(num_bytes))


def make_entry(token_ids=TOKENS, *, salt=None, seed=0) -> DocumentKV:
    # [2, num_layers=1, num_tokens, num_kv_heads=1, head_dim=4] of float16: 16 bytes a token
    return DocumentKV(
        key=document_key(FINGERPRINT, salt, PREFIX, token_ids),
        token_ids=tuple(token_ids),
        start_position=len(PREFIX),
        dtype="float16",
        shape=(2, 1, len(token_ids), 1, 4),
        data=payload(16 * len(token_ids), seed),
    )


def file_of(directory, entry) -> os.PathLike:
    return directory / f"{entry.key}.kv"


def kv_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name != "server.key")


def read_kv_file(path):
    """(header, payload) of a `.kv` file, parsed by the format's definition."""
    raw = path.read_bytes()
    magic, version, header_length = struct.unpack("<8sII", raw[:16])
    assert (magic, version) == (b"RSDOCKV\x00", 2)
    offset = -(-(16 + header_length) // 64) * 64
    return json.loads(raw[16 : 16 + header_length]), raw[offset:]


def write_kv_file(path, header, data, *, version=2, secret=None):
    """A `.kv` file of `header`'s fields and `data` under an HMAC by `secret` (default: the
    folder's server key, so the file is what the server would have written)."""
    secret = (path.parent / "server.key").read_bytes() if secret is None else secret
    fields = {name: value for name, value in header.items() if name != "hmac"}
    body = json.dumps({**fields, "hmac": file_hmac(secret, fields, data)}).encode()
    head = struct.pack("<8sII", b"RSDOCKV\x00", version, len(body)) + body
    path.write_bytes(head + bytes(-len(head) % 64) + data)


@pytest.fixture
def saved(tmp_path):
    """One entry written to disk by a store of FINGERPRINT; returns (directory, entry)."""
    directory = tmp_path / "documents"
    entry = make_entry()
    assert fresh_store(directory).put(entry)
    return directory, entry


def fresh_store(directory, **options) -> DocumentStore:
    options = {"capacity_bytes": 1024, "layout": LAYOUT, **options}
    return DocumentStore(directory=directory, fingerprint=FINGERPRINT, **options)


# Keys.


def test_key_is_pinned_and_depends_on_each_part():
    key = document_key(FINGERPRINT, None, [7], [11, 12, 13])
    # The key names files on disk: changing its encoding orphans every stored document.
    assert key == "c660ad8d34e75a77bcc287cef70a46e50d1b37f3981862f7473d29fa8e92cf7c"
    assert document_key(FINGERPRINT, "", [7], [11, 12, 13]) == key  # empty salt is no salt
    assert document_key(FINGERPRINT, None, (7,), (11, 12, 13)) == key  # any sequence
    variants = {
        document_key("bench-135m:abd", None, [7], [11, 12, 13]),
        document_key(FINGERPRINT, "tenant-a", [7], [11, 12, 13]),
        document_key(FINGERPRINT, None, [8], [11, 12, 13]),
        document_key(FINGERPRINT, None, [], [11, 12, 13]),
        document_key(FINGERPRINT, None, [7], [11, 12, 14]),
        document_key(FINGERPRINT, None, [7], [11, 12]),
    }
    assert len(variants) == 6 and key not in variants


def test_key_parts_do_not_run_into_each_other():
    assert document_key("m", None, [1, 2], [3]) != document_key("m", None, [1], [2, 3])
    assert document_key("ab", "c", [], [1]) != document_key("a", "bc", [], [1])
    assert document_key("m", None, [], [1]) != document_key("m", None, [1], [])


def test_document_kv_checks_its_size():
    entry = make_entry()
    assert entry.num_bytes == 48
    assert DocumentKV("k", [1], 0, "float32", [3], b"\0" * 12).token_ids == (1,)  # made tuples
    with pytest.raises(ValueError, match="is 12 bytes, data is 11"):
        DocumentKV("k", (1,), 0, "float32", (3,), b"\0" * 11)
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        DocumentKV("k", (1,), 0, "float64", (3,), b"\0" * 24)
    with pytest.raises(ValueError, match="start_position"):
        DocumentKV("k", (1,), -1, "int8", (3,), b"\0" * 3)


# RAM tier.


def test_ram_round_trip_and_token_check():
    store = DocumentStore(capacity_bytes=1024)
    entry = make_entry()
    assert store.put(entry) is True
    assert store.get(entry.key, [11, 12, 13]) is entry
    assert store.get(entry.key, [11, 12, 99]) is None  # same key, other tokens: a collision
    assert entry.key in store and len(store) == 1
    stats = store.stats
    assert (stats.hits, stats.ram_hits, stats.disk_hits, stats.misses) == (1, 1, 0, 1)
    assert (stats.stored_bytes, stats.num_entries, stats.puts) == (48, 1, 1)
    assert stats.to_dict()["hit_rate"] == 0.5


def test_ram_lru_evicts_least_recently_used():
    store = DocumentStore(capacity_bytes=3 * 48)
    a, b, c, d = (make_entry((11, 12, seed)) for seed in (1, 2, 3, 4))
    for entry in (a, b, c):
        store.put(entry)
    assert store.get(a.key, a.token_ids) is a  # a becomes most recent: b is now the oldest
    store.put(d)
    assert [key in store for key in (a.key, b.key, c.key, d.key)] == [True, False, True, True]
    store.put(make_entry((11, 12, 5)))
    assert [key in store for key in (a.key, c.key, d.key)] == [True, False, True]
    assert (store.stats.stored_bytes, store.stats.evictions, len(store)) == (144, 2, 3)


def test_entry_larger_than_capacity_is_not_kept_in_ram():
    store = DocumentStore(capacity_bytes=47)
    entry = make_entry()
    assert store.put(entry) is False
    assert entry.key not in store and len(store) == 0
    assert store.get(entry.key, entry.token_ids) is None
    assert (store.stats.stored_bytes, store.stats.evictions) == (0, 0)


@pytest.mark.parametrize("as_view", [True, False])
def test_a_writable_buffer_is_copied(as_view):
    buffer = bytearray(payload(48))
    data = memoryview(buffer) if as_view else buffer
    entry = DocumentKV(make_entry().key, TOKENS, 1, "float16", (2, 1, 3, 1, 4), data)
    store = DocumentStore(capacity_bytes=1024)
    store.put(entry)
    buffer[0] ^= 0xFF
    assert bytes(store.get(entry.key, TOKENS).data) == payload(48)


def test_thousand_documents_through_a_small_budget():
    store = DocumentStore(capacity_bytes=1 << 20)
    data = bytes(64 << 10)
    keys = []
    for index in range(1000):
        key = document_key(FINGERPRINT, None, PREFIX, [index])
        keys.append(key)
        store.put(DocumentKV(key, (index,), 1, "uint8", (64 << 10,), data))
        assert store.stats.stored_bytes <= 1 << 20
    assert len(store) == 16 and store.stats.stored_bytes == 1 << 20
    assert store.stats.evictions == 984
    assert [key in store for key in keys[983:985]] == [False, True]


def test_salt_separates_tenants():
    store = DocumentStore(capacity_bytes=1024)
    entry = make_entry(salt="a")
    store.put(entry)
    other_key = document_key(FINGERPRINT, "b", PREFIX, TOKENS)
    assert other_key != entry.key and other_key not in store
    assert store.get(other_key, TOKENS) is None
    assert store.get(entry.key, TOKENS) is entry


def test_unsafe_key_is_refused():
    entry = DocumentKV("../escape", (1,), 0, "int8", (1,), b"\0")
    with pytest.raises(ValueError, match="not a safe file name"):
        DocumentStore(capacity_bytes=1024).put(entry)


# Disk tier.


def test_disk_round_trip_through_a_fresh_store(saved):
    directory, entry = saved
    assert kv_files(directory) == [f"{entry.key}.kv"]  # no temporary file left
    header, data = read_kv_file(file_of(directory, entry))
    assert data == entry.data
    assert (header["token_ids"], header["start_position"], header["shape"]) == (
        [11, 12, 13],
        1,
        [2, 1, 3, 1, 4],
    )
    file_bytes = os.path.getsize(file_of(directory, entry))
    assert (file_bytes - 48) % 64 == 0  # the payload starts on a 64-byte boundary

    store = fresh_store(directory)
    assert (store.stats.num_disk_entries, store.stats.disk_bytes, len(store)) == (1, file_bytes, 0)
    assert entry.key in store
    loaded = store.get(entry.key, [11, 12, 13])
    assert isinstance(loaded.data, memoryview) and loaded.data.readonly
    assert bytes(loaded.data) == entry.data
    assert (loaded.key, loaded.token_ids, loaded.start_position) == (entry.key, TOKENS, 1)
    assert (loaded.dtype, loaded.shape, loaded.num_bytes) == ("float16", (2, 1, 3, 1, 4), 48)
    assert store.get(entry.key, TOKENS) is loaded  # promoted into RAM
    stats = store.stats
    assert (stats.hits, stats.disk_hits, stats.ram_hits, stats.stored_bytes, len(store)) == (2, 1, 1, 48, 1)
    assert stats.load_seconds_total > 0


def test_ram_tier_off_serves_from_disk(tmp_path):
    store = DocumentStore(capacity_bytes=0, directory=tmp_path, fingerprint=FINGERPRINT)
    entry = make_entry()
    assert store.put(entry) is True
    assert len(store) == 0 and entry.key in store
    assert bytes(store.get(entry.key, TOKENS).data) == entry.data
    assert (store.stats.disk_hits, store.stats.stored_bytes, len(store)) == (1, 0, 0)


@pytest.mark.parametrize("keep_bytes, reason", [(-10, "truncated"), (5, "truncated")])
def test_truncated_file_is_rejected_and_removed(saved, caplog, keep_bytes, reason):
    directory, entry = saved
    path = file_of(directory, entry)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep_bytes])
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists()
    assert (store.stats.rejected_files, store.stats.misses, store.stats.num_disk_entries) == (1, 1, 0)
    assert store.stats.disk_bytes == 0 and entry.key not in store
    assert f"{entry.key}.kv" in caplog.text and reason in caplog.text


def test_flipped_payload_byte_is_rejected(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(raw)
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and store.stats.rejected_files == 1
    assert "HMAC does not verify" in caplog.text


def test_tampered_header_is_rejected(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    raw = path.read_bytes()
    assert raw.count(b'"start_position": 1') == 1
    path.write_bytes(raw.replace(b'"start_position": 1', b'"start_position": 2'))
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and store.stats.rejected_files == 1
    assert "HMAC does not verify" in caplog.text


def test_bad_magic_is_rejected(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    path.write_bytes(b"NOTAKV\x00\x00" + path.read_bytes()[8:])
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and "bad magic" in caplog.text


@pytest.mark.parametrize(
    "changes, version, reason",
    [
        ({"shape": [2, 1, 3, 1, 5]}, 2, "wrong shape"),
        ({"dtype": "float64"}, 2, "unknown dtype 'float64'"),
        ({"dtype": "float32"}, 2, "wrong shape"),
        ({"payload_bytes": 40}, 2, "shape mismatch"),
        ({"key": "0" * 64}, 2, "not its file name's"),
        ({"token_ids": "11,12,13"}, 2, "header fields malformed"),
        ({}, 1, "format version 1, expected 2"),
    ],
)
def test_inconsistent_file_is_rejected(saved, caplog, changes, version, reason):
    directory, entry = saved
    path = file_of(directory, entry)
    header, data = read_kv_file(path)
    write_kv_file(path, {**header, **changes}, data, version=version)
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and store.stats.rejected_files == 1
    assert reason in caplog.text


def test_payload_length_differs_from_header(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    header, data = read_kv_file(path)
    write_kv_file(path, {**header, "shape": [2, 1, 4, 1, 4], "payload_bytes": 64}, data)
    store = fresh_store(directory, layout=None)  # the layout would refuse the shape first
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and "truncated" in caplog.text
    write_kv_file(path, header, data + b"\0")
    with caplog.at_level(logging.WARNING):
        assert fresh_store(directory).get(entry.key, TOKENS) is None
    assert not path.exists() and "1 trailing bytes" in caplog.text


def test_file_of_another_model_is_refused_kept_and_logged_once(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    # A store of another model sharing the folder (its key file too), finding the file under
    # the name it looks for.
    store = DocumentStore(capacity_bytes=1024, directory=directory, fingerprint="other-model:123")
    with caplog.at_level(logging.INFO):
        assert store.get(entry.key, TOKENS) is None
        assert store.get(entry.key, TOKENS) is None  # not read again
    assert path.exists() and entry.key not in store
    stats = store.stats
    assert (stats.misses, stats.rejected_files, stats.foreign_files, stats.disk_lookups) == (2, 0, 1, 1)
    assert caplog.text.count("another model") == 1
    assert bytes(fresh_store(directory).get(entry.key, TOKENS).data) == entry.data


def test_token_id_mismatch_on_disk_is_a_miss_and_keeps_the_file(saved):
    directory, entry = saved
    store = fresh_store(directory)
    assert store.get(entry.key, [11, 12, 99]) is None
    assert file_of(directory, entry).exists()
    assert (store.stats.misses, store.stats.rejected_files, store.stats.num_disk_entries) == (1, 0, 1)
    assert store.get(entry.key, TOKENS) is not None


def test_stale_temporary_files_are_removed_at_start(tmp_path):
    stale = tmp_path / f".{'a' * 64}.kv.{'0' * 32}.tmp"
    stale.write_bytes(b"half a document")
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_bytes(b"someone else's")
    store = DocumentStore(capacity_bytes=1024, directory=tmp_path, fingerprint=FINGERPRINT)
    assert not stale.exists() and unrelated.exists()
    assert (store.stats.num_disk_entries, store.stats.disk_bytes) == (0, 0)


def test_directory_is_created(tmp_path):
    DocumentStore(capacity_bytes=0, directory=tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_full_disk_keeps_the_ram_copy(tmp_path, monkeypatch, caplog, failing):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = DocumentStore(capacity_bytes=1024, directory=tmp_path, fingerprint=FINGERPRINT)
    entry = make_entry()
    monkeypatch.setattr(document_store.os, failing, no_space)
    with caplog.at_level(logging.WARNING):
        assert store.put(entry) is False
    monkeypatch.undo()
    assert kv_files(tmp_path) == []  # no partial or temporary file
    assert store.get(entry.key, TOKENS) is entry
    stats = store.stats
    assert (stats.disk_write_errors, stats.num_disk_entries, stats.disk_bytes) == (1, 0, 0)
    assert "No space left on device" in caplog.text
    assert store.put(entry) is True  # the disk has room again


def test_disk_budget_evicts_least_recently_used_files(tmp_path):
    probe = DocumentStore(capacity_bytes=0, directory=tmp_path / "probe", fingerprint=FINGERPRINT)
    a, b, c = (make_entry((11, 12, seed)) for seed in (21, 22, 23))
    probe.put(a)
    file_bytes = probe.stats.disk_bytes  # the same for a, b and c (same lengths)

    store = DocumentStore(
        capacity_bytes=1024,
        directory=tmp_path / "kv",
        fingerprint=FINGERPRINT,
        disk_capacity_bytes=2 * file_bytes,
    )
    store.put(a)
    store.put(b)
    assert store.get(a.key, a.token_ids) is a  # a RAM hit makes a's file recent too
    store.put(c)
    assert kv_files(tmp_path / "kv") == sorted(f"{entry.key}.kv" for entry in (a, c))
    stats = store.stats
    assert (stats.disk_evictions, stats.num_disk_entries, stats.disk_bytes) == (1, 2, 2 * file_bytes)
    # RAM and disk have their own budgets: b's file is gone, its RAM copy is still served.
    assert store.get(b.key, b.token_ids) is b and stats.evictions == 0


def test_files_found_at_start_are_oldest_by_mtime(tmp_path):
    a, b, c = (make_entry((11, 12, seed)) for seed in (21, 22, 23))
    writer = DocumentStore(capacity_bytes=0, directory=tmp_path, fingerprint=FINGERPRINT)
    writer.put(a)
    writer.put(b)
    file_bytes = writer.stats.disk_bytes // 2
    os.utime(file_of(tmp_path, a), ns=(2_000_000_000, 2_000_000_000))
    os.utime(file_of(tmp_path, b), ns=(1_000_000_000, 1_000_000_000))  # b is older
    store = DocumentStore(
        capacity_bytes=0, directory=tmp_path, fingerprint=FINGERPRINT, disk_capacity_bytes=2 * file_bytes
    )
    assert store.put(c) is True
    assert [file_of(tmp_path, entry).exists() for entry in (a, b, c)] == [True, False, True]
    assert store.stats.disk_evictions == 1


def test_file_larger_than_the_disk_budget_is_not_written(tmp_path):
    store = DocumentStore(
        capacity_bytes=1024, directory=tmp_path, fingerprint=FINGERPRINT, disk_capacity_bytes=64
    )
    entry = make_entry()
    assert store.put(entry) is False
    assert kv_files(tmp_path) == [] and store.get(entry.key, TOKENS) is entry
    assert store.stats.disk_write_errors == 0


def test_discard_forgets_ram_and_file(saved):
    directory, entry = saved
    store = fresh_store(directory)
    store.put(entry)
    store.discard(entry.key)
    assert entry.key not in store and not file_of(directory, entry).exists()
    assert (len(store), store.stats.stored_bytes, store.stats.num_disk_entries, store.stats.disk_bytes) == (
        0,
        0,
        0,
        0,
    )
    store.discard(entry.key)  # discarding twice is fine


def test_imports_neither_torch_nor_numpy():
    code = "import sys, ragspeed.prompt_cache.document_store; print('torch' in sys.modules, 'numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False False"


def test_stats_can_be_read_from_another_thread(tmp_path):
    store = DocumentStore(capacity_bytes=4 * 48, directory=tmp_path, fingerprint=FINGERPRINT)
    entries = [make_entry((11, 12, seed)) for seed in range(20)]
    done = threading.Event()
    snapshots = []

    def read_stats():
        while not done.is_set():
            snapshots.append(store.stats)

    reader = threading.Thread(target=read_stats)
    reader.start()
    try:
        for entry in entries:
            store.put(entry)
        for entry in entries:
            assert bytes(store.get(entry.key, entry.token_ids).data) == entry.data
    finally:
        done.set()
        reader.join()
    assert snapshots and all(snapshot.stored_bytes <= 4 * 48 for snapshot in snapshots)
    stats = store.stats
    assert (stats.puts, stats.hits, stats.num_disk_entries, len(store)) == (20, 20, 20, 4)


# Keyed integrity, layout, and the disk tier's budget across restarts.


def test_forged_file_is_refused(saved, caplog):
    """Payload changed and the HMAC recomputed by someone who can write the folder, not read the key."""
    directory, entry = saved
    path = file_of(directory, entry)
    header, data = read_kv_file(path)
    forged = bytes(48)  # another tenant's KV, say
    write_kv_file(path, header, forged, secret=b"guessed key of 32 bytes, not it!")
    store = fresh_store(directory)
    with caplog.at_level(logging.WARNING):
        assert store.get(entry.key, TOKENS) is None
    assert not path.exists() and store.stats.rejected_files == 1
    assert caplog.text.count("HMAC does not verify under the server key") == 1
    # The same bytes under the server key would have been served: only the HMAC refused it.
    write_kv_file(path, header, forged)
    assert bytes(fresh_store(directory).get(entry.key, TOKENS).data) == forged


def test_store_under_another_key_refuses_the_files(saved):
    directory, entry = saved
    store = fresh_store(directory, secret=b"another server's key, 32 bytes.")
    assert store.get(entry.key, TOKENS) is None and store.stats.rejected_files == 1


def test_shape_is_checked_against_the_tokens_and_the_layout(saved, caplog):
    directory, entry = saved
    path = file_of(directory, entry)
    header, data = read_kv_file(path)
    # The same 48 bytes and a valid HMAC, but not [2, layers, 3 tokens, heads, head_dim].
    write_kv_file(path, {**header, "shape": [2, 1, 1, 1, 12]}, data)
    with caplog.at_level(logging.WARNING):
        assert fresh_store(directory).get(entry.key, TOKENS) is None
    assert not path.exists()
    assert (
        "wrong shape: shape [2, 1, 1, 1, 12] of float16 is not the KV of 3 tokens ([2, 1, 3, 1, 4]"
        in caplog.text
    )
    store = fresh_store(directory)
    with pytest.raises(ValueError, match="is not the KV of 3 tokens"):
        store.put(DocumentKV(entry.key, TOKENS, 1, "float16", (2, 1, 1, 1, 12), entry.data))
    with pytest.raises(ValueError, match="of float32 is not the KV"):
        store.put(DocumentKV(entry.key, TOKENS, 1, "float32", (2, 1, 3, 1, 2), entry.data))


def test_key_file_is_private_and_kept(tmp_path, caplog):
    path = tmp_path / "server.key"
    key = load_or_create_key(path)
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert load_or_create_key(path) == key
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING):
        assert load_or_create_key(path) == key
    assert os.stat(path).st_mode & 0o777 == 0o600 and "made 0600" in caplog.text
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="32 bytes, found 5"):
        load_or_create_key(path)
    fresh_store(tmp_path / "kv")
    assert os.stat(tmp_path / "kv" / "server.key").st_mode & 0o777 == 0o600


def test_disk_tier_never_exceeds_its_budget_and_evicts_least_recently_used(tmp_path):
    entries = [make_entry((11, 12, seed)) for seed in range(10)]
    probe = fresh_store(tmp_path / "probe", capacity_bytes=0)
    probe.put(entries[0])
    file_bytes = probe.stats.disk_bytes  # the same for every entry (same lengths)
    budget = 3 * file_bytes + file_bytes // 2
    directory = tmp_path / "kv"
    store = DocumentStore(
        capacity_bytes=0,
        directory=directory,
        fingerprint=FINGERPRINT,
        layout=LAYOUT,
        disk_capacity_bytes=budget,
    )

    def on_disk() -> list[int]:
        names = set(kv_files(directory))
        return [i for i, e in enumerate(entries) if f"{e.key}.kv" in names]

    for index, entry in enumerate(entries):
        assert store.put(entry)
        if index == 4:
            assert on_disk() == [2, 3, 4]
            assert store.get(entries[2].key, entries[2].token_ids) is not None  # 2 used: 3 is oldest
        sizes = sum(os.path.getsize(directory / name) for name in kv_files(directory))
        assert sizes == store.stats.disk_bytes <= budget
    assert on_disk() == [7, 8, 9]
    assert store.stats.disk_evictions == 7
    store.put(entries[5])  # 5 again, after it was evicted; 7 goes
    assert on_disk() == [5, 8, 9]


def test_restart_reuses_the_disk_tier_in_its_order_of_use(tmp_path):
    a, b, c = (make_entry((11, 12, seed)) for seed in (21, 22, 23))
    first = fresh_store(tmp_path, capacity_bytes=0)
    first.put(a)
    first.put(b)
    file_bytes = first.stats.disk_bytes // 2
    os.utime(file_of(tmp_path, a), ns=(1_000_000_000, 1_000_000_000))
    os.utime(file_of(tmp_path, b), ns=(2_000_000_000, 2_000_000_000))
    assert bytes(first.get(a.key, a.token_ids).data) == a.data  # a used last: its mtime is now
    assert os.stat(file_of(tmp_path, a)).st_mtime_ns > 2_000_000_000

    restarted = fresh_store(tmp_path, capacity_bytes=0, disk_capacity_bytes=2 * file_bytes)
    assert (restarted.stats.num_disk_entries, restarted.stats.disk_bytes) == (2, 2 * file_bytes)
    found = restarted.find(b.key, b.token_ids)
    assert (found.tier, bytes(found.entry.data)) == ("disk", b.data)  # b used last now
    restarted.put(c)
    assert [file_of(tmp_path, e).exists() for e in (a, b, c)] == [False, True, True]


def test_hit_rates_and_bytes_by_tier(tmp_path):
    a, b = make_entry((11, 12, 1)), make_entry((11, 12, 2))
    fresh_store(tmp_path).put(a)
    store = fresh_store(tmp_path, capacity_bytes=1024, disk_capacity_bytes=4096)
    assert store.find(a.key, a.token_ids).tier == "disk"
    assert store.find(a.key, a.token_ids).tier == "ram"
    assert store.find(b.key, b.token_ids) is None  # not on disk: no disk lookup
    stats = store.stats.to_dict()
    file_bytes = os.path.getsize(file_of(tmp_path, a))
    assert {k: stats[k] for k in ("hits", "misses", "ram_hits", "disk_hits", "disk_lookups")} == {
        "hits": 2,
        "misses": 1,
        "ram_hits": 1,
        "disk_hits": 1,
        "disk_lookups": 1,
    }
    assert (stats["hit_rate"], stats["ram_hit_rate"], stats["disk_hit_rate"]) == (2 / 3, 1 / 3, 1.0)
    assert (stats["stored_bytes"], stats["disk_bytes"]) == (48, file_bytes)
    assert (stats["capacity_bytes"], stats["disk_capacity_bytes"]) == (1024, 4096)
    assert DocumentStore(capacity_bytes=8).stats.disk_capacity_bytes == 0
