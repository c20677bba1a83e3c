"""Random bits as a pure function of a counter: no generator state, the same on any layout.

SplitMix64 as a counter-based generator, keyed by ``(seed, step, tensor, element, stream)``.
Design: docs/design/memory-levels.md, "The counter bits".
"""
from typing import Union

import functools

import torch

__all__ = ["GAMMA", "mix64", "key", "words", "halves", "draws24", "shift24", "draws16", "shift16", "paired16"]

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
    k = _step_key(seed, step)
    for field in (tensor, word):
        k = mix64((k ^ field) + GAMMA)
    return k


@functools.lru_cache(maxsize=16)
def _step_key(seed: int, step: int) -> int:
    """`key`'s first two rounds, the same for every tensor of a step (computed once a step)."""
    return mix64((mix64(seed + GAMMA) ^ step) + GAMMA)


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


def halves(k: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """The 32 bits (int64) of each element of ``index`` (as in `words`) where elements ``2i`` and
    ``2i + 1`` share word ``i``: its low half and its high half."""
    if isinstance(index, int):
        index = torch.arange(index, index + n, dtype=torch.int64, device=device)
    z = words(k, index.bitwise_right_shift(1))
    return _shr(z, 32).where(index.bitwise_and(1).bool(), z).bitwise_and_(0xFFFFFFFF)


def draws24(seed: int, step: int, tensor: int, stream: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """Uniform 24-bit integers (int64, ``[0, 2**24)``) of state ``stream`` (1, 2, ...): for the
    elements ``index`` (int64 tensor) or the run of ``n`` from ``index`` (int): bits `shift24`
    up of word ``(stream - 1) // 2``, so streams 1 and 2 share word 0 with the weight's 16-bit
    draws (stream 0 of `draws16`)."""
    if stream < 1:
        raise ValueError(f"draws24: stream={stream}: the 24-bit draws are of state streams 1, 2, ...")
    z = words(key(seed, step, tensor, (stream - 1) // 2), index, n, device)
    return _shr(z, shift24(stream)).bitwise_and_((1 << 24) - 1)


def shift24(stream: int) -> int:
    """Where the 24-bit draws of state ``stream`` start in their word: 16 or 40."""
    return 16 + 24 * ((stream - 1) % 2)


def draws16(seed: int, step: int, tensor: int, stream: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """Uniform 16-bit integers (int32, ``[0, 2**16)``): quarter ``stream % 4`` (bits
    `shift16` up) of word ``stream // 4``."""
    z, shift = words(key(seed, step, tensor, stream // 4), index, n, device), shift16(stream)
    return (_shr(z, shift) if shift else z).bitwise_and_(0xFFFF).to(torch.int32)


def shift16(stream: int) -> int:
    """Where the 16-bit draws of ``stream`` start in their word."""
    return 16 * (stream % 4)


def paired16(seed: int, step: int, tensor: int, stream: int, index: Index, n: int = 0, device=None) -> torch.Tensor:
    """O8's draws for a parameter with one 8-bit state (an exact SGD's momentum): uniform 16-bit
    integers (int32) of ``stream`` 0 (the weight: bits 0..15) or 1 (the state: bits 16..31) of the
    element's `halves` of word stream 0, one hash for two elements."""
    if stream not in (0, 1):
        raise ValueError(f"paired16: stream={stream}: the paired draws are of the weight (0) and one state (1).")
    z = halves(key(seed, step, tensor, 0), index, n, device)
    return (z.bitwise_right_shift_(16) if stream else z.bitwise_and_(0xFFFF)).to(torch.int32)
