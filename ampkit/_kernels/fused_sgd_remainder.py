"""SGD with momentum on remainder masters in one pass per tensor: the eager reference and the C kernel.

The master held as bf16 weight + int16 remainder + side table (``remainder.py``) is combined,
stepped with ``torch.optim.SGD``'s arithmetic on float32 (``fused_sgd.arithmetic``: O5's fused SGD
masters' bits) and split back. Design: docs/design/kernels.md, "Masters".
"""
import ctypes
from typing import Optional

import torch

from . import native
from .fused_masters import _check, captured, captured_many, in_one_call, stepped_table
from .fused_sgd import Hyper, _mode, step_master_eager
from .remainder import combine, set_side_table, side_table, split_

__all__ = ["step_", "step_table_", "steps_table_"]


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
    return captured(_call(lib, w, r, grad, buf, hyper, new, table), w.numel())


def steps_native(lib, steps: list, hyper: Hyper) -> list:
    """`step_native` of each ``(w, r, grad, buf, new, table)`` of ``steps`` (not empty; ``buf``
    None for all or none) in one call of the C kernel (``sgd_remainder_many``): their new side
    tables."""
    def call_many(plans, found, counts, done):
        rows = [[w.data_ptr(), r.data_ptr(), grad.data_ptr(), native.address(buf), table.data_ptr(), table.numel(),
                 w.numel(), *plan, _mode(buf, new)] for (w, r, grad, buf, new, table), plan in zip(steps, plans)]
        native.call_rows(lib.sgd_remainder_many, rows, hyper.flags(), (ctypes.c_float * 4)(*hyper.consts()), found,
                         counts, done)

    def call_of(i):
        w, r, grad, buf, new, table = steps[i]
        return _call(lib, w, r, grad, buf, hyper, new, table)
    return captured_many(call_many, call_of, [s[0].numel() for s in steps])


def _call(lib, w, r, grad, buf, hyper: Hyper, new: bool, table: torch.Tensor):
    """`captured`'s ``call`` of one step."""
    consts, flags, mode = (ctypes.c_float * 4)(*hyper.consts()), hyper.flags(), _mode(buf, new)
    tensors, listed = (w, r, grad) if buf is None else (w, r, grad, buf), (table.data_ptr(), table.numel())

    def call(lo, hi, found, cap, counts, done, threads):
        at = [native.ptr(t, lo) for t in tensors] + [None] * (buf is None)
        lib.sgd_remainder(*at, hi - lo, lo, *listed, found, cap, counts, done, mode, flags, consts, threads)
    return call


def step_(w, r, grad, buf, hyper: Hyper, new: bool, lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of the float32 master held as bfloat16 ``w`` and int16 ``r`` (and its side
    table), with bfloat16 ``grad`` and the float32 momentum buffer ``buf`` (None when momentum is
    0, written from the gradient when ``new``), in place: with the kernel ``lib`` on CPU, else
    `step_eager`; the same bits either way."""
    set_side_table(r, step_table_(w, r, grad, buf, hyper, new, side_table(r), lib))


def steps_table_(steps: list, hyper: Hyper, lib: Optional[ctypes.CDLL] = None) -> list:
    """`step_table_` of each ``(w, r, grad, buf, new, table)`` of ``steps`` (one group: ``buf``
    None for all or none): those the kernel ``lib`` reads where they are (not empty) in one call,
    the others one at a time (all checked first); the new tables, in order."""
    for w, r, grad, buf, *_ in steps:
        _checked(w, r, grad, buf)
    return in_one_call(steps, lib, 4, lambda lib, run: steps_native(lib, run, hyper),
                       lambda w, r, grad, buf, new, table: step_table_(w, r, grad, buf, hyper, new, table, lib))


def step_table_(w, r, grad, buf, hyper: Hyper, new: bool, table: torch.Tensor,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`step_` with ``r``'s side table given as ``table``: returns the new table (a tensor of its
    own) instead of setting it."""
    tensors = _checked(w, r, grad, buf)

    def native_step(flat, table):
        return step_native(lib, *flat[:3], flat[3] if buf is not None else None, hyper, new, table)
    return stepped_table(tensors, table, lib, [0, 1, 3], lambda: step_eager(w, r, grad, buf, hyper, new), native_step)


def _checked(w, r, grad, buf) -> list:
    """`step_table_`'s tensors (``buf`` where given), checked."""
    tensors = [w, r, grad] + ([] if buf is None else [buf])
    _check(tensors, [torch.bfloat16, torch.int16, torch.bfloat16, torch.float32], "sgd remainder step_",
           ["w", "r", "grad", "buf"])
    return tensors
