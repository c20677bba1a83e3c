"""SGD with momentum on remainder masters in one pass per tensor: the eager reference and the C kernel.

The master held as bf16 weight + int16 remainder + side table (``remainder.py``) is combined,
stepped with ``torch.optim.SGD``'s arithmetic on float32 (``fused_sgd.arithmetic``: O5's fused SGD
masters' bits) and split back. Design: docs/design/kernels.md, "Masters".
"""
import ctypes
from typing import Optional

import torch

from . import native
from .fused_masters import _check, captured, stepped_table
from .fused_sgd import BUFFER, NEW_BUFFER, NO_BUFFER, Hyper, step_master_eager
from .remainder import combine, set_side_table, side_table, split_

__all__ = ["step_", "step_table_"]


def step_eager(w, r, grad, buf, hyper: Hyper, new: bool) -> None:
    """The reference: `.remainder.combine`, `.fused_sgd.step_master_eager` on the float32 master
    with the widened gradient, `.remainder.split_`."""
    x = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    combine([w], [r], [x])
    step_master_eager(x, grad.float(), buf, hyper, new)
    split_([w], [r], [x])


def step_native(lib, w, r, grad, buf, hyper: Hyper, new: bool, table: torch.Tensor) -> torch.Tensor:
    """`step_eager` in one pass of the C kernel (contiguous CPU tensors, ``table`` ascending);
    returns the new side table."""
    consts, flags = (ctypes.c_float * 4)(*hyper.consts()), hyper.flags()
    mode = NO_BUFFER if buf is None else NEW_BUFFER if new else BUFFER
    tensors, listed = (w, r, grad) if buf is None else (w, r, grad, buf), (table.data_ptr(), table.numel())

    def call(lo, hi, found, cap, counts, done, threads):
        at = [native.ptr(t, lo) for t in tensors] + [None] * (buf is None)
        lib.sgd_remainder(*at, hi - lo, lo, *listed, found, cap, counts, done, mode, flags, consts, threads)
    return captured(call, w.numel())


def step_(w, r, grad, buf, hyper: Hyper, new: bool, lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of the float32 master held as bfloat16 ``w`` and int16 ``r`` (and its side
    table), with bfloat16 ``grad`` and the float32 momentum buffer ``buf`` (None when momentum is
    0, written from the gradient when ``new``), in place: with the kernel ``lib`` on CPU, else
    `step_eager`; the same bits either way."""
    set_side_table(r, step_table_(w, r, grad, buf, hyper, new, side_table(r), lib))


def step_table_(w, r, grad, buf, hyper: Hyper, new: bool, table: torch.Tensor,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`step_` with ``r``'s side table given as ``table``: returns the new table (a tensor of its
    own) instead of setting it."""
    tensors = [w, r, grad] + ([] if buf is None else [buf])
    _check(tensors, [torch.bfloat16, torch.int16, torch.bfloat16, torch.float32], "sgd remainder step_",
           ["w", "r", "grad", "buf"])

    def native_step(flat, table):
        return step_native(lib, *flat[:3], flat[3] if buf is not None else None, hyper, new, table)
    return stepped_table(tensors, table, lib, [0, 1, 3], lambda: step_eager(w, r, grad, buf, hyper, new), native_step)
