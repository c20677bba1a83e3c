"""Stochastic rounding float32 -> bfloat16: unbiased, only ever the two neighbours, seeded."""
import math

import pytest
import torch

from ampkit._kernels.rounding import StochasticRounder, round_all_to_bf16_, round_counter_, round_to_bf16_

N = 2**16  # roundings per value


def neighbours(x: float):
    """The bfloat16 values just below and above ``x`` in magnitude (truncation, and one ulp up)."""
    t = torch.tensor([x], dtype=torch.float32)
    lo = (t.view(torch.int32) & -65536).view(torch.float32)
    hi = (lo.view(torch.int32) + 65536).view(torch.float32)
    return lo.item(), hi.item()


def rounded(x: float, seed: int = 0, n: int = N) -> torch.Tensor:
    src = torch.full((n,), x, dtype=torch.float32)
    return round_to_bf16_(torch.empty(n, dtype=torch.bfloat16), src, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("x", [1.0 + 2**-10, 1.0 + 3 * 2**-12, -(1.0 + 2**-10), 0.1, -3.7e-3, 12345.678, 2e-39, 1.0 + 2**-20])
def test_unbiased_and_only_the_two_neighbours(x):
    out = rounded(x).double()
    lo, hi = neighbours(x)
    assert set(out.unique().tolist()) <= {lo, hi}
    p = (x - lo) / (hi - lo)  # the probability of rounding away from zero
    up = (out == hi).double().mean().item()
    # Each rounding is a Bernoulli(p) choice between lo and hi, so the mean of N of them has
    # standard deviation |hi - lo| * sqrt(p (1 - p) / N); 5 of those fail by chance with
    # probability < 1e-6 (and the seed is fixed, so the test is deterministic anyway).
    sigma = abs(hi - lo) * math.sqrt(p * (1 - p) / N)
    assert abs(out.mean().item() - x) <= 5 * sigma + 1e-300
    assert abs(up - p) <= 5 * math.sqrt(p * (1 - p) / N) + 1e-12


def test_each_quarter_of_a_64_bit_draw_is_unbiased_with_an_odd_count():
    """The draws are the four 16-bit quarters of 64-bit integers, each serving an element of
    the first half as drawn and its partner in the second half byte-swapped: every quarter
    position of either half alone rounds up with the right probability, also in a tensor
    of odd size."""
    x, n = 1.0 + 3 * 2**-10 + 2**-14, N + 3  # p = 0.390625: the low byte of the noise decides 1 in 256
    lo, hi = neighbours(x)
    up = (rounded(x, n=n).double() == hi).double()
    p = (x - lo) / (hi - lo)
    h = (n + 1) // 2
    for half in (up[:h], up[h:]):
        for quarter in range(4):
            picked = half[quarter::4]
            assert abs(picked.mean().item() - p) <= 5 * math.sqrt(p * (1 - p) / picked.numel())


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return (((a - a.mean()) * (b - b.mean())).mean() / (a.std(unbiased=False) * b.std(unbiased=False))).item()


@pytest.mark.parametrize("x", [1.0 + 2**-8, 1.0 + 3 * 2**-10 + 2**-14])  # p = 0.5; p = 0.390625, low byte nonzero
def test_neighbouring_elements_and_partners_round_independently(x):
    """Within a 64-bit word and across words, the round-up decisions of elements 1 to 4
    apart are uncorrelated, and so are those of the two partners that share a draw (|correlation| within 5
    standard errors of 0)."""
    up = (rounded(x).double() == neighbours(x)[1]).double()
    for lag in range(1, 5):
        for start in range(4):  # element pairs (4k + start, 4k + start + lag): every pair of quarters
            a, b = up[start:N - lag:4], up[start + lag::4][:up[start:N - lag:4].numel()]
            assert abs(correlation(a, b)) <= 5 / math.sqrt(a.numel()), (lag, start)
    h = N // 2
    assert abs(correlation(up[:h], up[h:])) <= 5 / math.sqrt(h)


def test_a_list_rounds_as_its_concatenation_and_keeps_the_sources_of_round_to_bf16():
    """One call for a list (odd sizes, a 0-dim tensor) gives what one call on the
    concatenation gives, whether the tensors share one buffer back to back or not."""
    g = torch.Generator().manual_seed(4)
    shapes = [(3,), (), (2, 5), (4,), (7, 1)]
    srcs = [torch.randn(shape, generator=g) for shape in shapes]
    kept = [s.clone() for s in srcs]
    separate = [torch.empty(s.shape, dtype=torch.bfloat16) for s in srcs]
    round_all_to_bf16_(separate, [s.clone() for s in srcs], torch.Generator().manual_seed(9))
    buffer = torch.cat([s.reshape(-1) for s in srcs])
    views = [v.view(s.shape) for v, s in zip(buffer.split([s.numel() for s in srcs]), srcs)]
    shared = [torch.empty(s.shape, dtype=torch.bfloat16) for s in srcs]
    round_all_to_bf16_(shared, views, torch.Generator().manual_seed(9))
    whole = round_to_bf16_(torch.empty(buffer.numel(), dtype=torch.bfloat16), torch.cat([s.reshape(-1) for s in srcs]),
                           torch.Generator().manual_seed(9))
    assert all(torch.equal(a, b) for a, b in zip(separate, shared))
    assert torch.equal(torch.cat([t.reshape(-1) for t in separate]), whole)
    for s, r in zip(srcs, separate):
        lo = (s.view(torch.int32) & -65536).view(torch.float32)
        assert bool(((r.float() == lo) | (r.float() == (lo.view(torch.int32) + 65536).view(torch.float32))).all())
    assert all(torch.equal(s, k) for s, k in zip(srcs, kept))  # round_to_bf16_ leaves its source alone


def test_a_nearest_rounding_loses_what_stochastic_rounding_keeps():
    x = 1.0 + 2**-10  # a small update to a weight of 1.0: below half a bfloat16 ulp (2**-8)
    assert torch.tensor(x).to(torch.bfloat16).item() == 1.0
    assert rounded(x).double().mean().item() == pytest.approx(x, abs=2e-5)


@pytest.mark.parametrize("x", [0.0, -0.0, 1.0, -2.5, torch.finfo(torch.bfloat16).max, float("inf"), float("-inf"), 2.0**-130])
def test_representable_values_are_exact(x):
    out = rounded(x, n=4096)
    assert torch.equal(out, torch.full_like(out, x)) and torch.equal(out.signbit(), torch.full((4096,), math.copysign(1, x) < 0))


def test_nan_stays_nan():
    assert rounded(float("nan"), n=64).isnan().all()


def test_deterministic_under_a_seed():
    x = torch.randn(10_000)
    a, b, c = (round_to_bf16_(torch.empty(10_000, dtype=torch.bfloat16), x, torch.Generator().manual_seed(s)) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _rounded(rounder, x):
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    rounder.round_([out], [x.clone()], [0], [0])  # srcs are scratch
    rounder.advance()
    return out


def test_rounder_state_dict_is_seed_and_step_and_resumes_bit_exactly():
    x = torch.randn(1000)
    r = StochasticRounder(seed=3)
    _rounded(r, x)
    saved = r.state_dict()
    assert saved == {"seed": 3, "step": 1}
    first = [_rounded(r, x) for _ in range(2)]
    for _ in range(2):  # two loads continue alike
        other = StochasticRounder(seed=99)
        other.load_state_dict(saved)
        assert other.seed == 3 and other.step == 1
        assert all(torch.equal(a, b) for a, b in zip([_rounded(other, x) for _ in range(2)], first))
    assert not torch.equal(first[0], first[1])  # the step moves the bits on


@pytest.mark.parametrize("with_step", [True, False])
def test_an_old_state_with_generators_continues_from_its_seed_and_step(with_step):
    """States written when O7/O8 drew from per-device generators hold their states (and,
    before the step counter, no ``step``): the generators are ignored, step 0 if absent."""
    x = torch.randn(1000)
    state = {"seed": 3, "generators": {"cpu": torch.Generator().manual_seed(3).get_state(),
                                       "cuda:0": torch.zeros(16, dtype=torch.uint8)}}
    if with_step:
        state["step"] = 4
    r = StochasticRounder(seed=5)
    r.step = 7
    r.load_state_dict(state)
    assert r.state_dict() == {"seed": 3, "step": 4 if with_step else 0}
    same = StochasticRounder(seed=3)
    same.step = 4 if with_step else 0
    assert torch.equal(_rounded(r, x), _rounded(same, x))


@pytest.mark.parametrize("state, match", [
    ("x", "expected a dict with 'seed' and 'step'"),
    ({"step": 0}, "expected a dict with 'seed' and 'step'"),
    ({"seed": 0, "step": -1}, r"\['step'\]=-1"),
    ({"seed": 0, "step": 1.0}, r"\['step'\]=1.0"),
    ({"seed": 0, "step": 0, "other": 1}, "expected a dict with"),
    ({"seed": -1, "step": 0}, r"\['seed'\]=-1"),
    ({"seed": 0, "generators": [1]}, r"\['generators'\]: expected a dict of generator states, got list"),
    ({"seed": 0, "generators": {"nodevice": torch.Generator().get_state()}}, "'nodevice' is not a device"),
    ({"seed": 0, "generators": {"cpu": torch.zeros(3)}}, r"\['generators'\]\['cpu'\]: expected a generator state"),
])
def test_bad_state_is_refused_before_anything_changes(state, match):
    r = StochasticRounder(seed=5)
    r.advance()
    with pytest.raises(ValueError, match=match):
        r.load_state_dict(state)
    assert r.state_dict() == {"seed": 5, "step": 1}


def test_dtypes_are_checked():
    with pytest.raises(TypeError, match="bfloat16 dst and a float32 src"):
        round_to_bf16_(torch.empty(3, dtype=torch.float16), torch.zeros(3))


@pytest.mark.parametrize("n,first", [(1, 0), (1, 7), (300, 255), (1000, 1), (5000, 2**33 + 1)])
def test_paired_rounding_in_c_equals_torch_and_differs_from_the_word_per_element(lib, n, first):
    """``paired=True`` (O8's SGD weights): the C kernel's bits equal torch's at odd and even starts,
    and they are not stream 0's one-word-per-element bits."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    c, t, per_element = (torch.empty(n, dtype=torch.bfloat16) for _ in range(3))
    round_counter_(c, x.clone(), 4, 9, 2, 0, first, lib, paired=True)
    round_counter_(t, x.clone(), 4, 9, 2, 0, first, None, paired=True)
    round_counter_(per_element, x.clone(), 4, 9, 2, 0, first, lib)
    assert torch.equal(c.view(torch.int16), t.view(torch.int16))
    if n >= 300:
        assert not torch.equal(c, per_element)
    with pytest.raises(ValueError, match="paired=True, stream=1"):
        round_counter_(c, x.clone(), 4, 9, 2, 1, first, lib, paired=True)
