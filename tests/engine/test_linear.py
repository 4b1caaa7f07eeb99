"""The dense linear kind (engine.models.linear): column slices per CPU thread, any shape."""

from __future__ import annotations

import pytest
import torch

from engine.model_runner import cpu_threads
from engine.models.linear import DenseLinear


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_sliced_weight_computes_x_at_w_transposed(threads, bias, num_tokens):
    gen = torch.Generator().manual_seed(threads * 10 + num_tokens)
    weight = torch.randn(7, 12, generator=gen)  # 7 columns: slices of 7, 4+3 (padded), 3+3+1
    b = torch.randn(7, generator=gen) if bias else None
    x = torch.randn(num_tokens, 12, generator=gen)
    layer = DenseLinear(12, 7, bias)
    with cpu_threads(threads):
        layer.load(weight, b)
        out = layer(x)
    assert layer.num_partitions == threads
    assert out.shape == (num_tokens, 7)
    expected = x @ weight.T + (0 if b is None else b)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert layer.num_weight_bytes == 7 * 12 * 4  # the padding is not read as weight bytes


def test_more_threads_than_columns_gives_one_column_each():
    layer = DenseLinear(4, 2, bias=False)
    with cpu_threads(3):
        layer.load(torch.eye(2, 4))
    assert layer.num_partitions == 2
    torch.testing.assert_close(layer(torch.arange(4.0).unsqueeze(0)), torch.tensor([[0.0, 1.0]]))


def test_wrong_weight_shape_is_refused():
    with pytest.raises(ValueError, match=r"does not fit a linear 12 -> 7"):
        DenseLinear(12, 7, bias=False).load(torch.zeros(12, 7))


def test_cpu_threads_restores_the_previous_count():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
