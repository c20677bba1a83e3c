"""AdamW / Adam on float32 masters in one pass: O5's masters and remainder masters.

Each step has an eager reference and a C kernel with the same bits. Design: docs/design/kernels.md, "Masters".
"""
import ctypes
import threading
from typing import Optional

import torch

from . import native
from .fused_adamw import Hyper, arithmetic
from .remainder import combine, set_side_table, side_table, split_

__all__ = ["step_master_", "steps_master_", "step_remainder_", "step_remainder_table_", "steps_remainder_table_"]

RBLOCK = 512  # csrc/remainder.h's block: a kernel call leaves room for one block's candidates per range


def step_master_eager(x, grad, m, v, hyper: Hyper, w: Optional[torch.Tensor] = None) -> None:
    """The reference: torch ops, one rounding each, on float32 ``x``, ``grad``, ``m``, ``v``;
    then ``w`` (bf16, optional) ``= x`` rounded to nearest even."""
    p, m32, v32 = arithmetic(x, grad, m, v, hyper)
    m.copy_(m32)
    v.copy_(v32)
    x.copy_(p)
    if w is not None:
        w.copy_(p)


def step_master_native(lib, x, grad, m, v, hyper: Hyper, w: Optional[torch.Tensor]) -> None:
    """`step_master_eager` in one pass of the C kernel (contiguous flat CPU tensors)."""
    steps_master_native(lib, [(x, grad, m, v, hyper, w)])


def steps_master_native(lib, steps: list) -> None:
    """`step_master_native` of each ``(x, grad, m, v, hyper, w)`` of ``steps`` in one call of the C
    kernel (``adamw_master_many``)."""
    rows, consts = [], []
    for x, grad, m, v, hyper, w in steps:
        n = x.numel()
        rows.append([x.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), native.address(w), n, native.threads(n)])
        consts += hyper.consts()
    native.call_rows(lib.adamw_master_many, rows, native.floats(consts))


def step_master_(x, grad, m, v, hyper: Hyper, w: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> None:
    """One AdamW / Adam step of float32 master ``x`` (its float32 ``grad``, float32 state ``m``,
    ``v``) in place, and ``w = x`` in bfloat16 when ``w`` is given: with the kernel ``lib`` on
    CPU, else `step_master_eager`; the same bits either way."""
    tensors = _check_master(x, grad, m, v, w)
    if x.numel() == 0:
        return
    with _contiguous(tensors, written=[0, 2, 3, 4]) as flat:
        if lib is not None and x.device.type == "cpu":
            step_master_native(lib, *flat[:4], hyper, flat[4] if w is not None else None)
        else:
            step_master_eager(*flat[:4], hyper, flat[4] if w is not None else None)


def steps_master_(steps: list, lib: Optional[ctypes.CDLL] = None) -> None:
    """`step_master_` of each ``(x, grad, m, v, hyper, w)`` of ``steps``: those the kernel ``lib``
    reads where they are (not empty) in one call, the others one at a time (all checked first)."""
    for x, grad, m, v, _, w in steps:
        _check_master(x, grad, m, v, w)
    run, others = native.split(steps, lambda s: lib is not None and s[0].numel() > 0 and native.direct(s[:4] + s[5:]))
    if run:
        steps_master_native(lib, run)
    for x, grad, m, v, hyper, w in others:
        step_master_(x, grad, m, v, hyper, w, lib)


def _check_master(x, grad, m, v, w) -> list:
    """`step_master_`'s tensors (``w`` where given), checked."""
    tensors = [x, grad, m, v] + ([] if w is None else [w])
    _check(tensors, [torch.float32] * 4 + [torch.bfloat16], "step_master_", ["x", "grad", "m", "v", "w"])
    return tensors


def step_remainder_eager(w, r, grad, m, v, hyper: Hyper) -> None:
    """The reference: `.remainder.combine`, `step_master_eager` on the float32
    master with the widened gradient, `.remainder.split_`."""
    x = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    combine([w], [r], [x])
    step_master_eager(x, grad.float(), m, v, hyper)
    split_([w], [r], [x])


def step_remainder_native(lib, w, r, grad, m, v, hyper: Hyper, table: torch.Tensor) -> torch.Tensor:
    """`step_remainder_eager` in one pass of the C kernel (contiguous CPU tensors, ``table``
    ascending); returns the new side table."""
    return captured(_remainder_call(lib, w, r, grad, m, v, hyper, table), w.numel())


def steps_remainder_native(lib, steps: list) -> list:
    """`step_remainder_native` of each ``(w, r, grad, m, v, hyper, table)`` of ``steps`` (not
    empty) in one call of the C kernel (``adamw_remainder_many``): their new side tables."""
    consts = []
    for *_, hyper, _ in steps:
        consts += hyper.consts()

    def call_many(plans, found, counts, done):
        rows = [[w.data_ptr(), r.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), table.data_ptr(),
                 table.numel(), w.numel(), *plan] for (w, r, grad, m, v, _, table), plan in zip(steps, plans)]
        native.call_rows(lib.adamw_remainder_many, rows, native.floats(consts), found, counts, done)
    return captured_many(call_many, lambda i: _remainder_call(lib, *steps[i]), [s[0].numel() for s in steps])


def _remainder_call(lib, w, r, grad, m, v, hyper: Hyper, table: torch.Tensor):
    """`captured`'s ``call`` of one remainder step."""
    consts = (ctypes.c_float * 10)(*hyper.consts())
    tensors, listed = (w, r, grad, m, v), (table.data_ptr(), table.numel())

    def call(lo, hi, found, cap, counts, done, threads):
        lib.adamw_remainder(*(native.ptr(t, lo) for t in tensors), hi - lo, lo, *listed, found, cap, counts, done, consts,
                            threads)
    return call


class _Capture(threading.local):
    """A thread's capture buffer for the remainder kernels' candidates and its per-range counts,
    kept from call to call (grown when a call needs more)."""

    def __init__(self):
        self.found, self.counts, self.done = torch.empty(0, dtype=torch.int64), None, None

    def buffers(self, entries: int, ranges: int):
        """Room for ``entries`` candidates and the counts of ``ranges`` ranges."""
        if self.found.numel() < entries:
            self.found = torch.empty(entries, dtype=torch.int64)
        if self.counts is None or len(self.counts) < ranges:
            self.counts, self.done = (ctypes.c_int64 * ranges)(), (ctypes.c_int64 * ranges)()
        return self.found, self.counts, self.done


_CAPTURE = _Capture()
_NONE = torch.empty(0, dtype=torch.int64)  # an empty side table (no entries to write: shared)


def _room(n: int) -> tuple:
    """A remainder kernel call over ``n`` elements: its threads (ranges), and each range's room
    for entries (one block's candidates more than the entries it can expect)."""
    k = native.threads(n)
    return k, RBLOCK + 64 + n // k // 4096


def captured(call, n: int) -> torch.Tensor:
    """The side table a remainder kernel finds over elements ``[0, n)``, a tensor of its own
    (when there are none, an empty one that every such call shares: nothing writes to it).
    ``call(lo, hi, found, cap, counts, done, threads)`` runs the kernel on ``[lo, hi)`` in
    ``threads`` ranges, range ``t``'s entries at ``found + t * cap``
    (``counts[t]`` of them), ``done[t]`` its elements done (fewer where its buffer filled up:
    the candidates are rare, and a range goes on from where it stopped)."""
    parts = []
    _go_on(call, parts, [(0, n)])
    return _joined(parts)


def captured_many(call_many, call_of, sizes: list) -> list:
    """`captured` of several whole tensors (``sizes``: their elements) in one kernel call:
    ``call_many(plans, found, counts, done)`` runs tensor ``i`` with ``plans[i]`` (its ranges,
    each one's room, its first entry in ``found`` and its first range in ``counts`` and
    ``done``); ``call_of(i)``, its ``call`` for `captured`, goes on where a range filled up."""
    plans, at, first = [], 0, 0
    for n in sizes:
        k, cap = _room(n)
        plans.append((k, cap, at, first))
        at, first = at + k * cap, first + k
    found, counts, done = _CAPTURE.buffers(at, first)
    call_many(plans, found.data_ptr(), counts, done)
    runs = []
    for n, (k, cap, at, first) in zip(sizes, plans):
        parts, todo = [], []
        _collect(0, n, (k, cap, at, first), found, counts, done, parts, todo)
        runs.append((parts, todo))
    for i, (parts, todo) in enumerate(runs):  # only now: these calls reuse the buffers
        if todo:
            _go_on(call_of(i), parts, todo)
    return [_joined(parts) for parts, _ in runs]


def _go_on(call, parts: list, todo: list) -> None:
    """`captured`'s calls over the ranges ``todo`` until none is left, their entries into ``parts``."""
    while todo:
        lo, hi = todo.pop()
        k, cap = _room(hi - lo)
        found, counts, done = _CAPTURE.buffers(k * cap, k)
        call(lo, hi, found.data_ptr(), cap, counts, done, k)
        _collect(lo, hi, (k, cap, 0, 0), found, counts, done, parts, todo)


def _collect(lo: int, hi: int, plan: tuple, found, counts, done, parts: list, todo: list) -> None:
    """The ranges of a kernel call over ``[lo, hi)`` (``plan``: their number, each one's room, the
    first entry and the first range): each one's entries into ``parts`` (a copy: the table owns
    its entries, the buffer is the next call's), what it left undone into ``todo``."""
    k, cap, at, first = plan
    for t in range(k):
        start, end, c = lo + (hi - lo) * t // k, lo + (hi - lo) * (t + 1) // k, counts[first + t]
        if c:
            parts.append((start, found[at + t * cap:at + t * cap + c].clone()))
        if start + done[first + t] < end:
            todo.append((start + done[first + t], end))


def _joined(parts: list) -> torch.Tensor:
    """The side table of ``(start, entries)`` parts, in order of their start."""
    if len(parts) < 2:
        return parts[0][1] if parts else _NONE
    return torch.cat([p for _, p in sorted(parts, key=lambda part: part[0])])


def step_remainder_(w, r, grad, m, v, hyper: Hyper, lib: Optional[ctypes.CDLL] = None) -> None:
    """One AdamW / Adam step of the float32 master held as bfloat16 ``w`` and int16 ``r`` (and
    its side table), with bfloat16 ``grad`` and float32 state ``m``, ``v``, in place: with the
    kernel ``lib`` on CPU, else `step_remainder_eager`; the same bits either way."""
    set_side_table(r, step_remainder_table_(w, r, grad, m, v, hyper, side_table(r), lib))


def step_remainder_table_(w, r, grad, m, v, hyper: Hyper, table: torch.Tensor,
                          lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
    """`step_remainder_` with ``r``'s side table given as ``table``: returns the new table
    (a tensor of its own) instead of setting it."""
    tensors = _check_remainder(w, r, grad, m, v)
    return stepped_table(tensors, table, lib, [0, 1, 3, 4], lambda: step_remainder_eager(w, r, grad, m, v, hyper),
                         lambda flat, table: step_remainder_native(lib, *flat, hyper, table))


def steps_remainder_table_(steps: list, lib: Optional[ctypes.CDLL] = None) -> list:
    """`step_remainder_table_` of each ``(w, r, grad, m, v, hyper, table)`` of ``steps``: those
    the kernel ``lib`` reads where they are (not empty) in one call, the others one at a time
    (all checked first); the new tables, in order."""
    for w, r, grad, m, v, *_ in steps:
        _check_remainder(w, r, grad, m, v)
    return in_one_call(steps, lib, 5, steps_remainder_native,
                       lambda w, r, grad, m, v, hyper, table: step_remainder_table_(w, r, grad, m, v, hyper, table, lib))


def _check_remainder(w, r, grad, m, v) -> list:
    """`step_remainder_table_`'s tensors, checked."""
    tensors = [w, r, grad, m, v]
    _check(tensors, [torch.bfloat16, torch.int16, torch.bfloat16, torch.float32, torch.float32], "step_remainder_",
           ["w", "r", "grad", "m", "v"])
    return tensors


def in_one_call(steps: list, lib: Optional[ctypes.CDLL], tensors: int, native_steps, one) -> list:
    """The new side tables of remainder ``steps`` (their first ``tensors`` items the tensors, ``w``
    first, None where absent; the last the old table): ``native_steps(lib, run)`` for the
    ``run`` of those the kernel reads where they are (not empty; tables ascending), ``one(*step)``
    for each other; in order."""
    direct = [i for i, s in enumerate(steps) if lib is not None and s[0].numel() > 0 and native.direct(s[:tensors])]
    tables = [None] * len(steps)
    if direct:
        run = [(*steps[i][:-1], ascending(steps[i][-1]).contiguous()) for i in direct]
        for i, table in zip(direct, native_steps(lib, run)):
            tables[i] = table
    return [one(*s) if table is None else table for s, table in zip(steps, tables)]


def stepped_table(tensors: list, table: torch.Tensor, lib: Optional[ctypes.CDLL], written: list, eager_step,
                  native_step) -> torch.Tensor:
    """The new side table of a remainder step of ``tensors`` (``w``, ``r``, then the others; checked)
    from ``table``: ``native_step(flat, table)`` on CPU with ``lib`` (``flat``: the tensors, or
    contiguous copies, those numbered ``written`` copied back; ``table`` ascending), else
    ``eager_step()`` with ``table`` set on ``r``."""
    w, r = tensors[:2]
    if w.numel() == 0:
        return table
    if lib is None or w.device.type != "cpu":
        set_side_table(r, table)
        eager_step()
        return side_table(r)
    table = ascending(table).contiguous()
    if all(t.is_contiguous() for t in tensors):  # the usual case: no copies
        return native_step(tensors, table)
    with _contiguous(tensors, written=written) as flat:
        return native_step(flat, table)


def ascending(table: torch.Tensor) -> torch.Tensor:
    """``table`` sorted (as the kernels read it); as it is when it is already (as `split_` and
    the kernels write it)."""
    if table.numel() < 2:
        return table
    if table.numel() <= 64:  # the usual few entries: cheaper on the host than three torch ops
        listed = table.tolist()
        if all(a <= b for a, b in zip(listed, listed[1:])):
            return table
    elif bool((table[1:] >= table[:-1]).all()):
        return table
    return table.sort().values


class _contiguous:
    """Flat contiguous views of ``tensors`` (copies of the non-contiguous ones, whose entries
    listed in ``written`` are copied back on exit)."""

    def __init__(self, tensors, written):
        self.tensors, self.written = tensors, written
        self.flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def __enter__(self):
        return [f.view(-1) for f in self.flat]

    def __exit__(self, *exc):
        if exc[0] is None:
            for i in self.written:
                if i < len(self.tensors) and self.flat[i] is not self.tensors[i]:
                    self.tensors[i].copy_(self.flat[i])
        return False


def _check(tensors, dtypes, fn: str, names) -> None:
    for t, dtype, name in zip(tensors, dtypes, names):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.is_sparse:
            raise TypeError(f"{fn}: {name} must be a dense {dtype} tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}.")
    shape, device = tensors[0].shape, tensors[0].device  # one shape and one device (after every dtype)
    for t in tensors[1:]:
        if t.shape != shape or t.device != device:
            raise ValueError(f"{fn}: {', '.join(names[:len(tensors)])} must have one shape and one device.")
