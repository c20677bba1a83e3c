"""O8's SGD step on one bfloat16 tensor with an 8-bit momentum buffer in one pass: the eager reference and the C kernel.

Design (blocks on the full parameter, the arithmetic, the backups): docs/design/kernels.md, "O8's SGD with an 8-bit buffer".
"""
import ctypes
from typing import Optional

import torch

from . import counter_bits, fused_adamw_8bit, native
from .blockquant import counter_draws, dequantize, quantize_
from .fused_adamw_8bit import BLOCK, in_runs, span, step_flat_
from .fused_sgd import BUFFER, NEW_BUFFER, Hyper, arithmetic
from .rounding import round_counter_

__all__ = ["step_", "steps_", "restore_", "backups"]


def step_eager(w, grad, bq, bs, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, first: int) -> bool:
    """The reference in torch ops on flat contiguous tensors: the blocks of ``blockquant.py``,
    shifted by ``first % BLOCK`` leading zeros (which change no block's scale and store code 0)."""
    lead, n = first % BLOCK, w.numel()

    def padded(t, dtype=torch.float32):
        return torch.cat([torch.zeros(lead, dtype=dtype), t.to(dtype)])

    buf = grad if new else dequantize(padded(bq, torch.int8), bs, torch.empty(lead + n), BLOCK)[lead:]
    p, buf = arithmetic(w, grad, buf, hyper, new)
    if not bool(p.isfinite().all()):
        return False
    round_counter_(w, p, seed, step, tensor, 0, first, paired=True)
    draws = padded(counter_draws(torch.empty(n, dtype=torch.int32), seed, step, tensor, 1, first, paired=True), torch.int32)
    codes = torch.empty(lead + n, dtype=torch.int8)
    quantize_(codes, bs, padded(buf), draws, BLOCK)
    bq.copy_(codes[lead:])
    return True


def step_native(lib, w, grad, bq, bs, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, first: int,
                backup) -> bool:
    """`step_eager` in one pass of the C kernel (contiguous CPU tensors), threads over ranges
    cut at block boundaries; ``backup``: ``(w, codes, scales)`` of the same sizes (flat), the
    old values put back on a non-finite step."""
    return steps_native(lib, [(w, grad, bq, bs, new, tensor, first, backup)], hyper, seed, step) == 1


def steps_native(lib, steps: list, hyper: Hyper, seed: int, step: int) -> int:
    """`step_native` of each ``(w, grad, bq, bs, new, tensor, first, backup)`` of ``steps`` (one
    param group's ``hyper``) in turn, in one call of the C kernel (``sgd_8bit_many``), stopping
    at the first whose new weight would not be finite (its old values put back, those after it
    untouched): how many wrote."""
    rows = [[t.data_ptr() for t in (w, grad, bq, bs, *backup)]
            + [w.numel(), first, counter_bits.key(seed, step, tensor, 0), NEW_BUFFER if new else BUFFER,
               native.threads(w.numel())] for w, grad, bq, bs, new, tensor, first, backup in steps]
    wrote = native.call_rows(lib.sgd_8bit_many, rows, hyper.flags(), (ctypes.c_float * 4)(*hyper.consts()))
    if wrote < len(steps):
        w, _, bq, bs, *_, backup = steps[wrote]
        restore_(w, bq, bs, backup)
    return wrote


def _check_sizes(w, grad, bq, bs, first: int) -> None:
    n = w.numel()
    if bs.numel() != span(n, first) or bq.shape != w.shape or grad.shape != w.shape:
        raise ValueError(f"fused_sgd_8bit.step_: grad and codes of w's shape {tuple(w.shape)} and {span(n, first)} "
                         f"scales expected (first={first}), got {tuple(grad.shape)}, {tuple(bq.shape)} and "
                         f"{bs.numel()}.")


def step_(w, grad, bq, bs, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, first: int,
          lib: Optional[ctypes.CDLL] = None, backup: Optional[tuple] = None) -> bool:
    """One SGD step with momentum of bf16 ``w`` (its bf16 ``grad``; the buffer as int8 codes
    ``bq`` and `span` float32 scales ``bs``, made from the gradient when ``new``) in place:
    with the kernel ``lib`` on CPU, else `step_eager`; the same bits either way. Returns False,
    having written nothing, when a new weight would not be finite. The old values go to
    ``backup`` (`backups`; fresh buffers when None), for `restore_`. Non-contiguous tensors are
    stepped through contiguous copies."""
    _check_sizes(w, grad, bq, bs, first)
    return step_flat_([w, grad, bq, bs], (0, 2, 3), backup, backups, lib, step_native, step_eager,
                      hyper, new, seed, step, tensor, first=first)


def steps_(steps: list, hyper: Hyper, seed: int, step: int, lib: Optional[ctypes.CDLL] = None) -> int:
    """`step_` of each ``(w, grad, bq, bs, new, tensor, first, backup)`` of ``steps`` (one param
    group's ``hyper``) in turn, stopping at the first whose new weight would not be finite (it
    wrote nothing): how many wrote. Each run of contiguous CPU tensors goes to the kernel in one call."""
    for w, grad, bq, bs, _, _, first, _ in steps:
        _check_sizes(w, grad, bq, bs, first)
    return in_runs(steps, lib, 4, lambda run: steps_native(lib, run, hyper, seed, step),
                   lambda w, grad, bq, bs, new, tensor, first, backup: step_(
                       w, grad, bq, bs, hyper, new, seed, step, tensor, first, lib, backup))


def restore_(w, bq, bs, backup: tuple) -> None:
    """Put back the values a `step_` wrote to ``backup``."""
    for t, b in zip((w, bq, bs), backup):
        t.copy_(b.view(t.shape))


def backups(sizes, scratch: dict) -> list:
    """Backup buffers ``(w, codes, scales)`` for each ``(elements, blocks)`` of ``sizes``
    (`fused_adamw_8bit.backups` with one int8 code)."""
    return fused_adamw_8bit.backups(sizes, scratch, (torch.int8,))
