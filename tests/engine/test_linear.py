"""The dense linear kind (engine.native.models.linear): ragspeed's blocked kernel for a few rows and
oneDNN-packed weights on CPU, `mm` elsewhere."""

from __future__ import annotations

import pytest
import torch

from ragspeed.engine.native.compute.cpu_kernels import blocked_kernels_available
from ragspeed.engine.native.compute.threads import cpu_threads
from ragspeed.engine.native.models import linear as linear_module
from ragspeed.engine.native.models.linear import DenseLinear


@pytest.fixture(params=["blocked", "onednn", "mm"])
def kind(request, monkeypatch):
    if request.param == "blocked" and not blocked_kernels_available(torch.device("cpu")):
        pytest.skip("ragspeed's CPU kernels could not be built here")
    if request.param != "mm" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if request.param != "blocked":
        monkeypatch.setattr(linear_module, "blocked_kernels_available", lambda device: False)
    if request.param == "mm":
        monkeypatch.setattr(linear_module, "onednn_available", lambda device: False)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_computes_x_at_w_transposed(kind, threads, bias, num_tokens):
    gen = torch.Generator().manual_seed(threads * 10 + num_tokens)
    weight = torch.randn(7, 12, generator=gen)
    b = torch.randn(7, generator=gen) if bias else None
    x = torch.randn(num_tokens, 12, generator=gen)
    layer = DenseLinear(12, 7, bias)
    layer.load(weight, b)
    assert (layer.prefill is not None) == (kind != "mm")
    assert (layer.blocked is not None) == (kind == "blocked")
    with cpu_threads(threads):
        out = layer(x)
        strided = layer(torch.randn(12, num_tokens, generator=gen).t())  # not contiguous
    assert out.shape == (num_tokens, 7) and strided.shape == (num_tokens, 7)
    torch.testing.assert_close(out, x @ weight.T + (0 if b is None else b), rtol=1e-5, atol=1e-5)
    assert layer.num_weight_bytes == 7 * 12 * 4


def test_wrong_weight_shape_or_bias_is_refused():
    with pytest.raises(ValueError, match=r"does not fit a linear 12 -> 7"):
        DenseLinear(12, 7, bias=False).load(torch.zeros(12, 7))
    with pytest.raises(ValueError, match=r"expects bias=True, got False"):
        DenseLinear(12, 7, bias=True).load(torch.zeros(7, 12))


def test_cpu_threads_restores_the_previous_count():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("num_threads", [1, 2])
def test_engine_num_threads_reaches_the_linears_and_greedy_output_does_not_change(
    tiny_checkpoints, num_threads
):
    from ragspeed.engine.protocol import GenerationRequest, SamplingParams
    from tests.engine.conftest import make_engine

    before = torch.get_num_threads()
    engine = make_engine(tiny_checkpoints["llama"], num_threads=num_threads)
    assert torch.get_num_threads() == before  # the load's thread count was restored
    assert engine.runner.num_threads == num_threads
    assert engine.loaded.model.layers[0].mlp.down_proj.num_threads == num_threads
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = engine.generate([GenerationRequest("r", (5, 9, 14, 3), params)])["r"]["token_ids"]
    reference = make_engine(tiny_checkpoints["llama"]).generate(
        [GenerationRequest("r", (5, 9, 14, 3), params)]
    )["r"]["token_ids"]
    assert out == reference and len(out) == 8
