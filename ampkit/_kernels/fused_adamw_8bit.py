"""O8's AdamW step on one bfloat16 tensor with 8-bit state in one pass: the eager reference and the C kernel.

Design (blocks on the full parameter, the step, the backups): docs/design/kernels.md, "O8's AdamW on 8-bit state".
"""
import ctypes
import itertools
import math
from typing import Callable, Optional

import torch

from . import counter_bits, native
from .blockquant import counter_draws, dequantize, quantize_
from .fused_adamw import Hyper, arithmetic
from .ieee import sqrt
from .rounding import round_counter_

__all__ = ["BLOCK", "span", "step_", "steps_", "step_flat_", "restore_", "backups", "in_runs", "until_short"]

BLOCK = 256


def span(n: int, first: int) -> int:
    """How many blocks (scales) the ``n`` elements from global index ``first`` touch."""
    return 0 if n == 0 else (first + n - 1) // BLOCK - first // BLOCK + 1


def step_eager(w, grad, mq, ms, vq, vs, hyper: Hyper, cap: float, seed: int, step: int, tensor: int,
               first: int) -> bool:
    """The reference in torch ops on flat contiguous tensors: the blocks of
    ``blockquant.py``, shifted by ``first % BLOCK`` leading zeros (which change no
    block's scale and store code 0)."""
    lead, n = first % BLOCK, w.numel()

    def padded(t, fill, dtype=torch.float32):
        return torch.cat([torch.full((lead,), fill, dtype=dtype), t.to(dtype)])

    m = dequantize(padded(mq, 0, torch.int8), ms, torch.empty(lead + n), BLOCK)[lead:]
    v = dequantize(padded(vq, 0, torch.uint8), vs, torch.empty(lead + n), BLOCK)[lead:].square()
    p, m, v = arithmetic(w, grad, m, v, hyper)
    if not bool(p.isfinite().all()):
        return False
    round_counter_(w, p, seed, step, tensor, 0, first)
    draws = [padded(counter_draws(torch.empty(n, dtype=torch.int32), seed, step, tensor, s, first), 0, torch.int32)
             for s in (1, 2)]
    codes = torch.empty(lead + n, dtype=torch.uint8)
    quantize_(codes, vs, padded(sqrt(v), 0.0), draws[1], BLOCK)
    vq.copy_(codes[lead:])
    limit = dequantize(codes, vs, torch.empty(lead + n), BLOCK).mul_(cap if math.isfinite(cap) else math.nan)
    x = padded(m, 0.0).masked_fill_(limit.isinf(), 0.0)
    codes = torch.empty(lead + n, dtype=torch.int8)
    quantize_(codes, ms, x, draws[0], BLOCK, limit)
    mq.copy_(codes[lead:])
    return True


def step_native(lib, w, grad, mq, ms, vq, vs, hyper: Hyper, cap: float, seed: int, step: int, tensor: int,
                first: int, backup) -> bool:
    """`step_eager` in one pass of the C kernel (contiguous CPU tensors), threads over ranges
    cut at block boundaries; ``backup``: ``(w, m codes, v codes, m scales, v scales)`` of the
    same sizes (flat), the old values put back on a non-finite step."""
    return steps_native(lib, [(w, grad, mq, ms, vq, vs, hyper, cap, tensor, first, backup)], seed, step) == 1


def steps_native(lib, steps: list, seed: int, step: int) -> int:
    """`step_native` of each ``(w, grad, mq, ms, vq, vs, hyper, cap, tensor, first, backup)`` of
    ``steps`` in turn, in one call of the C kernel (``adamw_8bit_many``: one ctypes call for a
    param group, not one a tensor), stopping at the first whose new weight would not be finite
    (its old values put back, those after it untouched): how many wrote."""
    rows, consts = [], []
    for w, grad, mq, ms, vq, vs, hyper, cap, tensor, first, backup in steps:
        n = w.numel()
        rows.append([t.data_ptr() for t in (w, grad, mq, ms, vq, vs, *backup)]
                    + [n, first, counter_bits.key(seed, step, tensor, 0), native.threads(n)])
        consts += hyper.consts()
        consts.append(cap if math.isfinite(cap) else math.nan)
    wrote = native.call_rows(lib.adamw_8bit_many, rows, native.floats(consts))
    if wrote < len(steps):
        w, _, mq, ms, vq, vs, *_, backup = steps[wrote]
        restore_(w, mq, ms, vq, vs, backup)
    return wrote


def _check_sizes(w, mq, ms, vq, vs, first: int) -> None:
    n = w.numel()
    if ms.numel() != span(n, first) or vs.numel() != span(n, first) or mq.shape != w.shape or vq.shape != w.shape:
        raise ValueError(f"fused_adamw_8bit.step_: codes of w's shape {tuple(w.shape)} and {span(n, first)} scales "
                         f"each expected (first={first}), got {tuple(mq.shape)}, {tuple(vq.shape)}, "
                         f"{ms.numel()} and {vs.numel()}.")


def step_(w, grad, mq, ms, vq, vs, hyper: Hyper, cap: float, seed: int, step: int, tensor: int, first: int,
          lib: Optional[ctypes.CDLL] = None, backup: Optional[tuple] = None) -> bool:
    """One AdamW step of bf16 ``w`` (its bf16 ``grad``; ``m`` as int8 codes ``mq`` and scales
    ``ms``, ``v`` as uint8 codes ``vq`` of its square root and scales ``vs``, `span`
    each) in place: with the kernel ``lib`` on CPU, else `step_eager`; the same bits
    either way. ``cap``: the bound on ``|m| / sqrt(v)`` (inf or NaN: none). Returns False,
    having written nothing, when a new weight would not be finite. The old values go to
    ``backup`` (`backups`; fresh buffers when None), for `restore_`.
    Non-contiguous tensors are stepped through contiguous copies."""
    _check_sizes(w, mq, ms, vq, vs, first)
    return step_flat_([w, grad, mq, ms, vq, vs], (0, 2, 4, 3, 5), backup, backups, lib, step_native, step_eager,
                      hyper, cap, seed, step, tensor, first=first)


def steps_(steps: list, seed: int, step: int, lib: Optional[ctypes.CDLL] = None) -> int:
    """`step_` of each ``(w, grad, mq, ms, vq, vs, hyper, cap, tensor, first, backup)`` of ``steps``
    in turn, stopping at the first whose new weight would not be finite (it wrote nothing): how
    many wrote. Each run of contiguous CPU tensors goes to the kernel in one call."""
    for w, _, mq, ms, vq, vs, *_, first, _ in steps:
        _check_sizes(w, mq, ms, vq, vs, first)
    return in_runs(steps, lib, 6, lambda run: steps_native(lib, run, seed, step),
                   lambda w, grad, mq, ms, vq, vs, hyper, cap, tensor, first, backup: step_(
                       w, grad, mq, ms, vq, vs, hyper, cap, seed, step, tensor, first, lib, backup))


def in_runs(steps: list, lib: Optional[ctypes.CDLL], tensors: int, many: Callable, one: Callable) -> int:
    """O8's steps of ``steps`` in turn, stopping at the first whose new weight would not be
    finite: each run of items whose first ``tensors`` tensors the kernel ``lib`` reads where they
    are (`native.direct`) in one call (``many(run)``: how many wrote), the others one at a time
    (``one(*item)``: whether it wrote). How many wrote."""
    return until_short(steps, lambda s: lib is not None and native.direct(s[:tensors]), lambda direct, run: (
        many(run) if direct else next((i for i, s in enumerate(run) if not one(*s)), len(run))))


def until_short(items: list, key: Callable, step_run: Callable) -> int:
    """``step_run(key, run)`` (how many of ``run`` wrote) of each run of ``items`` with one
    ``key(item)``, in turn, until the first run that did not write all. How many wrote."""
    done = 0
    for k, run in itertools.groupby(items, key=key):
        run = list(run)
        wrote = step_run(k, run)
        done += wrote
        if wrote < len(run):
            break
    return done


def step_flat_(tensors: list, backed: tuple, backup: Optional[tuple], backups_of, lib: Optional[ctypes.CDLL],
               native_step, eager_step, *args, first: int) -> bool:
    """An O8 step of ``tensors`` (the weight from global index ``first``, its gradient, then the
    state; nothing to do when empty) made contiguous: ``native_step(lib, *tensors, *args, first,
    backup)`` on CPU with ``lib``, else their flat views numbered ``backed`` copied to ``backup``
    and ``eager_step(*views, *args, first)``; ``backup``: fresh ``backups_of`` buffers when None.
    When it wrote, the copies of non-contiguous tensors (but the gradient) are copied back.
    Whether it wrote."""
    n = tensors[0].numel()
    if n == 0:
        return True
    backup = backups_of([(n, span(n, first))], {})[0] if backup is None else backup
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    if lib is not None and tensors[0].device.type == "cpu":
        wrote = native_step(lib, *flat, *args, first, backup)  # contiguous: their addresses are flat memory
    else:
        views = [f.view(-1) for f in flat]
        for b, i in zip(backup, backed):
            b.copy_(views[i])
        wrote = eager_step(*views, *args, first)
    if wrote:
        for t, f in zip(tensors, flat):
            if f is not t and t is not tensors[1]:
                t.copy_(f)
    return wrote


def restore_(w, mq, ms, vq, vs, backup: tuple) -> None:
    """Put back the values a `step_` wrote to ``backup``."""
    for t, b in zip((w, mq, vq, ms, vs), backup):
        t.copy_(b.view(t.shape))


def backups(sizes, scratch: dict, codes: tuple = (torch.int8, torch.uint8)) -> list:
    """Backup buffers for each ``(elements, blocks)`` of ``sizes``: the bf16 weight, codes of each
    dtype of ``codes``, then the float32 scales of each (by default AdamW's ``(w, m codes, v codes,
    m scales, v scales)``), carved from flat buffers kept in ``scratch`` (grown when too small)."""
    n, blocks, c = sum(s[0] for s in sizes), sum(s[1] for s in sizes), len(codes)
    if scratch.get("n", -1) < n or scratch.get("blocks", -1) < blocks or scratch.get("codes") != codes:
        scratch.update(n=n, blocks=blocks, codes=codes, w=torch.empty(n, dtype=torch.bfloat16),
                       q=[torch.empty(n, dtype=d) for d in codes], s=torch.empty(c * blocks))
    counts = [k for k, _ in sizes]
    w, q = scratch["w"][:n].split(counts), [buf[:n].split(counts) for buf in scratch["q"]]
    s = scratch["s"][:c * blocks].split([b for _, b in sizes for _ in range(c)])  # one split each: no slice per tensor
    return [(w[j], *(qj[j] for qj in q), *s[c * j:c * (j + 1)]) for j in range(len(sizes))]
