"""core/remainder.py: bf16 weight + int16 remainder hold a float32 master; the weight is always
round-to-nearest-even of the master, and the master is exact but at ties that rounded down."""
import pytest
import torch

from ampkit.core.remainder import combine, split

HIGHS = [0x0000, 0x0001, 0x0080, 0x0081, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80,
         0x8000, 0x8001, 0x8080, 0xBF80, 0xBF81, 0xFF7E, 0xFF7F, 0xFF80]


def every_low_bits_of(highs):
    bits = (torch.tensor(highs, dtype=torch.int64)[:, None] << 16 | torch.arange(65536)[None, :]).flatten()
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def test_the_weight_is_round_to_nearest_even_for_every_low_bit_pattern():
    x = every_low_bits_of(HIGHS)
    w, r = split(x)
    assert w.dtype == torch.bfloat16 and r.dtype == torch.int16
    assert torch.equal(w.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_masters_are_exact_but_one_ulp_below_a_tie_that_rounded_down():
    x = every_low_bits_of(HIGHS)
    w, r = split(x)
    y = combine(w, r)
    xb, yb = x.view(torch.int32).long(), y.view(torch.int32).long()
    nan = torch.isnan(x)
    assert torch.isnan(y[nan]).all()
    low = xb & 0xFFFF
    high_even = ((xb >> 16) & 1) == 0
    tie_down = (low == 0x8000) & high_even & ~nan & torch.isfinite(x)
    assert torch.equal(yb[~nan & ~tie_down], xb[~nan & ~tie_down])
    assert torch.equal(xb[tie_down] - yb[tie_down], torch.ones(int(tie_down.sum()), dtype=torch.long))
    assert torch.equal(y[tie_down].to(torch.bfloat16), x[tie_down].to(torch.bfloat16))  # the weight holds
    assert int(tie_down.sum()) == sum(1 for h in HIGHS if h % 2 == 0 and (h & 0x7F80) != 0x7F80)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-45, -1e-45])
def test_special_values(value):
    x = torch.tensor([value], dtype=torch.float32)
    w, r = split(x)
    y = combine(w, r)
    assert torch.equal(w, x.to(torch.bfloat16))
    if abs(value) <= torch.finfo(torch.bfloat16).max:
        assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # signed zeros and subnormals too
    else:
        assert torch.isinf(w).all()  # above bf16's range: the weight is inf, as O5's would be
