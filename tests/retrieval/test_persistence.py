import pytest

from ragspeed.retrieval.errors import CorruptCollectionError
from ragspeed.retrieval.persistence import MAGIC, load_collection_file, save_collection_file


def test_roundtrip_and_no_temp_files_left(tmp_path):
    path = tmp_path / "c.ragcoll"
    size = save_collection_file(path, {"name": "c", "n": 1}, b"\x01\x02\x03")
    assert size == path.stat().st_size == len(MAGIC) + 20 + len(b'{"name":"c","n":1}') + 3 + 32
    assert load_collection_file(path) == ({"name": "c", "n": 1}, b"\x01\x02\x03")
    save_collection_file(path, {"name": "c", "n": 2}, b"")  # replaces atomically
    assert load_collection_file(path) == ({"name": "c", "n": 2}, b"")
    assert [p.name for p in tmp_path.iterdir()] == ["c.ragcoll"]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:-1], "length mismatch"),
        (lambda b: b[:10], "bad magic or truncated"),
        (lambda b: b"X" + b[1:], "bad magic or truncated"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "checksum mismatch"),
        (lambda b: b[:19] + b"\x09" + b[20:], "format version 9"),
    ],
)
def test_corrupt_files_are_refused_with_the_reason(tmp_path, damage, reason):
    path = tmp_path / "c.ragcoll"
    save_collection_file(path, {"name": "c"}, b"index-bytes")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptCollectionError, match=reason) as info:
        load_collection_file(path)
    assert info.value.param == "collection"
    assert str(path) in info.value.message
