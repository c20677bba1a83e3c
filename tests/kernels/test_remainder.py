"""Remainder masters: w is always x.to(bfloat16) and every master comes back exactly, the one
value per even w that 16 bits cannot hold through the remainder's side table."""
import copy
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ampkit._kernels.remainder import combine, master, remainder, side_table, split_

LOW = torch.arange(65536, dtype=torch.int32)
# High 16 bits (sign, exponent, 7 mantissa bits): zeros, subnormals, even and odd w, powers
# of two, the top of bfloat16's range, inf and NaN, with both signs.
HIGHS = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x3FFF, 0x4000, 0x7F7E, 0x7F7F, 0x7F80, 0x7FC0]
HIGHS += [h | 0x8000 for h in HIGHS]


def as_int16(h: int) -> int:
    return h - 0x10000 if h >= 0x8000 else h


def roundtrip(x: torch.Tensor):
    w, r, y = torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.int16), torch.empty_like(x)
    split_([w], [r], [x])
    combine([w], [r], [y])
    return w, r, y


def plus_one(x: torch.Tensor) -> torch.Tensor:
    """Independently: where float32 ``x`` lies 32767 ULPs above an even bfloat16 value (low 17
    bits 0x07FFF), not NaN: the values 16 bits cannot hold, as flat indices."""
    bits = x.reshape(-1).view(torch.int32)
    return (bits.bitwise_and(0x1FFFF).eq(0x7FFF) & ~x.reshape(-1).isnan()).nonzero().flatten()


@pytest.mark.parametrize("high", HIGHS, ids=hex)
def test_every_low_pattern(high):
    """All 65536 float32 values with these high bits: w bit for bit x.to(bfloat16), the master
    back exactly (NaN as NaN), and the side table lists exactly the d = +32767 above an even w."""
    bits = (as_int16(high) << 16) + LOW  # the int32 bit patterns
    x = bits.view(torch.float32)
    w, r, y = roundtrip(x)
    assert torch.equal(w.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    nan = x.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y.view(torch.int32)[~nan], bits[~nan])
    assert torch.equal(side_table(r), plus_one(x))
    assert torch.equal(y.to(torch.bfloat16).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("high", [0x3F80, 0x3F81, 0x0000, 0xBF80], ids=hex)
def test_without_its_table_a_remainder_reads_those_values_one_ulp_toward_w(high):
    """A remainder that has no side table (made before tables existed) gives every master
    exactly but the listed ones, each one float32 ULP toward w: the documented approximation."""
    bits = (as_int16(high) << 16) + LOW
    x = bits.view(torch.float32)
    w, r, _ = roundtrip(x)
    listed = side_table(r)
    assert listed.numel() == (1 if high % 2 == 0 else 0)
    old = r.clone()  # a clone carries no table
    assert side_table(old).numel() == 0
    y = master(w, old)
    want = bits.clone()
    want[listed] -= 1
    assert torch.equal(y.view(torch.int32), want)


def test_ties_round_trip_exactly_both_signs():
    """Both ties of an even w (the rounding's 65537th state) are kept: d = -32768 and +32768."""
    x = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000 - 2**32, 0x00018000, 0x7F7F8000], dtype=torch.int32).view(torch.float32)
    w, r, y = roundtrip(x)
    assert w.view(torch.int16).tolist() == [0x3F80, 0x3F82, as_int16(0xBF80), 0x0002, 0x7F80]
    assert r.tolist() == [32767, -32768, 32767, -32768, -32768]
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_zeros_infinities_and_beyond_bfloat16_max():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.397e38, -3.397e38])
    w, r, y = roundtrip(x)
    assert w.float().tolist() == [0.0, -0.0, float("inf"), -float("inf"), float("inf"), -float("inf")]
    assert torch.equal(w.float().signbit(), x.signbit())
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))  # finite masters past bf16 max stay finite


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=64))
def test_random_bits(values):
    bits = torch.tensor(values, dtype=torch.int32)
    x = bits.view(torch.float32)
    w, r, y = roundtrip(x)
    fin = ~x.isnan()
    assert torch.equal(w.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(y.view(torch.int32)[fin], bits[fin]) and y[~fin].isnan().all()
    assert torch.equal(side_table(r), plus_one(x))


def with_plus_ones(n: int, at, seed: int = 0) -> torch.Tensor:
    """``n`` random float32 values, exactly those at ``at`` 32767 ULPs above an even bf16 value."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    bits = x.view(torch.int32)
    bits[plus_one(x)] -= 1  # none by chance
    at = torch.tensor(at, dtype=torch.int64)
    bits[at] = bits[at].bitwise_and(~0x1FFFF).bitwise_or(0x7FFF)
    return x


@pytest.mark.parametrize("n, at", [
    (1, [0]), (1023, [0, 1022]), (1024, [1023]), (1025, [1024]), (1025, [0, 1023, 1024]),
    (5000, [1, 1023, 1024, 2047, 4095, 4096, 4999]), (3000, list(range(1000, 1100))),
])
def test_the_side_table_finds_every_value_at_block_edges_and_in_the_tail(n, at):
    """The table is found block by block (1024 elements) plus a tail: values at either edge of
    a block, in the tail, and many in one block are all listed, and none else."""
    x = with_plus_ones(n, at)
    assert plus_one(x).tolist() == sorted(at)
    w, r, y = roundtrip(x)
    assert side_table(r).tolist() == sorted(at) and side_table(r).dtype == torch.int64
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_tables_of_a_list_are_each_tensors_own():
    """Split as one list (separate tensors, and views of one buffer), each remainder holds the
    flat indices of its own listed elements; combine gives every master back."""
    x = with_plus_ones(3000, [5, 999, 1000, 1001, 2999])
    parts = [x[:1000].view(10, 100), x[1000:1001].view(()), x[1001:]]
    for r_buf in (None, torch.empty(3000, dtype=torch.int16)):
        if r_buf is None:
            rs = [torch.empty_like(p, dtype=torch.int16) for p in parts]
        else:
            rs = [r_buf[:1000].view(10, 100), r_buf[1000:1001].view(()), r_buf[1001:]]
        ws = [torch.empty_like(p, dtype=torch.bfloat16) for p in parts]
        split_(ws, rs, parts)
        assert [side_table(r).tolist() for r in rs] == [[5, 999], [0], [0, 1998]]
        outs = [torch.empty_like(p) for p in parts]
        combine(ws, rs, outs)
        assert all(torch.equal(o.view(torch.int32), p.view(torch.int32)) for o, p in zip(outs, parts))
        split_(ws, rs, [p.bfloat16().float() for p in parts])  # on the bf16 grid: nothing to list
        assert all(side_table(r).numel() == 0 for r in rs)


def test_the_table_travels_with_the_remainder_and_never_moves_another_value():
    """deepcopy and pickling keep the table; a table whose pair was rewritten behind its back
    (another value in the cell) is ignored where the code is no longer 32766 of an even w."""
    x = with_plus_ones(2048, [3, 2000])
    r = remainder(x)
    w = x.bfloat16()
    for other in (copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert side_table(other).tolist() == [3, 2000]
        assert torch.equal(master(w, other).view(torch.int32), x.view(torch.int32))
    r[3] = 100  # not code 32766 any more: the table leaves it alone
    assert master(w, r).view(torch.int32)[3] == (w[3:4].view(torch.int16).int() << 16) + 100
    assert master(w, r).view(torch.int32)[2000] == x.view(torch.int32)[2000]


def test_lists_of_tensors_and_flat_views():
    """A list of separate tensors, and views of one buffer (written in place), agree."""
    x = torch.randn(300)
    parts = [x[:100].view(10, 10), x[100:]]
    w, r = torch.empty(300, dtype=torch.bfloat16), torch.empty(300, dtype=torch.int16)
    ws, rs = [w[:100].view(10, 10), w[100:]], [r[:100].view(10, 10), r[100:]]
    split_(ws, rs, [p.clone() for p in parts])
    w2 = [torch.empty_like(p, dtype=torch.bfloat16) for p in parts]
    r2 = [torch.empty_like(p, dtype=torch.int16) for p in parts]
    split_(w2, r2, parts)
    assert torch.equal(torch.cat([t.flatten() for t in w2]).view(torch.int16), w.view(torch.int16))
    assert torch.equal(torch.cat([t.flatten() for t in r2]), r)
    out = [torch.full_like(p, float("nan")) for p in parts]
    combine(w2, r2, out)
    assert torch.equal(torch.cat([t.flatten() for t in out]), x)


@pytest.mark.parametrize("call, match", [
    (lambda: split_([torch.zeros(2)], [torch.zeros(2, dtype=torch.int16)], [torch.zeros(2)]), "ws must be a list of torch.bfloat16"),
    (lambda: split_([torch.zeros(2, dtype=torch.bfloat16)], [torch.zeros(2, dtype=torch.int32)], [torch.zeros(2)]), "rs must be a list of torch.int16"),
    (lambda: combine([torch.zeros(2, dtype=torch.bfloat16)], [torch.zeros(2, dtype=torch.int16)], [torch.zeros(2, dtype=torch.float64)]), "outs must be a list of torch.float32"),
    (lambda: split_(torch.zeros(2, dtype=torch.bfloat16), [torch.zeros(2, dtype=torch.int16)], [torch.zeros(2)]), "ws must be a list"),
    (lambda: split_([torch.zeros(2, dtype=torch.bfloat16)], [torch.zeros(3, dtype=torch.int16)], [torch.zeros(2)]), "matching shapes"),
])
def test_bad_arguments(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()
