"""Optimizer state in 8 bits between steps: per-block power-of-two scales, stochastic rounding.

Design (the blocks, the int8 and e4m4 codes, the rounding): docs/design/memory-levels.md, "The 8-bit codes".
"""
import functools
from typing import Optional

import torch

from . import counter_bits
from .counter_bits import Index

__all__ = ["quantize_", "dequantize", "num_blocks", "block_absmax", "counter_draws"]

_TOP = {torch.int8: 127.0, torch.uint8: 1.8125}  # the largest finite code's value, in units of s
_SUB = 2.0 ** -14  # uint8: the least normal code's value (E = 1, M = 0), in units of s
_BIAS = (127 - 15) << 4  # uint8: float32 bits >> 19, less this, is the code of a normal value
NAN_INT8, NAN_UINT8, INF_UINT8 = -128, 254, 255  # the codes of non-finite values
_DRAW_BLOCK = 1 << 15  # elements per block of counter_draws


def num_blocks(numel: int, block_size: int = 256, first: int = 0) -> int:
    """How many scales a flat tensor of ``numel`` elements needs whose element 0 is element
    ``first`` of the full tensor (the blocks it touches; none when it is empty)."""
    block_size = _check_block(block_size)
    return -(-(first % block_size + numel) // block_size) if numel else 0


def block_absmax(x: torch.Tensor, dtype: torch.dtype, block_size: int = 256, first: int = 0) -> torch.Tensor:
    """The largest magnitude of each block of flat float32 ``x`` (element 0 at ``first``) among
    the values that get a regular code of ``dtype`` (int8 or uint8): what a block's scale
    comes from. The maxima of a block split between several tensors (shards) combine by
    ``max``, and `quantize_` takes the combined ones as ``absmax``."""
    _check_block(block_size)
    _check_first(first, "block_absmax")
    if dtype not in _TOP:
        raise ValueError(f"block_absmax: dtype={dtype}: expected torch.int8 or torch.uint8.")
    if not torch.is_tensor(x) or x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise TypeError("block_absmax: x must be a flat contiguous tensor of dtype torch.float32.")
    y, _ = _magnitudes(x, dtype == torch.int8)
    return _per_block(y, block_size, torch.amax, first)


def quantize_(q: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, draws: Optional[torch.Tensor] = None,
              block_size: int = 256, limit=None, first: int = 0, absmax: Optional[torch.Tensor] = None) -> None:
    """Write float32 ``x`` (flat; element 0 at ``first``) into the codes ``q`` (int8 or uint8,
    ``x``'s shape) and the float32 ``scales`` (``num_blocks(x.numel(), block_size, first)``),
    each block's from ``absmax`` (float32, one per block, at least `block_absmax` of
    ``x``: a split block's maximum over all its parts) or from ``x``'s own; rounding
    stochastically with ``draws`` (int32, ``x``'s shape, uniform in ``[0, 2**24)``: `counter_draws`), or to
    nearest (ties toward zero) when ``None``: a value on the grid comes back exactly either way. With int8 codes, ``limit``
    (float32, ``x``'s shape, overwritten; NaN: no limit) caps each stored magnitude: a code
    never exceeds ``limit / s``."""
    _check(q, scales, x, block_size, "quantize_", "x", first)
    if absmax is not None and (not torch.is_tensor(absmax) or absmax.dtype != torch.float32
                               or absmax.shape != scales.shape or absmax.device != x.device):
        raise TypeError(f"quantize_: absmax must be a float32 tensor of scales' shape {tuple(scales.shape)} "
                        f"on x's device.")
    if draws is not None and (not torch.is_tensor(draws) or draws.dtype != torch.int32 or draws.shape != x.shape
                              or draws.device != x.device):
        raise TypeError(f"quantize_: draws must be an int32 tensor of x's shape {tuple(x.shape)} on x's device.")
    if limit is not None:
        _check_limit(q, x, limit)
    if not x.numel():
        return
    signed = q.dtype == torch.int8
    y, special = _magnitudes(x, signed)
    scales.copy_(_scales(_per_block(y, block_size, torch.amax, first) if absmax is None else absmax, q.dtype))
    _by_block_(y, scales, block_size, torch.Tensor.div_, first)
    low, frac = _split_linear(y) if signed else _split_e4m4(y)
    up = frac.gt_(0.5) if draws is None else draws.float().lt_(frac.mul_(1 << 24))  # exact: 24 bits fit a float
    low.add_(up)
    if limit is not None:
        cap = _by_block_(limit, scales, block_size, torch.Tensor.div_, first).floor_()
        low.clamp_max_(cap.nan_to_num_(nan=float("inf"), posinf=float("inf")))
    q.copy_(low.copysign_(x) if signed else low)
    for mask, code in special:
        q.masked_fill_(mask, code)


def _magnitudes(x: torch.Tensor, signed: bool):
    """``|x|`` with the values of `_special` zeroed (no part in a block's scale), and those."""
    special = _special(x, signed)
    y = x.abs()
    for mask, _ in special:
        y.masked_fill_(mask, 0.0)
    return y, special


def _special(x: torch.Tensor, signed: bool) -> list:
    """``(mask, code)`` of the values of ``x`` with a code of their own: NaN and +-inf (uint8:
    NaN, negative; +inf and above the top code). Empty on the CPU when one pass finds none
    (on an accelerator that check would synchronize; the masks cost less)."""
    top = _TOP[torch.uint8] * 2.0 ** 127
    if x.device.type == "cpu":
        lo, hi = torch.aminmax(x)  # NaN if any is
        if (lo.isfinite() & hi.isfinite()).item() if signed else (lo.ge(0) & hi.le(top)).item():
            return []
    if signed:
        return [(x.isfinite().logical_not_(), NAN_INT8)]
    return [(x.ge(0.0).logical_not_(), NAN_UINT8), (x.gt(top), INF_UINT8)]


def dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int = 256,
               first: int = 0) -> torch.Tensor:
    """Write the float32 values that ``q`` and ``scales`` store into ``out`` (flat; element 0
    at ``first``, as quantized); return it."""
    _check(q, scales, out, block_size, "dequantize", "out", first)
    if not out.numel():
        return out
    torch.index_select(_values(q.dtype, q.device), 0, q.view(torch.uint8).int(), out=out)
    return _by_block_(out, scales, block_size, torch.Tensor.mul_, first)


@functools.lru_cache(maxsize=None)
def _values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each code's value in units of its scale, indexed by the code's byte (0..255)."""
    c = torch.arange(256, dtype=torch.int32)
    if dtype == torch.int8:
        values = c.sub(256 * (c >= 128).int()).float()
        values[NAN_INT8 % 256] = float("nan")
    else:
        normal = c.add(_BIAS).bitwise_left_shift_(19).view(torch.float32)
        values = torch.where(c.ge(16), normal, c.float().mul_(2.0 ** -18))
        values[NAN_UINT8], values[INF_UINT8] = float("nan"), float("inf")
    return values.to(device)


def counter_draws(out: torch.Tensor, seed: int, step: int, tensor: int, stream: int, index: Index,
                  paired: bool = False) -> torch.Tensor:
    """Fill int32 ``out`` (flat) with uniform 24-bit integers: the counter bits
    `counter_bits.draws24` of ``(seed, step, tensor, stream)`` (``stream`` 1, 2, ...) at the elements ``index,
    index + 1, ...`` (an int), or at ``index`` (an int64 tensor of ``out``'s size); ``paired`` (a
    parameter's one state, ``stream`` 1): `counter_bits.paired16`'s 16 bits as the top of 24. Return it.
    In blocks, so the int64 words stay in cache."""
    index = index.reshape(-1).to(out.device) if torch.is_tensor(index) else index
    for lo in range(0, out.numel(), _DRAW_BLOCK):
        hi = min(out.numel(), lo + _DRAW_BLOCK)
        at = index[lo:hi] if torch.is_tensor(index) else index + lo
        out[lo:hi] = (counter_bits.paired16(seed, step, tensor, stream, at, hi - lo, out.device).bitwise_left_shift_(8)
                      if paired else counter_bits.draws24(seed, step, tensor, stream, at, hi - lo, out.device))
    return out


def _scales(absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each block's least power of two ``s`` with ``absmax <= top * s`` (``absmax``: finite and
    non-negative), from ``absmax = m 2**e`` (``m`` in ``[0.5, 1)``): ``2**(e - 7)`` for int8,
    ``2**(e - 1)`` for uint8, twice that when ``m`` exceeds ``top / 128`` or ``top / 2``; at
    most ``2**127``."""
    top, shift = _TOP[dtype], 7 if dtype == torch.int8 else 1
    m, e = torch.frexp(absmax)
    e.sub_(shift).add_(m.gt(top / 2 ** shift).to(e.dtype)).clamp_(-149, 127)
    return torch.ldexp(torch.ones_like(m), e)


def _split_linear(y: torch.Tensor):
    """``y >= 0`` as its lower integer code and the fraction of the way to the next."""
    low = y.floor()
    return low, y.sub_(low)


def _split_e4m4(y: torch.Tensor):
    """``y`` in ``[0, 1.8125]`` as its lower e4m4 code (as float) and the fraction to the next."""
    bits = y.view(torch.int32)
    normal = y.ge(_SUB)
    linear = y.mul(2.0 ** 18)  # the linear run's codes in units of one step
    low = torch.where(normal, bits.bitwise_right_shift(19).sub_(_BIAS).float(), linear.floor())
    frac = torch.where(normal, bits.bitwise_and(0x7FFFF).float().mul_(2.0 ** -19), linear.sub_(low))
    return low, frac


def _pieces(numel: int, block_size: int, first: int):
    """Flat ``[0, numel)`` (element 0 at ``first``) as a partial head block, a run of full
    blocks and a partial tail block: ``(head, full)``, their lengths (the tail: the rest)."""
    head = min(numel, -first % block_size)
    return head, (numel - head) // block_size * block_size


def _per_block(t: torch.Tensor, block_size: int, reduce, first: int = 0) -> torch.Tensor:
    """``reduce`` (``torch.amax``) of each block of flat ``t`` (element 0 at ``first``)."""
    head, full = _pieces(t.numel(), block_size, first)
    parts = [reduce(t[head:head + full].view(-1, block_size), dim=1)]
    if head:
        parts.insert(0, reduce(t[:head], dim=0, keepdim=True))
    if head + full < t.numel():
        parts.append(reduce(t[head + full:], dim=0, keepdim=True))
    return torch.cat(parts)


def _by_block_(t: torch.Tensor, scales: torch.Tensor, block_size: int, op, first: int = 0) -> torch.Tensor:
    """Flat ``t`` (element 0 at ``first``) divided or multiplied (``op``: ``Tensor.div_`` /
    ``mul_``) in place by each block's scale, broadcast over the blocks (no expanded copy)."""
    head, full = _pieces(t.numel(), block_size, first)
    lead = 1 if head else 0
    if head:
        op(t[:head], scales[:1])
    op(t[head:head + full].view(-1, block_size), scales[lead:lead + full // block_size, None])
    if head + full < t.numel():
        op(t[head + full:], scales[-1:])
    return t


def _check_block(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r}: expected a positive integer.")
    return block_size


def _check_first(first, fn: str) -> None:
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{fn}: first={first!r}: expected a non-negative integer "
                         f"(the full tensor's index of element 0).")


def _check(q, scales, x, block_size, fn: str, name: str, first: int = 0) -> None:
    _check_block(block_size)
    _check_first(first, fn)
    for arg, t, ok in (("q", q, (torch.int8, torch.uint8)), ("scales", scales, (torch.float32,)), (name, x, (torch.float32,))):
        if not torch.is_tensor(t) or t.dtype not in ok or t.dim() != 1 or not t.is_contiguous():
            raise TypeError(f"{fn}: {arg} must be a flat contiguous tensor of dtype {' or '.join(map(str, ok))}.")
    need = num_blocks(x.numel(), block_size, first)
    if q.numel() != x.numel() or scales.numel() != need:
        at = f", first={first}" if first else ""
        raise ValueError(f"{fn}: q must have {name}'s {x.numel()} elements and scales "
                         f"num_blocks({x.numel()}, {block_size}{at}) = {need}, "
                         f"got {q.numel()} and {scales.numel()}.")
    if len({q.device, scales.device, x.device}) > 1:
        raise ValueError(f"{fn}: q, scales and {name} must be on one device.")


def _check_limit(q, x, limit) -> None:
    if q.dtype != torch.int8:
        raise ValueError(f"quantize_: limit caps int8 codes only, got q of dtype {q.dtype}.")
    if (not torch.is_tensor(limit) or limit.dtype != torch.float32 or limit.shape != x.shape
            or not limit.is_contiguous() or limit.device != x.device):
        raise TypeError(f"quantize_: limit must be a contiguous float32 tensor of x's shape {tuple(x.shape)} "
                        f"on x's device.")
