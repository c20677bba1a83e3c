"""7. update: the optimizer update alone, AdamW and SGD with momentum, per level and beside the
   optimizers people use, against its memory-traffic bound (``python benchmarks/run.py --only update
   [--quick]``). Targets: each fused AdamW level <= 1.5x its bound; ampkit's fused fp32 AdamW kernel
   <= torch's ``AdamW(fused=True)``; each level's fused update <= its own eager path (AdamW and SGD).

A model of four large parameters whose loss is linear in them (so the backward pass is one cheap
pass and every row sees the same gradients). Two sections in one process, AdamW (lr 1e-3, torch's
defaults) then SGD (lr 0.1, momentum 0.9, weight decay 5e-4, no dampening or Nesterov: the ImageNet
recipe); within a section every row steps in turn each step (order reversed on odd steps), medians
after 2 warm-up steps, each row's first step taken before them (torchao compiles its step there).
Timed: from the end of ``backward()`` (leaving ``scale_loss``, where O5 moves the gradients to its
masters, then ``opt.step()``). The rows (``families/update_variants.py``), per optimizer:

- ampkit's O5 and remainder masters (fused: ``ampkit/_kernels/fused_masters.py``, one pass; O5's also
  moves the bf16 gradients into fp32 master gradients first), O7 and O7 with bf16 state (fused:
  ``ampkit/_kernels/fused_adamw.py``, ``fused_sgd.py``; on CUDA one ``torch.compile`` Triton kernel per
  tensor, ``ampkit/_kernels/compiled_update.py``, ``compiled_sgd.py``), O8 (fused: ``ampkit/_kernels/fused_adamw_8bit.py``), and the
  same five through the optimizer's own step (``AMPKIT_FUSED=0``, the "eager" rows; on CUDA, where the
  C kernels do not run, both rows take that step). Where a level has no fused update for the
  optimizer, its two rows take the same path;
- torch's fp32 optimizers on a float32 model: ``AdamW(fused=True)`` (the anchor a fused fp32 update
  should reach) and ampkit's fused fp32 kernel alone; ``SGD(fused=True)`` and ``SGD(foreach=True)``;
- the peers of ``benchmarks/peers.py`` on the model cast to bf16, each where its library imports
  (else skipped, with the reason printed): plain torch AdamW / SGD on bf16 weights (the controls),
  torchao ``_AdamW(bf16_stochastic_round=True)`` and ``AdamW8bit(bf16_stochastic_round=True)``,
  optimi ``AdamW`` / ``SGD`` with Kahan summation, bitsandbytes ``AdamW8bit`` / ``SGD8bit``. A row that
  fails on its first step (a library without this device) is skipped the same way.

Columns: ``ideal B``: the fewest bytes per parameter the update must read and write (each tensor
once; a peer's by the same count from its state's dtypes); ``moved B``: the bytes per parameter the
path's kernels move, counted from the kernels it runs (O5's fused row: the move into fp32 master
gradients and its kernel; the other fused rows: the gradient check, a read of the bf16 gradients,
and the one-pass kernel; the eager paths: each torch op's reads and writes; "-" where not counted);
``state B``: the persistent bytes per parameter after the run (weights, masters or remainders,
optimizer state: ``ampkit.footprint.persistent_bytes`` for a level, ``peers.state_bytes`` for the
others); ``GB/s``: ideal bytes over the time; ``vs O5``: time over the same optimizer's O5; ``vs eager``:
a fused level's time over its eager row's; ``bound ms``: ideal bytes over the streaming bandwidth of
the probe, timed in the same alternation, so under the same load; ``vs bound``: time over that bound.

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

from common import _sync, env_restored, table, timed
from families.update_profile import COLUMNS, SMALL, profile
from families.update_variants import EAGER, KERNEL, TABLES, build, state_bytes, why_not

PROBE, COPY = "in-place add", "copy"  # the bandwidth probes' keys: float32 add_ and copy_, alternating with the rows


class Linear(nn.Module):
    """Four parameters of ``n / 4`` elements; the loss is linear in them (gradient ``c``)."""

    def __init__(self, n: int):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(n // 4 // 256, 256) * 0.02) for _ in range(4)])
        self.register_buffer("c", torch.randn(256) * 1e-3, persistent=False)

    def forward(self, x):
        return sum((w * self.c).sum() for w in self.ws) + x.sum() * 0


def one_step(v, model, opt, x, device) -> float:
    """Seconds of the update of one step of row ``v`` (see the module docstring)."""
    os.environ["AMPKIT_FUSED"] = "1" if v.fused else "0"
    opt.zero_grad()
    loss = model(x)
    if v.level is None:
        loss.backward()
        _sync(device)
        start = time.perf_counter()
    else:
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
            _sync(device)
            start = time.perf_counter()
    opt.step()
    _sync(device)
    return time.perf_counter() - start


def prepare(optimizer: str, n: int, x, device, log):
    """Each row of ``optimizer`` that runs here, built and stepped once: {name: (row, model, opt)}; and
    {name: why} for the rows skipped."""
    loops, skipped = {}, {}
    for name, v in TABLES[optimizer].items():
        why = why_not(v)
        if why is None:
            log(f"{optimizer}: build {name}")
            try:
                torch.manual_seed(0)
                model, opt = build(optimizer, v, Linear(n), device)
                one_step(v, model, opt, x, device)
                loops[name] = (v, model, opt)
                continue
            except Exception as e:  # a library without this device, a row this ampkit cannot run
                why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
        skipped[name] = why
        log(f"{optimizer}: {name} skipped, {why}")
    return loops, skipped


def alternate(optimizer: str, loops: dict, n: int, steps: int, x, device, log) -> dict:
    """Per row and probe, the seconds of each step after 2 warm-up steps, every one in turn each step."""
    src = torch.ones(2 * n, device=device)  # the probes: 24 (add_) and 16 (copy_) bytes per parameter
    dst = torch.ones_like(src)
    probes = {PROBE: lambda: timed(dst.add_, device, src), COPY: lambda: timed(dst.copy_, device, src)}
    order = list(loops) + list(probes)
    times = {name: [] for name in order}
    for i in range(steps + 2):
        for name in order if i % 2 == 0 else order[::-1]:
            t = probes[name]() if name in probes else one_step(*loops[name], x, device)
            if i >= 2:
                times[name].append(t)
        log(f"{optimizer}: step {i + 1}/{steps + 2}" + (" (warm-up)" if i < 2 else ""))
    return times


def rows_of(optimizer: str, loops: dict, times: dict, n: int) -> tuple:
    """The section's rows (see the module docstring's columns) and its probes' bandwidths."""
    gbps = 24 * n / median(times[PROBE]) / 1e9  # in the same alternation, under the same load
    ms = {name: median(times[name]) for name in loops}
    rows = []
    for name, (v, model, opt) in loops.items():
        t, bound = ms[name], v.ideal * n / (gbps * 1e9)
        eager = ms.get(EAGER.get(name))
        rows.append({"optimizer": optimizer, "variant": name, "ms": 1e3 * t, "least_ms": 1e3 * min(times[name]),
                     "ideal_bytes": v.ideal, "moved_bytes": v.moved, "state_bytes": state_bytes(v, model, opt),
                     "gbps": v.ideal * n / t / 1e9, "vs_O5": t / ms["O5"] if "O5" in ms else None,
                     "vs_eager": t / eager if eager else None, "bound_ms": 1e3 * bound, "vs_bound": t / bound})
    return rows, {"stream_gbps": gbps, "copy_gbps": 16 * n / median(times[COPY]) / 1e9}


def bench_section(optimizer: str, n: int, steps: int, device, log) -> tuple:
    x = torch.zeros(1, device=device)
    loops, skipped = prepare(optimizer, n, x, device, log)
    log(f"{optimizer}: {n} parameters, {len(loops)} rows and two bandwidth probes, {steps} steps")
    rows, probes = rows_of(optimizer, loops, alternate(optimizer, loops, n, steps, x, device, log), n)
    return rows, {**probes, "skipped": skipped}


def run(cfg, device, args, log) -> dict:
    n, steps = cfg["update_params"], cfg["update_steps"]
    rows, sections = [], {}
    with env_restored("AMPKIT_FUSED"):
        for optimizer in TABLES:  # one after the other: each section's models are freed before the next
            section_rows, sections[optimizer] = bench_section(optimizer, n, steps, device, log)
            rows += section_rows
    prof = profile(n, log) if device.type == "cpu" else {}
    return {"params": n, "steps": steps, "threads": args.threads, "device": str(device), "sections": sections,
            "rows": rows, "profile": prof}


ROW_COLUMNS = [("variant", "variant", "{}"), ("ms", "ms", "{:.2f}"), ("least ms", "least_ms", "{:.2f}"),
               ("ideal B", "ideal_bytes", "{}"), ("moved B", "moved_bytes", "{}"), ("state B", "state_bytes", "{:.2f}"),
               ("GB/s", "gbps", "{:.2f}"), ("vs O5", "vs_O5", "{:.3f}x"), ("vs eager", "vs_eager", "{:.3f}x"),
               ("bound ms", "bound_ms", "{:.2f}"), ("vs bound", "vs_bound", "{:.2f}x")]
HYPERS = {"AdamW": "lr 1e-3, torch's defaults", "SGD": "lr 0.1, momentum 0.9, weight decay 5e-4"}


def report(result: dict) -> list:
    out = []
    for optimizer, s in result["sections"].items():
        out += [f"\n7. Update: {optimizer} ({HYPERS[optimizer]}) update alone, {result['params']} parameters, "
                f"{result['steps']} steps alternating, {result['threads']} threads, in-place bandwidth "
                f"{s['stream_gbps']:.1f} GB/s (the bound's; a copy: {s['copy_gbps']:.1f} GB/s) ({result['device']})",
                table([r for r in result["rows"] if r["optimizer"] == optimizer], ROW_COLUMNS)]
        out += [f"  skipped: {name}: {why}" for name, why in s["skipped"].items()]
    if result.get("profile"):
        out += [f"\nProfile: each fused AdamW kernel called alone on one thread, ns per element: in the caches "
                f"({SMALL} elements: the arithmetic) and streaming ({result['params']}); bound: ideal bytes at "
                f"{result['profile']['gbps']:.1f} GB/s (one thread, in-place add_)", table(result["profile"]["rows"], COLUMNS)]
    return out


PROFILED = {"O5": "O5 masters (fp32 grad)", "remainder": "remainder", "O7 fused": "O7",
            "O7 bf16 state fused": "O7 bf16 state", "O8": "O8", KERNEL: "fp32 kernel alone"}  # AdamW row: its kernel


def targets(result: dict) -> list:
    """Each fused AdamW update within 1.5x of its bound, with its kernel's arithmetic against the
    bound (the profile: above 1.5x, no saving of bytes reaches the target); the fused fp32 kernel
    against torch's; each fused level against its eager path, for both optimizers."""
    compute = {r["kernel"]: r["compute_vs_bound"] for r in result.get("profile", {}).get("rows", [])}
    out = []
    for r in result["rows"]:
        if r["optimizer"] == "AdamW" and r["variant"] in PROFILED:
            arithmetic = compute.get(PROFILED[r["variant"]])
            note = "" if arithmetic is None else f" (arithmetic alone {arithmetic:.2f}x)"
            out.append({"target": f"update {r['variant']} <= 1.5x its bound", "measured": f"{r['vs_bound']:.2f}x{note}",
                        "met": r["vs_bound"] <= 1.5})
    for r in result["rows"]:
        if r["vs_eager"] is not None:
            out.append({"target": f"update {r['optimizer']} {r['variant']} <= its eager path (AMPKIT_FUSED=0)",
                        "measured": f"{r['vs_eager']:.3f}x", "met": r["vs_eager"] <= 1.0})
    ms = {r["variant"]: r["ms"] for r in result["rows"] if r["optimizer"] == "AdamW"}
    if KERNEL in ms and "torch AdamW fused fp32" in ms:  # the issue's: at least as fast as torch's fused AdamW
        ratio = ms[KERNEL] / ms["torch AdamW fused fp32"]
        out.append({"target": f"{KERNEL} <= torch AdamW fused fp32", "measured": f"{ratio:.2f}x", "met": ratio <= 1.0})
    return out
