"""Persisted prefixes with JSON standing in for safetensors (the torch round trip is the
engine's test)."""

import json
import logging

import pytest

from ragspeed.prompt_cache.store import (
    PromptRecord,
    delete_prefix,
    delete_record,
    list_saved_prefixes,
    load_prefix,
    load_records,
    prefix_path,
    record_path,
    remove_temporaries,
    save_prefix,
    save_record,
    sidecar_path,
)

FINGERPRINT = {"model": "bench-135m:abc", "tokenizer": "tok:def", "block_size": 16}
TENSORS = {"layer0.k": [[0.5, 1.5]], "layer0.v": [[2.0, 3.0]]}


def write_json(path, tensors):
    path.write_text(json.dumps(tensors))


def read_json(path):
    return json.loads(path.read_text())


@pytest.fixture
def saved(tmp_path):
    path = prefix_path(tmp_path / "prefixes", "support")
    save_prefix(
        path,
        name="support",
        token_ids=(1, 2, 3),
        fingerprint=FINGERPRINT,
        tensors=TENSORS,
        write_tensors=write_json,
    )
    return path


def test_round_trip(saved):
    assert saved.name == "support.safetensors"
    loaded = load_prefix(saved, dict(FINGERPRINT), read_tensors=read_json)
    assert loaded.name == "support"
    assert loaded.token_ids == (1, 2, 3)
    assert loaded.fingerprint == FINGERPRINT
    assert loaded.tensors == TENSORS
    assert list_saved_prefixes(saved.parent) == [saved]
    assert sorted(p.name for p in saved.parent.iterdir()) == [
        "support.safetensors",
        "support.safetensors.json",
    ]  # no temporary files left


def test_changed_model_or_tokenizer_is_refused(saved, caplog):
    with caplog.at_level(logging.WARNING):
        changed = {**FINGERPRINT, "tokenizer": "tok:new"}
        assert load_prefix(saved, changed, read_tensors=read_json) is None
    assert "fingerprint mismatch" in caplog.text


def test_corrupt_tensor_file_is_refused(saved, caplog):
    saved.write_text(saved.read_text().replace("0.5", "0.7"))
    with caplog.at_level(logging.WARNING):
        assert load_prefix(saved, FINGERPRINT, read_tensors=read_json) is None
    assert "tensor file checksum mismatch" in caplog.text


def test_edited_sidecar_is_refused(saved, caplog):
    sidecar = json.loads(sidecar_path(saved).read_text())
    sidecar["token_ids"] = [1, 2, 4]
    sidecar_path(saved).write_text(json.dumps(sidecar))
    with caplog.at_level(logging.WARNING):
        assert load_prefix(saved, FINGERPRINT, read_tensors=read_json) is None
    assert "sidecar checksum mismatch" in caplog.text


@pytest.mark.parametrize("garbage", ["", "{not json", "[]", '{"checksum": 1}'])
def test_unreadable_sidecar_is_refused(saved, garbage, caplog):
    sidecar_path(saved).write_text(garbage)
    with caplog.at_level(logging.WARNING):
        assert load_prefix(saved, FINGERPRINT, read_tensors=read_json) is None
    assert "refusing saved prefix" in caplog.text


def test_failing_reader_and_missing_files_return_none(saved, tmp_path):
    def broken_reader(path):
        raise RuntimeError("truncated header")

    assert load_prefix(saved, FINGERPRINT, read_tensors=broken_reader) is None
    missing = tmp_path / "nothing.safetensors"
    assert load_prefix(missing, FINGERPRINT, read_tensors=read_json) is None
    saved.unlink()
    assert load_prefix(saved, FINGERPRINT, read_tensors=read_json) is None


def test_a_failed_write_leaves_the_previous_prefix_intact(saved):
    def failing_writer(path, tensors):
        path.write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_prefix(
            saved,
            name="support",
            token_ids=(9,),
            fingerprint=FINGERPRINT,
            tensors={},
            write_tensors=failing_writer,
        )
    assert load_prefix(saved, FINGERPRINT, read_tensors=read_json).token_ids == (1, 2, 3)
    assert len(list(saved.parent.iterdir())) == 2


def test_delete_and_name_validation(saved, tmp_path):
    delete_prefix(saved)
    assert list_saved_prefixes(saved.parent) == []
    delete_prefix(saved)  # idempotent
    with pytest.raises(ValueError, match="name"):
        prefix_path(tmp_path, "../escape")


def test_records_round_trip_and_bad_ones_are_refused(saved, caplog):
    directory = saved.parent
    save_record(directory, PromptRecord("support", "Be brief.", "tenant-a"))
    save_record(directory, PromptRecord("plain", "Cite documents."))
    assert list_saved_prefixes(directory) == [saved]  # records are not prefixes
    assert load_records(directory) == [
        PromptRecord("plain", "Cite documents."),
        PromptRecord("support", "Be brief.", "tenant-a"),
    ]
    edited = json.loads(record_path(directory, "plain").read_text())
    edited["text"] = "Cite nothing."
    record_path(directory, "plain").write_text(json.dumps(edited))
    record_path(directory, "moved").write_text(record_path(directory, "support").read_text())
    with caplog.at_level(logging.WARNING, logger="ragspeed.prompt_cache.store"):
        assert load_records(directory) == [PromptRecord("support", "Be brief.", "tenant-a")]
    assert "plain.prompt.json: checksum mismatch" in caplog.text
    assert "moved.prompt.json: the record names 'support'" in caplog.text
    delete_record(directory, "support")
    delete_record(directory, "support")  # idempotent
    assert not record_path(directory, "support").exists()


def test_remove_temporaries(saved):
    (saved.parent / ".support.safetensors.ab12.tmp").write_text("half")
    (saved.parent / "keep.tmp").write_text("not ours")
    assert remove_temporaries(saved.parent) == 1
    assert remove_temporaries(saved.parent / "absent") == 0
    assert sorted(p.name for p in saved.parent.iterdir()) == [
        "keep.tmp",
        "support.safetensors",
        "support.safetensors.json",
    ]
