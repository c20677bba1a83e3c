"""fp32 master weights held as the bf16 model weight plus a 16-bit remainder (12 bytes/param with AdamW).

A float32 ``x`` is its bfloat16 round-to-nearest-even ``w`` (what O5's model holds) plus the
difference of their bit patterns, ``r = bits(x) - bits(w) * 2**16``, counted in units of
``2**-16`` of ``w``'s last place. Round-to-nearest keeps ``r`` in ``[-32768, 32768]``: 65537
states, one more than 16 bits hold, needed only exactly at a tie that rounded *down* to an even
``w`` (``r = +32768``). That one case is stored as ``r = 32767``: the master is one float32 ulp
below the tie, the least change that keeps ``w`` (nothing closer rounds to ``w``; ``w`` is
unchanged). Every other master, ties rounded up included (``r = -32768``), is exact. The
arithmetic is modulo ``2**32`` on the bit patterns, so signs, zeros, subnormals and infinities
need no special case (a float32 above bfloat16's range rounds to ``inf``, and its remainder
saturates; a NaN stays NaN).
"""
from typing import List

import torch

_LOW, _HIGH = -(1 << 15), (1 << 15) - 1


def _high_bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)


def split_(ws: List[torch.Tensor], rs: List[torch.Tensor], xs: List[torch.Tensor]) -> None:
    """``ws[i] = bf16(xs[i])`` (round to nearest even) and ``rs[i]`` (int16) the remainder."""
    for w, r, x in zip(ws, rs, xs):
        w.copy_(x)
        diff = x.view(torch.int32) - _high_bits(w)
        r.copy_(diff.clamp_(_LOW, _HIGH))


def combine_(outs: List[torch.Tensor], ws: List[torch.Tensor], rs: List[torch.Tensor]) -> None:
    """``outs[i]`` (float32) = the master that ``ws[i]`` (bf16) and ``rs[i]`` (int16) hold."""
    for out, w, r in zip(outs, ws, rs):
        out.view(torch.int32).copy_(_high_bits(w).add_(r))


def split(x: torch.Tensor):
    """``(w, r)`` for one float32 tensor."""
    w, r = torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.int16)
    split_([w], [r], [x])
    return w, r


def combine(w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(w, dtype=torch.float32)
    combine_([out], [w], [r])
    return out
