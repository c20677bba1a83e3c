"""Counter-based rounding bits: exactly SplitMix64's words, and statistics with a stated power.

Every statistical test fixes its seeds (so it is deterministic) and takes its sample size
and its threshold from the test's statistics: the threshold is the value a test at level
``ALPHA`` (two-sided where the sign does not matter) rejects, and the sample size is the
least that detects the stated departure with probability ``POWER``.
"""
import math
from statistics import NormalDist

import pytest
import torch

from ampkit._kernels import counter_bits as cb
from ampkit._kernels.rounding import round_counter_
from ampkit._update.shards import block_index

ALPHA, POWER = 1e-6, 0.99
Z_TWO_SIDED = NormalDist().inv_cdf(1 - ALPHA / 2)  # 4.89
Z_POWER = NormalDist().inv_cdf(POWER)  # 2.33


def sample_size(effect: float, sd: float = 1.0) -> int:
    """The n at which a mean with per-sample sd ``sd`` detects a shift ``effect`` (two-sided z test)."""
    return math.ceil(((Z_TWO_SIDED + Z_POWER) * sd / effect) ** 2)


def uniforms(seed, step, tensor, stream, n, first=0) -> torch.Tensor:
    return (cb.draws24(seed, step, tensor, stream, first, n).double() + 0.5) / 2**24


def uniforms16(seed, step, tensor, stream, n) -> torch.Tensor:
    return (cb.draws16(seed, step, tensor, stream, 0, n).double() + 0.5) / 2**16


def test_words_are_splitmix64_of_the_keyed_counter():
    """The torch kernel (int64, wrapping) against Python's unbounded integers, across the sign
    bit and at indices past 2**32."""
    for seed, step, tensor, stream in [(0, 0, 0, 1), (2**63 - 1, 10**9, 5, 3), (7, 1, 2**20, 2), (7, 1, 3, 6)]:
        k = cb.key(seed, step, tensor, (stream - 1) // 2)  # 24-bit draws: bits 16 or 40 up of word (stream - 1) // 2
        for first in (0, 2**32 - 3, 2**45):
            got = cb.words(k, first, 6).tolist()
            assert [w % 2**64 for w in got] == [cb.mix64(k + (i + 1) * cb.GAMMA) for i in range(first, first + 6)]
        want = [cb.mix64(k + (i + 1) * cb.GAMMA) >> (16 if stream % 2 else 40) & 0xFFFFFF for i in range(4)]
        assert cb.draws24(seed, step, tensor, stream, 0, 4).tolist() == want
        k16 = cb.key(seed, step, tensor, stream // 4)  # 16-bit draws: quarter stream % 4 of word stream // 4
        want16 = [cb.mix64(k16 + (i + 1) * cb.GAMMA) >> (16 * (stream % 4)) & 0xFFFF for i in range(3)]
        assert cb.draws16(seed, step, tensor, stream, torch.tensor([2, 0])).tolist() == [want16[2], want16[0]]


def test_each_input_changes_the_bits():
    base = cb.draws24(1, 2, 3, 1, 0, 64)
    for args in [(2, 2, 3, 1), (1, 3, 3, 1), (1, 2, 4, 1), (1, 2, 3, 2), (1, 2, 3, 3)]:
        assert (cb.draws24(*args, 0, 64) != base).sum() >= 60


def test_a_run_equals_its_pieces_at_their_offsets_and_any_index_order():
    """The bits of element i are the same whether it is drawn in one run, in pieces from their
    offsets, or by an explicit index tensor (a shard that is not one run of its parameter)."""
    whole = cb.draws24(5, 9, 1, 2, 0, 1000)
    pieces = torch.cat([cb.draws24(5, 9, 1, 2, a, b - a) for a, b in [(0, 1), (1, 333), (333, 334), (334, 1000)]])
    assert torch.equal(whole, pieces)
    picked = torch.tensor([999, 3, 3, 500])
    assert torch.equal(cb.draws24(5, 9, 1, 2, picked), whole[picked])
    with pytest.raises(ValueError, match="state streams"):
        cb.draws24(5, 9, 1, 0, 0, 4)


def test_bytes_are_uniform():
    """Chi-square over the 256 values of each byte position of the 24 bits (df 255), for the
    two moment streams (bits 16 and 40 up of one word). Threshold: the 1 - ALPHA quantile (Wilson-Hilferty).
    Sample size: the least that detects a departure of Cohen's w = 0.01 with probability POWER
    (the noncentral chi-square by its normal approximation)."""
    df, w = 255, 0.01
    z = NormalDist().inv_cdf(1 - ALPHA)
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3  # 377.2
    lam = 1.0
    while (df + lam) - Z_POWER * math.sqrt(2 * (df + 2 * lam)) < limit:  # power of the noncentral test < POWER
        lam += 1.0
    n = math.ceil(lam / w**2)  # ~2.1 million bytes
    for stream in (1, 2):
        bits = cb.draws24(11, 3, 0, stream, 0, n)
        for shift in (0, 8, 16):
            counts = torch.bincount(bits.bitwise_right_shift(shift).bitwise_and(255), minlength=256).double()
            chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
            assert chi2 < limit, (stream, shift, chi2)


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return ((a * b).mean() / (a.square().mean() * b.square().mean()).sqrt()).item()


RHO = 0.01  # the least correlation the tests below detect with probability POWER
N_CORR = sample_size(RHO)  # 520,994: the sample correlation of independent uniforms has sd 1/sqrt(n)
CORR_LIMIT = Z_TWO_SIDED / math.sqrt(N_CORR)  # 0.0068


@pytest.mark.parametrize("pair", ["neighbouring elements", "consecutive steps", "the two moments",
                                  "weight and moment", "neighbouring tensors", "neighbouring seeds"])
def test_no_correlation(pair):
    """|r| < CORR_LIMIT between the uniforms of the pairs (each pair of samples is from the same
    element or neighbouring ones), with ``N_CORR`` pairs: a correlation of RHO is found with
    probability POWER, a false alarm has probability ALPHA."""
    n = N_CORR
    base = uniforms(3, 5, 2, 1, n)
    other = {
        "neighbouring elements": uniforms(3, 5, 2, 1, n, first=1),
        "consecutive steps": uniforms(3, 6, 2, 1, n),
        "the two moments": uniforms(3, 5, 2, 2, n),
        "weight and moment": uniforms16(3, 5, 2, 0, n),  # the same word: bits 0..15 and 16..39
        "neighbouring tensors": uniforms(3, 5, 3, 1, n),
        "neighbouring seeds": uniforms(4, 5, 2, 1, n),
    }[pair]
    assert abs(correlation(base, other)) < CORR_LIMIT


@pytest.mark.parametrize("streams", [(0, 1), (0, 2), (1, 2), (0, 4), (3, 4)])
def test_no_correlation_between_the_quarters_of_a_word(streams):
    """The 16-bit draws of O7's weight and bfloat16 moments (streams 0, 1, 2) are quarters of one
    word per element: pairwise uncorrelated as the 32-bit streams above (and across words)."""
    a, b = (uniforms16(3, 5, 2, s, N_CORR) for s in streams)
    assert abs(correlation(a, b)) < CORR_LIMIT


def test_the_correlation_test_finds_a_correlation_of_rho():
    """The test above can fail: uniforms sharing a fraction of their bits with ``base`` (a
    correlation of 2 RHO) are caught."""
    base = uniforms(3, 5, 2, 1, N_CORR)
    mixed = torch.where(uniforms(9, 9, 9, 3, N_CORR) < 2 * RHO, base, uniforms(3, 5, 2, 2, N_CORR))
    assert abs(correlation(base, mixed)) >= CORR_LIMIT


def neighbours(x: torch.Tensor):
    lo = (x.view(torch.int32) & -65536).view(torch.float32)
    return lo, (lo.view(torch.int32) + 65536).view(torch.float32)


@pytest.mark.parametrize("p_bits", [0x8000, 0x5555, 0x0101, 0xFFF1])  # the fraction to the next bf16, in 2**-16
def test_rounding_is_unbiased_over_seeds(p_bits):
    """The rounding error of a value a fraction p of the way from one bfloat16 to the next has
    mean 0 and sd at most gap/2: with ``sample_size(gap / 100, gap / 2)`` roundings over seeds
    and steps, a bias of 1% of the gap is found with probability POWER."""
    x = torch.tensor([1.0 + p_bits * 2**-23]).float()  # bf16 gap at 1.0: 2**-7; low 16 bits: p_bits
    lo, hi = neighbours(x)
    gap = (hi - lo).item()
    p = p_bits / 2**16
    n = sample_size(gap / 100, gap / 2)
    per, seeds = 1024, -(-n // 1024)
    errors = []
    for seed in range(seeds):
        out = torch.empty(per, dtype=torch.bfloat16)
        round_counter_(out, x.expand(per).clone(), seed, seed % 7, 0, 0, 0)
        assert bool(((out.float() == lo) | (out.float() == hi)).all())
        errors.append(out.double() - x.double())
    err = torch.cat(errors)
    sd = gap * math.sqrt(p * (1 - p))
    assert abs(err.mean().item()) < Z_TWO_SIDED * sd / math.sqrt(err.numel())


def test_shards_round_as_the_whole_parameter():
    """A parameter rounded whole equals its dim-0 shards (runs from their offsets) and a dim-1
    shard (an index tensor), rounded one by one: the same bits for the same element."""
    torch.manual_seed(0)
    full = torch.randn(6, 10)
    whole = round_counter_(torch.empty(6, 10, dtype=torch.bfloat16), full.clone(), 2, 4, 1, 0, 0)
    rows = [(0, 3), (3, 5), (5, 6)]  # uneven, as FSDP2's torch.chunk shards are
    for a, b in rows:
        part = round_counter_(torch.empty(b - a, 10, dtype=torch.bfloat16), full[a:b].clone(), 2, 4, 1, 0,
                              block_index((b - a, 10), (6, 10), (a, 0)))
        assert torch.equal(part, whole[a:b])
    index = block_index((6, 4), (6, 10), (0, 6))
    assert torch.is_tensor(index)
    cols = round_counter_(torch.empty(6, 4, dtype=torch.bfloat16), full[:, 6:].clone(), 2, 4, 1, 0, index)
    assert torch.equal(cols, whole[:, 6:])


def test_paired_bits_are_the_halves_of_one_word_for_two_elements():
    """O8's bits for an SGD (one 8-bit state): elements 2i and 2i + 1 take word i's low and high halves,
    the weight bits 0..15 and the state bits 16..31, whatever run or index order draws them."""
    for seed, step, tensor in [(0, 0, 0), (2**63 - 1, 10**9, 5), (7, 1, 2**20)]:
        k = cb.key(seed, step, tensor, 0)
        for first in (0, 1, 2**32 - 3, 2**45 + 1):
            half = [cb.mix64(k + (i // 2 + 1) * cb.GAMMA) >> (32 * (i % 2)) & 0xFFFFFFFF for i in range(first, first + 5)]
            assert cb.halves(k, first, 5).tolist() == half
            assert cb.paired16(seed, step, tensor, 0, first, 5).tolist() == [h & 0xFFFF for h in half]
            assert cb.paired16(seed, step, tensor, 1, first, 5).tolist() == [h >> 16 for h in half]
    whole = cb.paired16(5, 9, 1, 1, 0, 1000)
    pieces = torch.cat([cb.paired16(5, 9, 1, 1, a, b - a) for a, b in [(0, 1), (1, 333), (333, 334), (334, 1000)]])
    assert torch.equal(whole, pieces)  # runs from odd offsets start on a high half
    picked = torch.tensor([999, 3, 3, 500])
    assert torch.equal(cb.paired16(5, 9, 1, 1, picked), whole[picked])
    with pytest.raises(ValueError, match="weight .0. and one state .1."):
        cb.paired16(5, 9, 1, 2, 0, 4)


@pytest.mark.parametrize("pair", ["weight and state", "a word's two elements", "neighbouring words"])
def test_no_correlation_in_the_paired_bits(pair):
    """The paired draws are as uncorrelated as the others (``test_no_correlation``'s test and power)."""
    def u(stream, first=0, n=N_CORR):
        return (cb.paired16(3, 5, 2, stream, first, n).double() + 0.5) / 2**16

    a, b = {"weight and state": (u(0), u(1)), "a word's two elements": (u(1, 0, 2 * N_CORR)[0::2], u(1, 0, 2 * N_CORR)[1::2]),
            "neighbouring words": (u(0, 0, 2 * N_CORR)[0::2], u(0, 2, 2 * N_CORR)[0::2])}[pair]
    assert abs(correlation(a, b)) < CORR_LIMIT
