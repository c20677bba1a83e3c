"""The update family's profile: each fused CPU kernel's arithmetic cost against its memory bound.

Each kernel is called directly (``ampkit/core``'s ``step_native`` wrappers, on one thread) on
``SMALL`` elements, whose tensors stay in the caches, so its time there is the arithmetic's
(the call's fixed cost, timed on 64 elements, subtracted), and on the family's full size,
where it streams from memory. ``compute ns`` against ``bound ns`` (the ideal bytes at the
bandwidth of the family's in-place ``add_`` probe, timed here on one thread too) says what stops a kernel: a kernel whose arithmetic alone exceeds 1.5x
its bound cannot reach the target by moving fewer bytes. The counter bits alone (one
SplitMix64 word per element and the bf16 rounding, ``round_counter_``) show the hash's share.
"""
import math
import time

import torch

from ampkit._kernels import fused_adamw, fused_adamw_8bit, fused_masters, native
from ampkit._kernels.fused_adamw import Hyper
from ampkit._kernels.rounding import round_counter_

SMALL, TINY = 1 << 16, 64  # elements: in the caches (about 1 MB at most), and the call's fixed cost
HYPER = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 3.0)


def _kernels(lib, n: int) -> dict:
    """name: (ideal bytes per element, a function that runs the kernel once over ``n`` elements)."""
    torch.manual_seed(0)
    w, g = torch.randn(n).bfloat16(), (torch.randn(n) * 1e-3).bfloat16()
    m, v = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    x, gx = torch.randn(n), torch.randn(n) * 1e-3
    r = torch.zeros(n, dtype=torch.int16)
    span = fused_adamw_8bit.span(n, 0)
    mq, vq = torch.zeros(n, dtype=torch.int8), torch.full((n,), 100, dtype=torch.uint8)
    ms, vs = torch.full((span,), 1e-4), torch.full((span,), 1e-3)
    backup = fused_adamw_8bit.backups([(n, span)], {})[0]
    table, src = torch.empty(0, dtype=torch.int64), torch.randn(n)
    mb, vb = m.bfloat16(), v.bfloat16()
    return {
        "O5 masters (fp32 grad)": (4 + 8 + 16 + 2, lambda: fused_masters.step_master_native(lib, x, gx, m, v, HYPER, w)),
        "fp32 kernel alone": (4 + 8 + 16, lambda: fused_masters.step_master_native(lib, x, gx, m, v, HYPER, None)),
        "remainder": (6 + 4 + 16, lambda: fused_masters.step_remainder_native(lib, w, r, g, m, v, HYPER, table)),
        "O7": (4 + 2 + 16, lambda: fused_adamw.step_native(lib, w, g, m, v, HYPER, 1, 1, 0, 0)),
        "O7 bf16 state": (4 + 2 + 8, lambda: fused_adamw.step_native(lib, w, g, mb, vb, HYPER, 1, 1, 0, 0)),
        "O8": (4 + 2 + 4, lambda: fused_adamw_8bit.step_native(lib, w, g, mq, ms, vq, vs, HYPER, math.inf, 1, 1, 0,
                                                                0, backup)),
        "counter bits + bf16 rounding": (4 + 2, lambda: round_counter_(w, src, 1, 1, 0, 0, 0, lib=lib)),
    }


def _per_call(fn, reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(3):  # the least of three batches: the machine's noise only adds
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def profile(n: int, log) -> dict:
    """The one-thread bandwidth and one row per kernel: ns per element in the caches and
    streaming, and the bound's; empty where the kernels cannot be built."""
    lib = native.library()
    if lib is None:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(2 * n)
        dst = torch.ones_like(src)
        gbps = 24 * n / _per_call(lambda: dst.add_(src), 3) / 1e9  # 12 bytes per float32: two read, one written
        del src, dst
        sizes = {size: _kernels(lib, size) for size in (TINY, SMALL, n)}
        rows = []
        for name, (ideal, _) in sizes[n].items():
            log(f"profile {name}")
            fixed = _per_call(sizes[TINY][name][1], 200)
            small = (_per_call(sizes[SMALL][name][1], 50) - fixed) / (SMALL - TINY)
            full = _per_call(sizes[n][name][1], 2) / n
            bound = ideal / gbps  # ns per element
            rows.append({"kernel": name, "ideal_bytes": ideal, "compute_ns": 1e9 * small, "stream_ns": 1e9 * full,
                         "bound_ns": bound, "compute_vs_bound": 1e9 * small / bound, "stream_vs_bound": 1e9 * full / bound})
        return {"gbps": gbps, "rows": rows}
    finally:
        torch.set_num_threads(threads)


COLUMNS = [("kernel", "kernel", "{}"), ("ideal B", "ideal_bytes", "{}"), ("compute ns", "compute_ns", "{:.3f}"),
           ("stream ns", "stream_ns", "{:.3f}"), ("bound ns", "bound_ns", "{:.3f}"),
           ("compute vs bound", "compute_vs_bound", "{:.2f}x"), ("stream vs bound", "stream_vs_bound", "{:.2f}x")]
