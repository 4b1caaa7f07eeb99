"""Pinned prefixes saved to safetensors and restored into a fresh engine: no prefill paid, same
greedy tokens; a changed model or tokenizer, a corrupt file or a KV of another shape is refused
with a log line, and the prompt's record stays; temporaries of interrupted writes are removed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
import torch

from ragspeed.engine.native.core.prefix_store import (
    PinnedPrefix,
    PrefixStore,
    WeightHashes,
    engine_fingerprint,
    export_kv,
    pin_prefix,
    restore_prefix,
)
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from ragspeed.prompt_cache.store import PromptRecord, load_records
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = tuple(range(20, 62))  # 42 tokens: 5 full blocks of 8


def _save(engine, directory, name="support", salt=None, *, record=True):
    engine.generate([GenerationRequest("warm", PREFIX + (5,), GREEDY, cache_salt=salt)])
    block_ids = pin_prefix(engine, PREFIX, salt)
    store = PrefixStore(directory, engine_fingerprint(engine))
    if record:
        store.save_record(PromptRecord(name, "the text", salt))
    store.save(PinnedPrefix(name, PREFIX, block_ids, "the text", salt), export_kv(engine, block_ids))
    return store, block_ids


def _records_only(store):
    """load_all() as (record, has usable KV) pairs."""
    return [(saved.record, saved.kv is not None) for saved in store.load_all()]


def test_restored_prefix_is_a_hit_with_the_same_tokens(tiny_checkpoints, tmp_path):
    source = make_engine(tiny_checkpoints["llama"])
    _, block_ids = _save(source, tmp_path, salt="tenant-a")
    assert len(block_ids) == 5
    expected = source.generate([GenerationRequest("e", PREFIX + (7, 8), GREEDY)])["e"]["token_ids"]

    fresh = make_engine(tiny_checkpoints["llama"])
    store = PrefixStore(tmp_path, engine_fingerprint(fresh))
    [saved] = store.load_all()
    assert saved.record == PromptRecord("support", "the text", "tenant-a") and saved.token_ids == PREFIX
    kv = saved.kv
    assert tuple(kv.shape) == (2, 2, 5, 8, 2, 16)
    pinned = restore_prefix(fresh, saved.token_ids, kv, "tenant-a")
    assert len(pinned) == 5 and fresh.manager.num_pinned_blocks == 5
    fresh.manager.check_invariants()

    computed = []
    execute = fresh.runner.execute
    fresh.runner.execute = lambda out: (computed.append(out.num_tokens), execute(out))[1]
    out = fresh.generate([GenerationRequest("r", PREFIX + (7, 8), GREEDY, cache_salt="tenant-a")])["r"]
    assert out["num_cached_tokens"] == 40
    assert computed[0] == 4  # only 44 - 40 prompt tokens prefilled
    # Salted KV equals unsalted KV (the salt only changes hashes), so the tokens agree.
    assert out["token_ids"] == expected
    # Another tenant does not hit the restored blocks.
    other = fresh.generate([GenerationRequest("o", PREFIX + (7, 8), GREEDY, cache_salt="tenant-b")])["o"]
    assert other["num_cached_tokens"] == 0


def test_changed_model_or_corrupt_file_is_refused_with_a_log_line(tiny_checkpoints, tmp_path, caplog):
    source = make_engine(tiny_checkpoints["llama"])
    _save(source, tmp_path)
    record = PromptRecord("support", "the text")
    other_model = make_engine(tiny_checkpoints["mistral"], block_size=8)
    with caplog.at_level(logging.WARNING, logger="ragspeed.prompt_cache.store"):
        assert _records_only(PrefixStore(tmp_path, engine_fingerprint(other_model))) == [(record, False)]
    assert "fingerprint mismatch" in caplog.text

    fingerprint = engine_fingerprint(source)
    assert _records_only(PrefixStore(tmp_path, {**fingerprint, "tokenizer": "0" * 64})) == [(record, False)]

    tensor_file = tmp_path / "support.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-5] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ragspeed.prompt_cache.store"):
        assert _records_only(PrefixStore(tmp_path, fingerprint)) == [(record, False)]
    assert "checksum mismatch" in caplog.text


def test_a_kv_of_another_shape_is_refused_not_a_crash(tiny_checkpoints, tmp_path, caplog):
    engine = make_engine(tiny_checkpoints["llama"])
    store, block_ids = _save(engine, tmp_path)
    # Checksums and fingerprint intact, the tensor of another layout: refused at load...
    wrong = export_kv(engine, block_ids)[:, :, :, :4]
    store.save(PinnedPrefix("support", PREFIX, block_ids, "the text"), wrong)
    with caplog.at_level(logging.WARNING, logger="ragspeed.engine.native.core.prefix_store"):
        assert _records_only(store) == [(PromptRecord("support", "the text"), False)]
    assert "KV of shape [2, 2, 5, 4, 2, 16]" in caplog.text
    # ...and at restore, a ValueError that leaves the pool as it was.
    fresh = make_engine(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="does not fit this engine"):
        restore_prefix(fresh, PREFIX, wrong, None)
    with pytest.raises(ValueError, match="KV of 40 tokens for 8 token ids"):
        restore_prefix(fresh, PREFIX[:8], export_kv(engine, block_ids), None)
    assert fresh.manager.num_pinned_blocks == 0
    fresh.manager.check_invariants()


def test_temporaries_are_removed_and_prefixes_without_a_record_adopted(tiny_checkpoints, tmp_path, caplog):
    engine = make_engine(tiny_checkpoints["llama"])
    store, _ = _save(engine, tmp_path, name="legacy", record=False)  # saved before records existed
    (tmp_path / ".legacy.safetensors.0a1b.tmp").write_bytes(b"half a tensor file")
    (tmp_path / ".other.prompt.json.2c3d.tmp").write_text("{")
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.core.prefix_store"):
        [saved] = store.load_all()
    assert saved.record == PromptRecord("legacy", "the text") and saved.kv is not None
    assert "removed 2 temporary file(s)" in caplog.text
    assert load_records(tmp_path) == [PromptRecord("legacy", "the text")]
    assert not list(tmp_path.glob(".*"))
    store.delete("legacy")
    assert list(tmp_path.iterdir()) == []


def test_restore_with_no_room_returns_none_and_changes_nothing(tiny_checkpoints, tmp_path):
    engine = make_engine(tiny_checkpoints["llama"], num_kv_cache_tokens=256, max_model_len=240)
    engine.add_request(GenerationRequest("hog", tuple(range(100, 300)), GREEDY))
    engine.step()  # 200 tokens hold 25 of the 32 blocks
    kv = torch.zeros(2, 2, 10, 8, 2, 16)
    assert restore_prefix(engine, tuple(range(80)), kv, None) is None
    engine.manager.check_invariants()


def test_weight_hashes_read_the_whole_file_once(tmp_path):
    weights = tmp_path / "model.safetensors"
    data = bytearray(range(256)) * (3 * 4096)  # 3 MiB: the old fingerprint read 1 MiB at each end
    weights.write_bytes(bytes(data))
    hashes = WeightHashes(tmp_path / "cache" / "weight-sha256.json")
    first = hashes.sha256(weights)
    assert first == hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(5_000_000_000, 5_000_000_000))
    second = hashes.sha256(weights)
    assert second == hashlib.sha256(data).hexdigest() != first
    # Kept by (path, size, mtime): a later start takes it from the cache file, reading no weights.
    kept = json.loads((tmp_path / "cache" / "weight-sha256.json").read_text())
    assert kept == {str(weights.resolve()): {"size": 3 << 20, "mtime_ns": 5_000_000_000, "sha256": second}}
    kept[str(weights.resolve())]["sha256"] = "from the cache"
    (tmp_path / "cache" / "weight-sha256.json").write_text(json.dumps(kept))
    assert WeightHashes(tmp_path / "cache" / "weight-sha256.json").sha256(weights) == "from the cache"


def test_fingerprint_covers_the_weights_middle_and_the_prefill_precision(tiny_checkpoints, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama"], model_dir)
    engine = make_engine(model_dir)
    hashes = WeightHashes(tmp_path / "weight-sha256.json")
    before = engine_fingerprint(engine, hashes)
    assert before["model_dtype"] == "torch.float32"
    assert before["prefill"] == (None if engine.prefill_choice is None else engine.prefill_choice.name)
    [weights] = model_dir.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # a weight in the middle of the file, the size unchanged
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(7_000_000_000, 7_000_000_000))
    after = engine_fingerprint(engine, hashes)
    assert after["model"] != before["model"]
    assert {k: v for k, v in after.items() if k != "model"} == {
        k: v for k, v in before.items() if k != "model"
    }
