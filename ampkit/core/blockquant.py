"""Optimizer state in 8 bits between steps: per-block power-of-two scales, stochastic rounding.

A flat float32 tensor is cut into blocks of ``block_size`` elements (the last one shorter
when the size does not divide). Each block stores one float32 scale ``s``, a power of two,
and one byte per element, in one of two codes chosen by the byte tensor's dtype:

* ``int8``, signed linear (Adam's ``exp_avg``): ``x = q * s``, ``q`` in ``[-127, 127]``;
  ``s`` is the least power of two with ``absmax <= 127 s``.
* ``uint8``, unsigned dynamic exponent, ``e4m4`` (non-negative state: ``exp_avg_sq``, or
  its square root): code ``c = 16 E + M`` means ``(1 + M/16) 2**(E-15) s`` for ``E >= 1``
  and ``M 2**-18 s`` for ``E = 0`` (a linear run to zero, like float subnormals): 15
  binades below ``2 s`` at 4 mantissa bits, then 16 steps of ``2**-18 s``;
  ``s`` is the least power of two with ``absmax <= 1.9375 s`` (the largest code).

A value rounds to one of its two neighbouring codes, up with probability equal to its
position between them, from 24 random bits of ``generator``. Scaling by a power of two
is exact, as is the split into a lower code and a fraction (the codes are float bit
patterns, or integers), so a value already on the grid comes back exactly, and the
rounding is unbiased: ``E[dequantize(quantize(x))] == x`` exactly when the fraction is a
multiple of 2**-24 (always for ``|x| >= s/2`` in int8, and above the linear run in uint8),
and otherwise high by less than ``2**-24`` of the step.

A block holding a NaN or an infinity (or, in ``uint8``, a negative value) gets a NaN
scale: every element of that block dequantizes to NaN (no check synchronizes the device).
An all-zero block stores zeros. Finite values up to 2**127 (int8: 2**126) are in range.
"""
import torch

__all__ = ["quantize_", "dequantize", "num_blocks"]

_TOP = {torch.int8: 127.0, torch.uint8: 1.9375}  # the largest code's value, in units of s
_SUB = 2.0 ** -14  # uint8: the least normal code's value (E = 1, M = 0), in units of s
_BIAS = (127 - 15) << 4  # uint8: float32 bits >> 19, less this, is the code of a normal value


def num_blocks(numel: int, block_size: int = 256) -> int:
    """How many scales a flat tensor of ``numel`` elements needs."""
    return -(-numel // _check_block(block_size))


def quantize_(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, generator=None, block_size: int = 256) -> None:
    """Write float32 ``x`` (flat) into the codes ``q`` (int8 or uint8, ``x``'s shape) and the
    float32 ``scales`` (``num_blocks(x.numel(), block_size)``), rounding stochastically with
    ``generator`` (the device's default generator when ``None``)."""
    _check(q, scales, x, block_size, "quantize_", "x")
    if not x.numel():
        return
    y = x.abs()
    scales.copy_(_scales(x, y, q.dtype, block_size))
    _by_block_(y, scales, block_size, torch.Tensor.div_)
    y.nan_to_num_(0.0)  # the blocks with a NaN scale: any code reads back NaN (y is never infinite)
    low, frac = _split_linear(y) if q.dtype == torch.int8 else _split_e4m4(y)
    draw = _draws(x.numel(), x.device, generator)
    low.add_(draw.float().lt_(frac.mul_(1 << 24)))
    if q.dtype == torch.int8:
        low.copysign_(x)
    q.copy_(low)


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int = 256) -> torch.Tensor:
    """Write the float32 values that ``q`` and ``scales`` store into ``out`` (flat); return it."""
    _check(q, scales, out, block_size, "dequantize", "out")
    if not out.numel():
        return out
    if q.dtype == torch.int8:
        out.copy_(q)
    else:
        c = q.to(torch.int32)
        normal = c.add(_BIAS).bitwise_left_shift_(19).view(torch.float32)
        out.copy_(torch.where(c.ge(16), normal, c.float().mul_(2.0 ** -18)))
    return _by_block_(out, scales, block_size, torch.Tensor.mul_)


def _draws(n: int, device, generator) -> torch.Tensor:
    """``n`` uniform 24-bit integers (int32): the low 24 bits of each 32-bit half of uniform
    64-bit words, one full-range call (1.3-1.7x faster on CPU than a ranged int32 draw per element)."""
    words = torch.empty(-(-n // 2), dtype=torch.int64, device=device).random_(-2**63, None, generator=generator)
    return words.view(torch.int32)[:n].bitwise_and_((1 << 24) - 1)


def _scales(x: torch.Tensor, absx: torch.Tensor, dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """Each block's least power of two ``s`` with ``absmax <= top * s`` (``absx`` is ``x.abs()``),
    from ``absmax = m 2**e`` (``m`` in ``[0.5, 1)``): ``2**(e - 7)`` for int8, ``2**(e - 1)`` for
    uint8, twice that when ``m`` exceeds ``top / 128`` or ``top / 2``; NaN for a block the code
    cannot hold."""
    top, shift = _TOP[dtype], 7 if dtype == torch.int8 else 1
    amax = _per_block(absx, block_size, torch.amax)
    m, e = torch.frexp(amax)
    e.sub_(shift).add_(m.gt(top / 2 ** shift).to(e.dtype)).clamp_(-149, 127)
    bad = amax.isfinite().logical_not_().logical_or_(amax.gt(top * 2.0 ** 127))
    if dtype == torch.uint8:
        bad.logical_or_(_per_block(x, block_size, torch.amin).lt(0))
    return torch.ldexp(torch.ones_like(amax), e).masked_fill_(bad, float("nan"))


def _split_linear(y: torch.Tensor):
    """``y >= 0`` as its lower integer code and the fraction of the way to the next."""
    low = y.floor()
    return low, y.sub_(low)


def _split_e4m4(y: torch.Tensor):
    """``y`` in ``[0, 1.9375]`` as its lower e4m4 code (as float) and the fraction to the next."""
    bits = y.view(torch.int32)
    normal = y.ge(_SUB)
    linear = y.mul(2.0 ** 18)  # the linear run's codes in units of one step
    low = torch.where(normal, bits.bitwise_right_shift(19).sub_(_BIAS).float(), linear.floor())
    frac = torch.where(normal, bits.bitwise_and(0x7FFFF).float().mul_(2.0 ** -19), linear.sub_(low))
    return low, frac


def _per_block(t: torch.Tensor, block_size: int, reduce) -> torch.Tensor:
    """``reduce`` (``torch.amax``/``amin``) of each block of flat ``t``."""
    full = t.numel() // block_size * block_size
    parts = [reduce(t[:full].view(-1, block_size), dim=1)]
    if full < t.numel():
        parts.append(reduce(t[full:], dim=0, keepdim=True))
    return torch.cat(parts)


def _by_block_(t: torch.Tensor, scales: torch.Tensor, block_size: int, op) -> torch.Tensor:
    """Flat ``t`` divided or multiplied (``op``: ``Tensor.div_`` / ``mul_``) in place by each
    block's scale, broadcast over the blocks (no expanded copy of the scales)."""
    full = t.numel() // block_size * block_size
    op(t[:full].view(-1, block_size), scales[:full // block_size, None])
    if full < t.numel():
        op(t[full:], scales[-1:])
    return t


def _check_block(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected a positive integer.")
    return block_size


def _check(q, scales, x, block_size, fn: str, name: str) -> None:
    _check_block(block_size)
    for arg, t, ok in (("q", q, (torch.int8, torch.uint8)), ("scales", scales, (torch.float32,)), (name, x, (torch.float32,))):
        if not torch.is_tensor(t) or t.dtype not in ok or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"{fn}: {arg} must be a flat contiguous tensor of dtype {' or '.join(map(str, ok))}.")
    if q.numel() != x.numel() or scales.numel() != num_blocks(x.numel(), block_size):
        raise ValueError(f"{fn}: q must have {name}'s {x.numel()} elements and scales "
                         f"num_blocks({x.numel()}, {block_size}) = {num_blocks(x.numel(), block_size)}, "
                         f"got {q.numel()} and {scales.numel()}.")
    if len({q.device, scales.device, x.device}) > 1:
        raise ValueError(f"{fn}: q, scales and {name} must be on one device.")
