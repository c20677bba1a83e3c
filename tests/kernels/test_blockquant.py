"""8-bit block state: power-of-two scales, the two codes' grids, unbiased stochastic rounding,
non-finite values in their own codes, capped int8 codes, and blocks laid on a full tensor
(a part starting at ``first``; re-quantizing a part of a stored block is exact)."""
import math

import pytest
import torch

from ampkit._kernels.blockquant import (
    INF_UINT8, NAN_INT8, NAN_UINT8, block_absmax, counter_draws, dequantize, num_blocks, quantize_,
)

B = 256


def draws(n: int, seed=0, step=0, tensor=0, stream=1, index=0) -> torch.Tensor:
    return counter_draws(torch.empty(n, dtype=torch.int32), seed, step, tensor, stream, index)


def roundtrip(x: torch.Tensor, dtype, seed=0, block_size=B):
    q, s = torch.empty_like(x, dtype=dtype), torch.empty(num_blocks(x.numel(), block_size))
    quantize_(q, s, x, draws(x.numel(), seed), block_size)
    return q, s, dequantize(q, s, torch.empty_like(x), block_size)


def e4m4(c: int) -> float:
    """The documented uint8 code (0..253), in units of the scale."""
    e, m = divmod(c, 16)
    return (1 + m / 16) * 2.0 ** (e - 15) if e else m * 2.0 ** -18


GRIDS = {torch.int8: [float(c) for c in range(-127, 128)], torch.uint8: [e4m4(c) for c in range(254)]}  # finite codes


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("scale", [2.0 ** -120, 2.0 ** -20, 1.0, 2.0 ** 100])
def test_grid_values_round_trip_exactly(dtype, scale):
    """Every code's value (the block's largest being the top code, so the scale is the one
    given) comes back bit for bit whatever the random bits."""
    grid = torch.tensor(GRIDS[dtype], dtype=torch.float64).mul(scale).float()
    x = grid.repeat(4)  # several blocks, a tail block too when the grid is not 256 long
    for seed in range(3):
        q, s, y = roundtrip(x, dtype, seed)
        assert torch.equal(y, x) and torch.equal(s, torch.full_like(s, scale))
        codes = torch.arange(-127, 128) if dtype == torch.int8 else torch.arange(254)
        assert torch.equal(q.long(), codes.repeat(4))


def block_for(dtype) -> torch.Tensor:
    """One block's positions: the maximum (a grid value fixing scale 1), grid points, halves,
    quarters, odd fractions, values in uint8's linear run and below a step."""
    grid = GRIDS[dtype]
    lo, hi = torch.tensor(grid[1:-1]), torch.tensor(grid[2:])
    picks = [lo + (hi - lo) * f for f in (0.0, 0.5, 0.25, 0.8125, 1 / 3)]
    x = torch.cat([torch.tensor([grid[-1]])] + picks + [torch.tensor([2.0 ** -30, 1e-7, 3.3e-6])])
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_unbiased_between_two_neighbours(dtype):
    """Each position rounds only to its two grid neighbours, and the mean over R copies of the
    block is within 5 standard deviations of the value (Bernoulli(p) over a step)."""
    x = block_for(dtype)
    if dtype == torch.int8:
        x = x * torch.where(torch.arange(x.numel()) % 2 == 0, 1.0, -1.0)  # both signs
    R = 4096
    _, s, y = roundtrip(x.repeat(R), dtype, block_size=x.numel())
    assert torch.equal(s, torch.ones_like(s))
    y = y.view(R, -1).double()
    grid = torch.tensor(GRIDS[dtype], dtype=torch.float64)
    xd = x.double()
    lo = grid[torch.searchsorted(grid, xd, right=True) - 1]
    hi = grid[torch.searchsorted(grid, xd, right=False).clamp(max=grid.numel() - 1)]
    assert ((y == lo) | (y == hi)).all()
    step = (hi - lo).clamp(min=1e-300)
    p = ((xd - lo) / step)
    bound = 5 * step * (p * (1 - p) / R).sqrt() + 1e-300
    assert ((y.mean(0) - xd).abs() <= bound).all()
    assert ((y == hi).double().mean(0)[p > 0] - p[p > 0]).abs().max() < 5 * math.sqrt(0.25 / R)


def test_zero_block_and_tail_block():
    """An all-zero block stores zeros; a tail block's scale is its own (2**-7 or 0.5, against
    the full blocks' 8 or 1024: 960 is above uint8's top code 1.8125 * 512), the same as
    quantizing the tail alone."""
    x = torch.cat([torch.zeros(B), torch.full((B,), 960.0), torch.full((37,), 0.5)])
    for dtype in (torch.int8, torch.uint8):
        q, s, y = roundtrip(x, dtype)
        assert s.numel() == 3 and q[:B].eq(0).all() and y[:B].eq(0).all() and not y[:B].signbit().any()
        assert s[1:].tolist() == ([8.0, 2.0 ** -7] if dtype == torch.int8 else [1024.0, 0.5])
        assert torch.equal(y[B:], x[B:])  # 960 and 0.5 lie on both grids
        q_tail, s_tail, _ = roundtrip(x[2 * B:].clone(), dtype)
        assert torch.equal(s_tail, s[2:]) and torch.equal(q_tail, q[2 * B:])


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_one_huge_outlier(dtype):
    """One 1e6 among 1e-3s: the block's scale follows the outlier, its small values round
    to 0 or the step above unbiasedly; the next block keeps its own fine scale."""
    block = torch.full((B,), 1e-3)
    block[17] = 1e6
    x = torch.cat([block.repeat(64), torch.full((B,), 1e-3)])
    _, s, y = roundtrip(x, dtype)
    assert s[0].item() == (2.0 ** 13 if dtype == torch.int8 else 2.0 ** 20)
    small = y[:-B].view(64, B)[:, torch.arange(B) != 17]
    step = s[0].item() * (1 if dtype == torch.int8 else 2.0 ** -18)
    assert set(small.unique().tolist()) <= {0.0, step}
    n = small.numel()
    assert abs(small.double().mean().item() - 1e-3) < 5 * step * math.sqrt(1e-3 / step / n)
    assert (y[-B:] - 1e-3).abs().max() <= (1e-3 / 64 if dtype == torch.int8 else 1e-3 / 16)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1.0, 3.2e38])
def test_non_finite_value_changes_its_own_code_only(dtype, bad):
    """NaN and +-inf (in uint8 also a negative value, or one above 1.8125 * 2**127) take a code
    of their own: NaN, or +inf in uint8, reads back what O7's float state holds; the block's
    scale is its finite values', and every other code is the one the block gets with 0 in
    that place, from the same random bits."""
    x = torch.rand(3 * B)
    x[B + 5] = bad
    q, s, y = roundtrip(x, dtype)
    clean = x.clone()
    clean[B + 5] = 0.0
    q_clean, s_clean, y_clean = roundtrip(clean, dtype)
    others = torch.arange(3 * B) != B + 5
    if dtype == torch.int8 and math.isfinite(bad):  # int8 holds every finite float32
        assert y[B + 5].item() == pytest.approx(bad, rel=2 ** -6)
        return
    assert torch.equal(s, s_clean) and torch.equal(q[others], q_clean[others]) and torch.equal(y[others], y_clean[others])
    reads_inf = dtype == torch.uint8 and bad > 0
    assert q[B + 5].item() == (INF_UINT8 if reads_inf else NAN_UINT8 if dtype == torch.uint8 else NAN_INT8)
    assert y[B + 5].item() == float("inf") if reads_inf else math.isnan(y[B + 5].item())


def test_a_block_of_only_non_finite_values_and_zeros():
    x = torch.zeros(B)
    x[:3] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    for dtype in (torch.int8, torch.uint8):
        _, s, y = roundtrip(x, dtype)
        assert torch.isfinite(s).all() and s.item() > 0 and y[3:].eq(0).all()
        assert y[:3].isnan().tolist() == ([True, True, True] if dtype == torch.int8 else [False, True, True])


def test_limit_caps_int8_codes_toward_zero_and_leaves_the_rest_unbiased():
    """Each code's magnitude stays at or below ``limit / s`` (a limit below one step stores 0);
    NaN limits nothing: those codes are the ones an unlimited quantize draws."""
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(4 * B, generator=g) * 2 - 1) * 10 ** (torch.rand(4 * B, generator=g) * 6 - 3)
    limit = x.abs() * torch.rand(4 * B, generator=g) * 1.5
    limit[::3] = float("nan")
    limit[1::7] = 0.0
    q, s = torch.empty_like(x, dtype=torch.int8), torch.empty(4)
    quantize_(q, s, x, draws(x.numel()), limit=limit.clone())
    q_free, s_free, _ = roundtrip(x, torch.int8)
    step = s.repeat_interleave(B)
    assert torch.equal(s, s_free)
    capped = limit.isnan().logical_not()
    assert (q.float().abs()[capped] * step[capped] <= limit[capped]).all() and q[1::7].eq(0).all()
    assert torch.equal(q[~capped], q_free[~capped])
    assert (q.float() * x >= 0).all() and (q.float().abs() <= q_free.float().abs()).all()
    binds = capped & (q_free.float().abs() * step > limit)
    assert binds.sum() > B // 2 and ((q.float().abs() * step)[binds] > limit[binds] - step[binds]).all()  # the largest code below
    with pytest.raises(ValueError, match="limit caps int8 codes only"):
        quantize_(torch.empty(B, dtype=torch.uint8), torch.empty(1), torch.rand(B), limit=torch.rand(B))
    with pytest.raises(TypeError, match="limit must be a contiguous float32 tensor of x's shape"):
        quantize_(torch.empty(B, dtype=torch.int8), torch.empty(1), torch.rand(B), limit=torch.rand(B - 1))


def test_counter_draws_are_a_function_of_seed_step_tensor_stream_and_element():
    """The same key and elements, the same codes; any other seed, step, tensor or stream, other
    codes; a run of elements from an offset (an int) equals the same indices given one by one
    (a tensor), and a piece of a run equals the run's slice (a shard of the full parameter)."""
    x = torch.randn(5000)
    q = {}
    for key in [(7, 0, 0, 1), (7, 0, 0, 1), (8, 0, 0, 1), (7, 1, 0, 1), (7, 0, 1, 1), (7, 0, 0, 2)]:
        out, s = torch.empty(5000, dtype=torch.int8), torch.empty(num_blocks(5000))
        quantize_(out, s, x, draws(5000, *key))
        q.setdefault(key, []).append(out)
    a, b = q[(7, 0, 0, 1)]
    assert torch.equal(a, b) and all(not torch.equal(a, v[0]) for k, v in q.items() if k != (7, 0, 0, 1))
    whole = draws(100_000, 3, 4, 5, 6)
    assert torch.equal(draws(100_000, 3, 4, 5, 6, torch.arange(100_000)), whole)
    assert torch.equal(draws(40_000, 3, 4, 5, 6, 33_333), whole[33_333:73_333])  # across a block boundary


def _settled_v(bits: int, steps: int = 4000, n: int = 16 * B, beta2: float = 0.999) -> float:
    """Mean ``v / g**2`` after ``steps`` of Adam's ``v = beta2 sqrt(v)**2 + (1 - beta2) g**2`` (a constant
    ``g**2`` per element) with ``sqrt(v)`` stored as e4m4 codes each step, as O8 stores it, rounded with
    the top ``bits`` of the 24-bit draws."""
    g2 = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.1
    v, codes, scales, d, stored = g2.clone(), torch.empty(n, dtype=torch.uint8), torch.empty(n // B), \
        torch.empty(n, dtype=torch.int32), torch.empty(n)
    for t in range(steps):
        counter_draws(d, 1, t, 0, 2, 0).bitwise_right_shift_(24 - bits).bitwise_left_shift_(24 - bits)
        quantize_(codes, scales, v.sqrt(), d, B)
        v = dequantize(codes, scales, stored, B).square_().mul_(beta2).add_(g2 * (1 - beta2))
    return (v / g2).mean().item()


def test_requantized_every_step_v_settles_where_it_should_with_24_bit_draws():
    """A code's per-step bias compounds through a slow average: with 24-bit draws ``v`` settles within
    0.2% of ``g**2`` after 4000 steps at beta2 = 0.999; with 8 bits (a code rounds up with probability
    ``ceil(256 f) / 256``, so a value sitting on the grid moves up once in 256 steps) it settles over 2% high."""
    assert abs(_settled_v(24) - 1) < 0.002
    assert _settled_v(8) > 1.02


@pytest.mark.parametrize("stream", [1, 2])
def test_draws_are_24_uniform_bits(stream):
    """Every bit of the 24 is set half the time (5 sigma) at bits 16 (stream 1) and 40 (stream
    2) of the counter words; nothing above bit 23."""
    n = 2**16 + 1
    d = draws(n, 5, 0, 0, stream)
    assert d.dtype == torch.int32 and d.numel() == n and d.min() >= 0 and d.max() < 2**24
    ones = torch.stack([d.bitwise_right_shift(b).bitwise_and(1) for b in range(24)]).double().mean(dim=1)
    assert (ones - 0.5).abs().max() <= 5 * math.sqrt(0.25 / n)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_without_draws_rounds_to_nearest(dtype):
    """``draws=None`` (loading state already on the grid) rounds each value to its nearest
    grid neighbour (ties toward zero), never drawing: the same as draws that are all 2**23."""
    x = block_for(dtype)
    grid = torch.tensor(GRIDS[dtype], dtype=torch.float64)
    if dtype == torch.int8:
        x = x * torch.where(torch.arange(x.numel()) % 2 == 0, 1.0, -1.0)  # both signs
    q, s = torch.empty_like(x, dtype=dtype), torch.empty(1)
    quantize_(q, s, x, None, x.numel())
    y = dequantize(q, s, torch.empty_like(x), x.numel()).double()
    xd = x.double()
    nearest = (grid[None, :] - xd.abs()[:, None]).abs().min(dim=1).values
    assert torch.equal((y - xd).abs(), nearest)
    tie = nearest.gt(0) & torch.isin(xd.abs() + nearest, grid) & torch.isin(xd.abs() - nearest, grid)
    assert tie.sum() > 10 and torch.equal(y.abs()[tie], (xd.abs() - nearest)[tie])
    half = torch.full(x.shape, 2**23, dtype=torch.int32)
    q2 = torch.empty_like(q)
    quantize_(q2, s, x, half, x.numel())
    assert torch.equal(q, q2)


def test_empty_and_bad_arguments():
    quantize_(torch.empty(0, dtype=torch.int8), torch.empty(0), torch.empty(0))
    q, s, x = torch.empty(10, dtype=torch.int8), torch.empty(1), torch.zeros(10)
    with pytest.raises(TypeError, match="draws must be an int32 tensor of x's shape"):
        quantize_(q, s, x, torch.zeros(10, dtype=torch.int64))
    with pytest.raises(TypeError, match="q must be a flat contiguous tensor of dtype torch.int8 or torch.uint8"):
        quantize_(q.short(), s, x)
    with pytest.raises(TypeError, match="x must be a flat contiguous tensor of dtype torch.float32"):
        quantize_(q, s, x.double())
    with pytest.raises(TypeError, match="out must be a flat"):
        dequantize(q, s, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"scales num_blocks\(10, 4\) = 3, got 10 and 1"):
        quantize_(q, s, x, block_size=4)
    with pytest.raises(ValueError, match="block_size=0: expected a positive integer"):
        num_blocks(10, 0)
    with pytest.raises(ValueError, match="first=-1: expected a non-negative integer"):
        quantize_(q, s, x, first=-1)
    with pytest.raises(ValueError, match=r"scales num_blocks\(10, 4, first=3\) = 4, got 10 and 1"):
        quantize_(q, s, x, block_size=4, first=3)
    with pytest.raises(TypeError, match="absmax must be a float32 tensor of scales' shape"):
        quantize_(q, s, x, absmax=torch.zeros(2))
    with pytest.raises(ValueError, match="block_absmax: dtype=torch.int16: expected torch.int8 or torch.uint8"):
        block_absmax(x, torch.int16)


# -- blocks laid on a full tensor -------------------------------------------------------------

def spread(n: int, seed: int) -> torch.Tensor:
    """Signed values over 40 binades, some blocks with one value far above the rest (whose
    others then sit in uint8's linear run), zeros, and non-finite values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-30, 10, (n,), generator=g).float())
    x[torch.randint(0, n, (n // 50,), generator=g)] *= 2.0 ** 20
    x[torch.randint(0, n, (n // 40,), generator=g)] = 0.0
    x[[7, n // 2]] = torch.tensor([float("nan"), float("inf")])
    return x


def test_num_blocks_counts_the_full_tensors_blocks_a_part_touches():
    assert [num_blocks(n, 4, first) for n, first in [(0, 3), (1, 3), (2, 3), (5, 3), (6, 3), (8, 0), (8, 8), (9, 1)]] == \
        [0, 1, 2, 2, 3, 2, 2, 3]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_parts_with_the_full_blocks_maxima_store_what_the_full_tensor_stores(dtype):
    """Cut a tensor anywhere: each part quantized at ``first`` = its offset, with its blocks'
    maxima over the full tensor (``absmax``) and the full tensor's draws, stores the full
    tensor's codes and scales bit for bit; without ``absmax`` it stores its own blocks'
    maxima (a part's scale never above the full block's)."""
    n, block = 1500, 256
    x = spread(n, 3)
    x = x.abs().nan_to_num(nan=-1.0) if dtype == torch.uint8 else x  # uint8: a negative value is its NaN
    d = draws(n, seed=4)
    q, s = torch.empty(n, dtype=dtype), torch.empty(num_blocks(n, block))
    quantize_(q, s, x.clone(), d, block)
    full_max = block_absmax(x, dtype, block)
    for cuts in ([0, 900, n], [0, 600, 1200, n], [0, 1, 300, 400, 1499, n], [0, 512, n]):
        for a, b in zip(cuts, cuts[1:]):
            first, part = a, x[a:b].clone()
            blocks = slice(a // block, (b - 1) // block + 1)
            qp, sp = torch.empty(b - a, dtype=dtype), torch.empty(num_blocks(b - a, block, first))
            quantize_(qp, sp, part.clone(), d[a:b].clone(), block, first=first, absmax=full_max[blocks].clone())
            assert torch.equal(qp, q[a:b]) and torch.equal(sp, s[blocks]), (cuts, a)
            y = dequantize(qp, sp, torch.empty(b - a), block, first)
            assert torch.equal(y.nan_to_num(), dequantize(q, s, torch.empty(n), block)[a:b].nan_to_num())
            own = block_absmax(part, dtype, block, first)
            assert own.shape == sp.shape and bool((own <= full_max[blocks]).all())
            quantize_(qp, sp, part.clone(), None, block, first=first)
            assert bool((sp <= s[blocks]).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
@pytest.mark.parametrize("seed", range(4))
def test_a_stored_block_requantized_on_any_part_of_it_is_exact(dtype, seed):
    """The claim resharding rests on: values stored at a block's scale ``s`` (stochastically),
    quantized again to nearest on any run of the block (its own scale ``s' <= s``, a power
    of two) come back bit for bit: int8 codes scale by ``s / s'``, e4m4 codes too, those of
    the linear run near zero becoming normal codes. Every cut of a block into two parts, and
    runs holding only the block's smallest values (scale far below the block's)."""
    block = 256
    x = spread(4 * block, seed)
    x = x.abs() if dtype == torch.uint8 else x
    x = x.nan_to_num(nan=0.0)
    x[block:2 * block] *= torch.where(torch.arange(block) == 200, 2.0 ** 30, 2.0 ** -5)  # a run far below its maximum
    q, s = torch.empty(x.numel(), dtype=dtype), torch.empty(num_blocks(x.numel(), block))
    quantize_(q, s, x, draws(x.numel(), seed), block)
    stored = dequantize(q, s, torch.empty(x.numel()), block)
    linear = (q.int() < 16) & (q.int() > 0) if dtype == torch.uint8 else None
    assert linear is None or int(linear.sum()) > 10  # the linear run is exercised
    runs = [(a, b) for cut in range(1, 2 * block, 7) for a, b in ((0, cut), (cut, 2 * block), (block, block + cut % block or 1))]
    runs += [(a, a + w) for a in range(block, 2 * block, 13) for w in (1, 5, 40) if a + w <= 2 * block]
    for a, b in runs:
        part = stored[a:b].clone()
        qp, sp = torch.empty(b - a, dtype=dtype), torch.empty(num_blocks(b - a, block, a))
        quantize_(qp, sp, part.clone(), None, block, first=a)
        assert bool((sp <= s[a // block:(b - 1) // block + 1]).all())
        assert torch.equal(dequantize(qp, sp, torch.empty(b - a), block, a), part), (a, b)
