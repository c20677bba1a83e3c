"""Exact fp32 masters held as the bfloat16 model weight plus a 16-bit remainder (2 + 2 bytes).

The weight is always O5's: ``w = x.to(torch.bfloat16)`` (round to nearest even, RNE). The
remainder is the step ``d`` from ``w``'s float32 bits to ``x``'s. Both share the sign bit, so
the int32 difference of their bit patterns is the difference of their magnitudes, in units
of one float32 ULP of ``x`` (2**-16 of a bfloat16 ULP): ``d`` in ``[-32767, 32767]`` when
``w``'s last bit is odd, ``[-32768, 32768]`` when it is even (``+-32768`` are the ties, and
a tie always rounds to the even neighbour). An even ``w`` has 65537 float32 values rounding
to it and an int16 holds 65536, so no encoding keeps every master exactly: at least one
value per even ``w`` must share a code with another, and a stored stand-in must still round
to ``w``, so it is another float32 value of the same cell, at least one ULP away.

This encoding loses that one value and no other, by exactly one ULP toward ``w`` (the
minimum), and it picks the value that exact arithmetic meets least: not a tie (sums of
dyadic numbers land on ties all the time) but ``d = +32767``, which it stores as
``+32766``; code ``32767`` of an even ``w`` then means ``d = +32768``, the tie. For an odd
``w`` every code is ``d`` itself (``-32768`` is never written). Hence, with ``e = 1`` when
``w`` is even::

    r = d - e * (d >= 32767)            x = bits(w) << 16 + r + e * (r == 32767)

Edge cases follow from the bit arithmetic: +-0 and subnormals are ordinary cells; a finite
``x`` above bfloat16's range (``|x| >= 0x7F7F8000``) gives ``w = +-inf``, as O5's copy does,
with ``d`` in ``[-32768, -1]``, so the master stays finite and exact; an infinite ``x`` gives
``r = 0`` and comes back infinite; a NaN gives torch's bfloat16 NaN with ``r = 0`` and comes
back NaN (its payload is not kept).
"""
from typing import List, Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from .flat import flat, flat_view

__all__ = ["split_", "combine", "master", "remainder"]

_LOST = 32767  # of an even w: d = +32767 is stored as 32766, and this code means d = +32768


def split_(ws: Sequence[torch.Tensor], rs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> None:
    """Write ``w = x.to(bfloat16)`` into each bfloat16 ``ws[i]`` and the remainder into each
    int16 ``rs[i]``, from float32 ``xs[i]`` (lists of tensors of matching shapes)."""
    _check(ws, rs, xs, "split_", "xs")
    if not xs:
        return
    x, w, r = flat(xs), _out(ws), _out(rs)
    w.copy_(x)  # torch's own conversion: w is bit for bit what O5's model copy holds
    bits = x.view(torch.int32)
    d = torch.sub(bits, _lost(bits))  # an even w's d = 32767 or 32768 moves down one
    d.mul_(bits.bitwise_and(0x7FFFFFFF).le_(0x7F800000))  # 0 for a NaN (int ops: no bool passes)
    r.copy_(d)  # the low 16 bits: w's shifted bits have none, so this is d (or its code)
    _scatter(ws, w)
    _scatter(rs, r)


def combine(ws: Sequence[torch.Tensor], rs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """Write the float32 master stored as ``(ws[i], rs[i])`` into each ``outs[i]``."""
    _check(ws, rs, outs, "combine", "outs")
    if not outs:
        return
    w, r, out = flat(ws), flat(rs), _out(outs)
    bits = out.view(torch.int32)
    bits.copy_(w.view(torch.int16)).bitwise_left_shift_(16).add_(r)
    bits.add_(bits.bitwise_and(0x1FFFF).eq_(_LOST))  # code 32767 of an even w: d = +32768
    _scatter(outs, out)


def _lost(bits: torch.Tensor) -> torch.Tensor:
    """1 where float32 ``bits`` lie 32767 or 32768 above an even bfloat16 value (bit 16 clear,
    low 16 bits 0x7FFF or 0x8000: the two values whose codes move down one), else 0 (int32)."""
    return bits.bitwise_and(0x1FFFF).sub_(_LOST).bitwise_right_shift_(1).eq_(0)


def _check(ws, rs, xs, fn: str, name: str) -> None:
    for arg, ts, dtype in (("ws", ws, torch.bfloat16), ("rs", rs, torch.int16), (name, xs, torch.float32)):
        if not isinstance(ts, (list, tuple)) or not all(torch.is_tensor(t) and t.dtype == dtype for t in ts):
            raise TypeError(f"{fn}: {arg} must be a list of {dtype} tensors.")
    if not len(ws) == len(rs) == len(xs) or any(not w.shape == r.shape == x.shape for w, r, x in zip(ws, rs, xs)):
        raise ValueError(f"{fn}: ws, rs and {name} must be lists of the same length with matching shapes.")
    if len({t.device for t in (*ws, *rs, *xs)}) > 1:
        raise ValueError(f"{fn}: ws, rs and {name} must all be on one device.")


def _out(ts: List[torch.Tensor]) -> torch.Tensor:
    """A flat tensor to write ``ts``'s values into: their flat view, or scratch for :func:`_scatter`."""
    view = flat_view(ts)
    return torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device) if view is None else view


def _scatter(ts: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``ts`` unless it is their own flat view (made by :func:`flat_view`)."""
    if flat._base is None:  # scratch from torch.empty; a view of ts has a base
        torch._foreach_copy_(list(ts), _unflatten_dense_tensors(flat, ts))


def master(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The float32 master one ``(w, r)`` pair holds, as a new tensor."""
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    combine([w], [r], [out])
    return out


def remainder(x: torch.Tensor) -> torch.Tensor:
    """The int16 remainder of float32 ``x`` against its bfloat16 rounding."""
    w = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    r = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    split_([w], [r], [x.contiguous()])
    return r
