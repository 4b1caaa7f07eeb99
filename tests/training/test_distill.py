import pytest

from ragspeed.training import distill


class _SlowTokenizerOnly:
    @staticmethod
    def from_pretrained(path):
        return object()  # not a PreTrainedTokenizerFast: no backend tokenizer to encode text with


def test_a_target_without_a_fast_tokenizer_is_refused_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "AutoTokenizer", _SlowTokenizerOnly)
    with pytest.raises(ValueError, match="distillation needs a fast tokenizer"):
        distill.distill_draft(tmp_path / "target", tmp_path / "out", data_dir=tmp_path, minutes=1.0)
