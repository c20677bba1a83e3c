"""Exact fp32 masters held as the bfloat16 model weight plus a 16-bit remainder (2 + 2 bytes),
and a small side table for the few values 16 bits cannot hold.

Design (the encoding, the side table, edge cases): docs/design/memory-levels.md, "The remainder encoding".
"""
from itertools import accumulate
from typing import List, Optional, Sequence

import torch
from torch._utils import _unflatten_dense_tensors

from .flat import flat, flat_view

__all__ = ["split_", "combine", "master", "remainder", "side_table", "set_side_table"]

_LOST = 32767  # of an even w: d = +32767 is stored as 32766 (and listed), and this code means d = +32768
_TABLE = "_ampkit_side_table"  # the attribute of an int16 remainder that holds its side table
_BLOCK = 1024  # elements per block when looking for the rare candidates


def split_(ws: Sequence[torch.Tensor], rs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> None:
    """Write ``w = x.to(bfloat16)`` into each bfloat16 ``ws[i]``, the remainder into each int16
    ``rs[i]`` and its side table onto ``rs[i]``, from float32 ``xs[i]`` (lists of tensors of
    matching shapes)."""
    _check(ws, rs, xs, "split_", "xs")
    if not xs:
        return
    x, w, r = flat(xs), _out(ws), _out(rs)
    w.copy_(x)  # torch's own conversion: w is bit for bit what O5's model copy holds
    bits = x.view(torch.int32)
    moved = _moved(bits)
    found = _nonzero(moved)  # before moved is overwritten: the candidates for the side table
    r.copy_(torch.sub(bits, moved, out=moved))  # low 16 bits: w's shifted bits have none, so this is d (or its code)
    _scatter(ws, w)
    _scatter(rs, r)
    _set_tables(rs, _plus_one(bits, found))


def combine(ws: Sequence[torch.Tensor], rs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """Write the float32 master stored as ``(ws[i], rs[i])`` and ``rs[i]``'s side table into
    each ``outs[i]``."""
    _check(ws, rs, outs, "combine", "outs")
    if not outs:
        return
    w, r, out = flat(ws), flat(rs), _out(outs)
    bits = out.view(torch.int32)
    bits.copy_(w.view(torch.int16)).bitwise_left_shift_(16).add_(r)
    bits.add_(bits.bitwise_and(0x1FFFF).eq_(_LOST))  # code 32767 of an even w: d = +32768
    listed = _tables(rs)
    if listed is not None:  # code 32766 of an even w, listed: d = +32767
        held = bits[listed]
        bits[listed] = held + held.bitwise_and(0x1FFFF).eq_(_LOST - 1)
    _scatter(outs, out)


def side_table(r: torch.Tensor, empty: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The flat indices (int64) of ``r``'s elements whose master lies one ULP above what the
    16 bits hold (``d = +32767`` above an even ``w``); when there are none, ``empty`` (an
    empty int64 tensor, not to be written) or a new empty tensor."""
    table = vars(r).get(_TABLE)
    if table is not None:
        return table
    return torch.zeros(0, dtype=torch.int64, device=r.device) if empty is None else empty


def set_side_table(r: torch.Tensor, table: torch.Tensor) -> None:
    """Give ``r`` the side table ``table`` (flat indices, int64, ascending, as `split_`
    finds them; kept as given), or none when ``table`` is empty."""
    if table.numel():
        setattr(r, _TABLE, table)
    else:
        vars(r).pop(_TABLE, None)


def _moved(bits: torch.Tensor) -> torch.Tensor:
    """1 where float32 ``bits`` lie 32767 or 32768 above an even bfloat16 value (bit 16 clear,
    low 16 bits 0x7FFF or 0x8000: the two values whose codes move down one), else 0 (int32,
    new): ``bits + 1`` has low 17 bits 0x8000 or 0x8001."""
    return torch.add(bits, 1).bitwise_and_(0x1FFFE).eq_(0x8000)


def _nonzero(marks: torch.Tensor) -> torch.Tensor:
    """The flat indices of the nonzero elements of the mostly zero int32 ``marks``: one
    max per block of `_BLOCK`, then a look into the blocks that hold one."""
    full = marks.numel() - marks.numel() % _BLOCK
    found = [marks[full:].nonzero().flatten().add_(full)]
    if full:
        rows = marks[:full].view(-1, _BLOCK)
        held = rows.amax(1).nonzero().flatten()
        if held.numel():
            at = rows[held].nonzero()
            found.insert(0, held[at[:, 0]].mul_(_BLOCK).add_(at[:, 1]))
    return found[0] if len(found) == 1 else torch.cat(found)


def _plus_one(bits: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """Of the indices ``found``, those whose float32 ``bits`` lie exactly 32767 above an even
    bfloat16 value (low 17 bits 0x07FFF) and are not NaN."""
    if not found.numel():
        return found
    held = bits[found]
    return found[held.bitwise_and(0x1FFFF).eq(_LOST) & held.bitwise_and(0x7FFFFFFF).lt(0x7F800000)]


def _set_tables(rs: Sequence[torch.Tensor], listed: torch.Tensor) -> None:
    """Give each ``rs[i]`` its part of ``listed`` (flat indices into them all, ascending) as
    its side table; a remainder with none holds no table."""
    if not listed.numel():
        for r in rs:
            set_side_table(r, listed)
        return
    sizes = [r.numel() for r in rs]
    ends = torch.tensor(list(accumulate(sizes)), dtype=torch.int64, device=listed.device)
    owner = torch.searchsorted(ends, listed, right=True)
    local = listed - (ends - torch.tensor(sizes, dtype=torch.int64, device=listed.device))[owner]
    for r, part in zip(rs, local.split(torch.bincount(owner, minlength=len(rs)).tolist())):
        set_side_table(r, part.clone())  # its own storage: footprint counts what each keeps


def _tables(rs: Sequence[torch.Tensor]):
    """The side tables of ``rs`` as flat indices into them all, or None when none has one."""
    parts, at = [], 0
    for r in rs:
        table = vars(r).get(_TABLE)
        if table is not None:
            parts.append(table + at if at else table)
        at += r.numel()
    return torch.cat(parts) if parts else None


def _check(ws, rs, xs, fn: str, name: str) -> None:
    for arg, ts, dtype in (("ws", ws, torch.bfloat16), ("rs", rs, torch.int16), (name, xs, torch.float32)):
        if not isinstance(ts, (list, tuple)) or not all(torch.is_tensor(t) and t.dtype == dtype for t in ts):
            raise TypeError(f"{fn}: {arg} must be a list of {dtype} tensors.")
    if not len(ws) == len(rs) == len(xs) or any(not w.shape == r.shape == x.shape for w, r, x in zip(ws, rs, xs)):
        raise ValueError(f"{fn}: ws, rs and {name} must be lists of the same length with matching shapes.")
    if len({t.device for t in (*ws, *rs, *xs)}) > 1:
        raise ValueError(f"{fn}: ws, rs and {name} must all be on one device.")


def _out(ts: List[torch.Tensor]) -> torch.Tensor:
    """A flat tensor to write ``ts``'s values into: their flat view, or scratch for `_scatter`."""
    view = flat_view(ts)
    return torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device) if view is None else view


def _scatter(ts: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``ts`` unless it is their own flat view (made by `flat_view`)."""
    if flat._base is None:  # scratch from torch.empty; a view of ts has a base
        torch._foreach_copy_(list(ts), _unflatten_dense_tensors(flat, ts))


def master(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The float32 master one ``(w, r)`` pair (and ``r``'s side table) holds, as a new tensor."""
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    combine([w], [r], [out])
    return out


def remainder(x: torch.Tensor) -> torch.Tensor:
    """The int16 remainder of float32 ``x`` against its bfloat16 rounding, with its side table."""
    w = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    r = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    split_([w], [r], [x.contiguous()])
    return r
