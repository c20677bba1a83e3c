"""Random bits as a pure function of a counter: no generator state, the same on any layout.

The stochastic rounding of a tensor element at a training step takes its bits from
``(seed, step, tensor, element, stream)``: the run's seed, the rounder's step counter, the
tensor's index among the optimizer's parameters, the element's flat index in its *full*
parameter (an FSDP2 shard adds its global offset), and the stream (0: the weight, 1, 2,
...: the parameter's elementwise optimizer states in order). So the numbers do not depend on
chunking, thread count, shard layout or world size, there is no state to checkpoint but
``(seed, step)``, and any kernel can compute the bits of any element on its own.

The function is SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) read as a counter-based generator: the 64-bit word of element
``i`` under key ``k`` is ``mix64(k + (i + 1) * GAMMA)`` (``GAMMA`` the odd golden-ratio
constant, ``mix64`` Stafford's "variant 13" finalizer, a bijection whose output bits each
depend on every input bit). Successive ``i`` walk one Weyl sequence, the SplitMix64
generator, which passes TestU01's BigCrush; the key, a chain of ``mix64`` over ``(seed,
step, tensor, word)``, places each run of elements at a pseudo-random point of that
sequence of period 2**64. Two runs overlap (one repeats the other's words, shifted) with
probability about ``(len_a + len_b) / 2**64``: a training run of ``T`` draws in runs of
``L`` elements has about ``T**2 / (L 2**64)`` overlapping pairs (0.05 for 1000 steps of
10**9 elements in runs of 10**6; 500 for 10**5 steps), each pairing the rounding decisions
of two runs of elements (a weak, local dependence, not a bias).

A word serves several streams: 32-bit draws (`bits32`) of stream ``s`` are half
``s % 2`` (low, high) of word ``s // 2``; 16-bit draws (`draws16`, bfloat16's
stochastic rounding) are quarter ``s % 4`` (bits ``16 (s % 4)`` up) of word ``s // 4``, so
O7's weight and two bfloat16 moments (streams 0, 1, 2) cost one hash per element.

In torch, ``int64`` multiplication and addition wrap modulo 2**64 (two's complement), as the
unsigned arithmetic of the definition does; right shifts are arithmetic, so each is
masked to the logical shift. A C kernel computing the same words in ``uint64_t`` gives the
same bits.
"""
from typing import Union

import torch

__all__ = ["GAMMA", "mix64", "key", "words", "bits32", "draws16", "shift16"]

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
Index = Union[int, torch.Tensor]  # the first element's index (a run), or every element's


def _signed(x: int) -> int:
    """A 64-bit unsigned integer as the int64 with the same bits."""
    return x - (1 << 64) if x >> 63 else x


def mix64(z: int) -> int:
    """Stafford's mix13 of a Python integer (taken modulo 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def key(seed: int, step: int, tensor: int, word: int) -> int:
    """The 64-bit key (unsigned) of word stream ``word`` of ``tensor`` at ``step``."""
    k = mix64(seed + GAMMA)
    for field in (step, tensor, word):
        k = mix64((k ^ field) + GAMMA)
    return k


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s``."""
    return z.bitwise_right_shift(s).bitwise_and_((1 << (64 - s)) - 1)


def words(k: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """The int64 words ``mix64(k + (i + 1) GAMMA)`` of ``index`` (an int64 tensor of element
    indices), or of the ``n`` elements ``index, index + 1, ...`` when ``index`` is an int."""
    if isinstance(index, int):
        index = torch.arange(index, index + n, dtype=torch.int64, device=device)
    z = index.add(1).mul_(_signed(GAMMA)).add_(_signed(k & MASK64))
    z = z.bitwise_xor_(_shr(z, 30)).mul_(_signed(M1))
    z = z.bitwise_xor_(_shr(z, 27)).mul_(_signed(M2))
    return z.bitwise_xor_(_shr(z, 31))


def bits32(seed: int, step: int, tensor: int, stream: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """32 uniform random bits per element (as int64 in ``[0, 2**32)``) of ``stream``: for the
    elements ``index`` (int64 tensor) or the run of ``n`` from ``index`` (int): half ``stream
    % 2`` of word ``stream // 2``."""
    z = words(key(seed, step, tensor, stream // 2), index, n, device)
    return (_shr(z, 32) if stream % 2 else z.bitwise_and_(0xFFFFFFFF))


def draws16(seed: int, step: int, tensor: int, stream: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """Uniform 16-bit integers (int32, ``[0, 2**16)``): quarter ``stream % 4`` (bits
    `shift16` up) of word ``stream // 4``."""
    z, shift = words(key(seed, step, tensor, stream // 4), index, n, device), shift16(stream)
    return (_shr(z, shift) if shift else z).bitwise_and_(0xFFFF).to(torch.int32)


def shift16(stream: int) -> int:
    """Where the 16-bit draws of ``stream`` start in their word."""
    return 16 * (stream % 4)
