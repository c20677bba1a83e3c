"""7. update: the optimizer update alone, per level, against its memory-traffic bound
   (``python benchmarks/run.py --only update [--quick]``). Target: each level <= 1.5x its bound.

AdamW on a model of a few large parameters whose loss is linear in them (so the backward pass
is one cheap pass and every variant sees the same gradients). Timed: from the end of
``backward()`` (leaving ``scale_loss``, where O5 moves the gradients to its masters, then
``opt.step()``), every variant in turn each step (order reversed on odd steps), medians after
2 warm-up steps. Variants: O5 and remainder masters (fused AdamW: ``ampkit/_kernels/fused_masters.py``,
one pass; O5's also moves the bf16 gradients into fp32 master gradients first), O7 and O7 with
bf16 state (fused AdamW: ``ampkit/_kernels/fused_adamw.py``, one pass; on CUDA one ``torch.compile``
Triton kernel per tensor, ``ampkit/_kernels/compiled_update.py``, compiled during the warm-up steps), O8 (fused:
``ampkit/_kernels/fused_adamw_8bit.py``), the same five through the optimizer's own step
(``AMPKIT_FUSED=0``; on CUDA, where the C kernels do not run, both rows take that step), ampkit's
fused fp32 kernel alone on a float32 model, and torch's ``AdamW(fused=True)`` on a float32 model
(the anchor a fused fp32 update should reach).

Columns: ``ideal B``: the fewest bytes per parameter the update must read and write (each
tensor once); ``moved B``: the bytes per parameter the path's kernels move, counted from
the kernels it runs (O5's fused row: the move into fp32 master gradients and its kernel; the other fused
rows: the gradient check, a read of the bf16 gradients, and the one-pass kernel; the eager paths: each torch op's reads
and writes; "-" where not counted); ``GB/s``: ideal bytes over the time; ``vs O5``: time over
O5's; ``bound ms``: ideal bytes over the streaming bandwidth of the probe, timed in the same
alternation, so under the same load; ``vs bound``: time over that bound (the issue's target: <= 1.5x).

The probe is an in-place ``a.add_(b)`` of two float32 tensors of ``2n`` elements (12 bytes per
element: two read, one written back in place), the access pattern of an optimizer update, whose
tensors are read and written in place. A copy into a second tensor (also timed and printed) is
slower per byte than the hardware streams in place: each destination line is read before it is
written (read for ownership), bytes a copy does not count; torch's fused AdamW can run faster than
a copy "bound" (benchmarks/HISTORY.md), so the copy is no bound for an in-place update.
"""
import os
import time
from statistics import median

import torch
from torch import nn

import ampkit
from ampkit._update import fused_update

from common import _sync, table, timed
from families.update_profile import COLUMNS, SMALL, profile

# name: (level, initialize overrides, fused AdamW on, ideal bytes, moved bytes (counted) or None)
VARIANTS = {
    "O5": ("O5", {}, True, 2 + 8 + 16 + 2, 6 + 30),  # the widening into fp32 master gradients: 2 read, 4 written
    "remainder": ("O5", {"master_weights": "remainder"}, True, 6 + 4 + 16, 2 + 26),
    "O7 fused": ("O7", {}, True, 4 + 2 + 16, 2 + 4 + 2 + 16),
    "O7 bf16 state fused": ("O7", {"optimizer_state_dtype": torch.bfloat16}, True, 4 + 2 + 8, 2 + 4 + 2 + 8),
    "O7 eager": ("O7", {}, False, 4 + 2 + 16, 135),
    "O7 bf16 state eager": ("O7", {"optimizer_state_dtype": torch.bfloat16}, False, 4 + 2 + 8, 215),
    "O8": ("O8", {}, True, 4 + 2 + 4, 2 + 4 + 2 + 4 + 4),  # fused (_kernels/fused_adamw_8bit.py): + 4 B of backup writes
    "O8 eager": ("O8", {}, False, 4 + 2 + 4, 600),
    "torch AdamW fused fp32": (None, {}, True, 4 + 8 + 16, 4 + 8 + 16),
}


# -- O5's and remainder masters' fused AdamW (_kernels/fused_masters.py): the eager rows, and the fp32 kernel alone --
KERNEL = "ampkit fused AdamW fp32"  # _kernels/fused_masters.py on a float32 model, against torch's AdamW(fused=True)
VARIANTS.update({
    "O5 eager": ("O5", {}, False, 2 + 8 + 16 + 2, 100),
    "remainder eager": ("O5", {"master_weights": "remainder"}, False, 6 + 4 + 16, None),
    KERNEL: (None, {}, True, 4 + 8 + 16, 4 + 8 + 16),
})


class KernelAdamW:
    """A float32 model's ``torch.optim.AdamW`` stepped by ampkit's fused fp32 kernel (the O5
    masters' update without the bf16 model copy): its state, its hyperparameters."""

    def __init__(self, opt):
        self.opt = opt

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        fused_update.step_masters(self.opt, [(g, p, None) for g in self.opt.param_groups for p in g["params"]
                                             if p.grad is not None])


PROBE, COPY = "in-place add", "copy"  # the bandwidth probes' keys: float32 add_ and copy_, alternating with the variants


class Linear(nn.Module):
    """Four parameters of ``n / 4`` elements; the loss is linear in them (gradient ``c``)."""

    def __init__(self, n: int):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(n // 4 // 256, 256) * 0.02) for _ in range(4)])
        self.register_buffer("c", torch.randn(256) * 1e-3, persistent=False)

    def forward(self, x):
        return sum((w * self.c).sum() for w in self.ws) + x.sum() * 0


def build(name: str, n: int, device):
    level, overrides, _, _, _ = VARIANTS[name]
    torch.manual_seed(0)
    model = Linear(n).to(device)
    if level is None and name == KERNEL:
        return model, KernelAdamW(torch.optim.AdamW(model.parameters(), lr=1e-3))
    if level is None:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)


def one_step(name, model, opt, x, device) -> float:
    """Seconds of the update of one step (see the module docstring)."""
    os.environ["AMPKIT_FUSED"] = "1" if VARIANTS[name][2] else "0"
    opt.zero_grad()
    loss = model(x)
    if VARIANTS[name][0] is None:
        loss.backward()
        _sync(device)
        start = time.perf_counter()
        opt.step()
    else:
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
            _sync(device)
            start = time.perf_counter()
        opt.step()
    _sync(device)
    return time.perf_counter() - start


def bench_update(cfg: dict, device, threads: int, log) -> dict:
    names = [n for n in VARIANTS if VARIANTS[n][0] is None or VARIANTS[n][0] in ampkit._config.levels.OPT_LEVELS]
    n, steps = cfg["update_params"], cfg["update_steps"]
    log(f"{n} parameters, {len(names)} variants and two bandwidth probes, {steps} steps")
    loops = {}
    for name in names:
        log(f"build {name}")
        loops[name] = build(name, n, device)
    x = torch.zeros(1, device=device)
    src = torch.ones(2 * n, device=device)  # the probes: 24 (add_) and 16 (copy_) bytes per parameter
    dst = torch.ones_like(src)
    probes = {PROBE: lambda: timed(dst.add_, device, src), COPY: lambda: timed(dst.copy_, device, src)}
    times = {name: [] for name in names + list(probes)}
    saved = os.environ.get("AMPKIT_FUSED")
    try:
        for i in range(steps + 2):
            order = names + list(probes)
            for name in order if i % 2 == 0 else order[::-1]:
                t = probes[name]() if name in probes else one_step(name, *loops[name], x, device)
                if i >= 2:
                    times[name].append(t)
            log(f"step {i + 1}/{steps + 2}" + (" (warm-up)" if i < 2 else ""))
    finally:
        if saved is None:
            os.environ.pop("AMPKIT_FUSED", None)
        else:
            os.environ["AMPKIT_FUSED"] = saved
    gbps = 24 * n / median(times[PROBE]) / 1e9  # in the same alternation, under the same load
    copy_gbps = 16 * n / median(times[COPY]) / 1e9
    o5 = median(times["O5"])
    rows = []
    for name in names:
        t = median(times[name])
        ideal, moved = VARIANTS[name][3], VARIANTS[name][4]
        bound = ideal * n / (gbps * 1e9)
        rows.append({"variant": name, "ms": 1e3 * t, "least_ms": 1e3 * min(times[name]), "ideal_bytes": ideal,
                     "moved_bytes": moved, "gbps": ideal * n / t / 1e9, "vs_O5": t / o5,
                     "bound_ms": 1e3 * bound, "vs_bound": t / bound})
    prof = profile(n, log) if device.type == "cpu" else {}
    return {"params": n, "steps": steps, "threads": threads, "stream_gbps": gbps, "copy_gbps": copy_gbps,
            "device": str(device), "rows": rows, "profile": prof}


def run(cfg, device, args, log) -> dict:
    return bench_update(cfg, device, args.threads, log)


def report(result: dict) -> list:
    head = (f"\n7. Update: AdamW update alone, {result['params']} parameters, {result['steps']} steps alternating, "
            f"{result['threads']} threads, in-place bandwidth {result['stream_gbps']:.1f} GB/s (the bound's; "
            f"a copy: {result['copy_gbps']:.1f} GB/s) ({result['device']})")
    return [head, table(result["rows"], [
        ("variant", "variant", "{}"), ("ms", "ms", "{:.2f}"), ("least ms", "least_ms", "{:.2f}"),
        ("ideal B", "ideal_bytes", "{}"), ("moved B", "moved_bytes", "{}"), ("GB/s", "gbps", "{:.2f}"),
        ("vs O5", "vs_O5", "{:.3f}x"), ("bound ms", "bound_ms", "{:.2f}"), ("vs bound", "vs_bound", "{:.2f}x")])] + (
        [f"\nProfile: each fused kernel called alone on one thread, ns per element: in the caches ({SMALL} elements: "
         f"the arithmetic) and streaming ({result['params']}); bound: ideal bytes at {result['profile']['gbps']:.1f} GB/s "
         f"(one thread, in-place add_)", table(result["profile"]["rows"], COLUMNS)] if result.get("profile") else [])


PROFILED = {"O5": "O5 masters (fp32 grad)", "remainder": "remainder", "O7 fused": "O7",
            "O7 bf16 state fused": "O7 bf16 state", "O8": "O8", KERNEL: "fp32 kernel alone"}  # variant: its kernel


def targets(result: dict) -> list:
    """Each fused update within 1.5x of its bound, with its kernel's arithmetic against the bound
    (the profile: above 1.5x, no saving of bytes reaches the target); the fused fp32 kernel
    against torch's."""
    compute = {r["kernel"]: r["compute_vs_bound"] for r in result.get("profile", {}).get("rows", [])}
    out = []
    for r in result["rows"]:
        if r["variant"] not in PROFILED:
            continue
        arithmetic = compute.get(PROFILED[r["variant"]])
        note = "" if arithmetic is None else f" (arithmetic alone {arithmetic:.2f}x)"
        out.append({"target": f"update {r['variant']} <= 1.5x its bound", "measured": f"{r['vs_bound']:.2f}x{note}",
                    "met": r["vs_bound"] <= 1.5})
    ms = {r["variant"]: r["ms"] for r in result["rows"]}
    if KERNEL in ms and "torch AdamW fused fp32" in ms:  # the issue's: at least as fast as torch's fused AdamW
        ratio = ms[KERNEL] / ms["torch AdamW fused fp32"]
        out.append({"target": f"{KERNEL} <= torch AdamW fused fp32", "measured": f"{ratio:.2f}x", "met": ratio <= 1.0})
    return out
