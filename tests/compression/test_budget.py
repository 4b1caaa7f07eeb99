import math

import pytest

from ragspeed.compression import CompressionError
from ragspeed.compression.budget import resolve_budget


def test_rate_and_target():
    assert resolve_budget(1000, rate=0.25, target_tokens=None) == 250
    assert resolve_budget(1000, rate=None, target_tokens=300, protected_tokens=100) == 200
    assert resolve_budget(1000, rate=0.5, target_tokens=300, protected_tokens=100) == 200  # tighter wins
    assert resolve_budget(1000, rate=None, target_tokens=None) == 250  # default 4x
    assert resolve_budget(1000, rate=1.0, target_tokens=None, protected_document_tokens=100) == 900


@pytest.mark.parametrize("rate", [0, -0.5, 1.01, 2, math.nan, math.inf, True, "0.5"])
def test_bad_rate_names_rate(rate):
    with pytest.raises(CompressionError) as err:
        resolve_budget(1000, rate=rate, target_tokens=None)
    assert err.value.param == "rate"
    assert isinstance(err.value, ValueError)


def test_target_below_protected_names_target_tokens():
    with pytest.raises(CompressionError) as err:
        resolve_budget(1000, rate=None, target_tokens=50, protected_tokens=60)
    assert err.value.param == "target_tokens"
    assert "below the protected tokens (60)" in str(err.value)
    with pytest.raises(CompressionError) as err:
        resolve_budget(1000, rate=None, target_tokens=2.5)
    assert err.value.param == "target_tokens"
