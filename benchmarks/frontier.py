"""The memory frontier, side by side in one run: O7 (bf16 without masters) and O6 (fp8) against O5.

    python benchmarks/frontier.py [--quick] [--json PATH] [--steps N] [--fp8-steps N] [--size auto|full|small]

Progress lines go to stderr as the runs go, with the seconds since each part started; each part's
wall time is in its table heading and the JSON (``wall_s``).

1. compensated bf16: the demo LM (``ampkit.apps.demo.DEMO_LM``; ``--d-model`` for another width; where
   ``ampkit.capabilities()`` calls bfloat16 emulated, ``EMULATED_LM`` unless ``--d-model`` or ``--size full``)
   trained with AdamW for ``--steps`` steps at two learning rates, at O5, O7 (fp32 optimizer state), O7 with bf16 optimizer
   state, and two round-to-nearest controls: O7 with ``update_rounding="nearest"`` (the same
   fp32 update, rounded to nearest) and plain bf16 (O3 with bfloat16: the optimizer steps on
   bf16 weights and keeps bf16 state). Loss: mean of the last 20 steps; O7 also with rounding
   seeds 1..``--seeds``-1 (same weights and batches: the spread is the rounding noise alone). Memory: persistent
   bytes per parameter, measured by ``ampkit.footprint`` from the storages of the weights,
   master weights, optimizer state and ampkit's kept gradient buffers after the last
   ``zero_grad()`` (gradients and activations are per-step and not counted; Adam's float32
   step counter, 4 bytes per tensor, is shown apart). Step time: O5, O7 and O7 with bf16
   state in one process, alternating step by step (so load on the machine hits all
   three alike), median of each after 5 warm-up steps; once with the default threads and
   once with one thread (on a shared machine every multi-threaded kernel can wait for a
   descheduled thread, which penalises whichever variant launches more kernels).
2. fp8: the same LM for ``--fp8-steps`` steps at O5, O6 emulated and O6 with the device's
   ``torch._scaled_mm`` (where it has one); loss: mean of the last 10 steps.

Each run trains in a fresh process; every run starts from the same seeded weights and batches.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from statistics import median

import torch

import ampkit
from ampkit.apps.demo import DEMO_LM, isolated, machine
from ampkit.apps.demo_models import LMConfig, TinyLM, lm_batches, lm_loss
from ampkit.footprint import persistent_bytes
from run import Log, default_threads, emulated, table  # benchmarks/run.py: the same helpers

LM = DEMO_LM
QUICK_LM = LMConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4)
# The LM where bfloat16 is emulated on this CPU (``--size auto``): there a bf16 matmul runs 3-60x slower than fp32.
EMULATED_LM = LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=4)
LRS = (5e-4, 1e-4)
VARIANTS = {  # name: (level, overrides)
    "O5": ("O5", {}),
    "O7": ("O7", {}),
    "O7 bf16 state": ("O7", {"optimizer_state_dtype": torch.bfloat16}),
    "O7 nearest (control)": ("O7", {"update_rounding": "nearest"}),
    "plain bf16 (control)": ("O3", {"half_dtype": torch.bfloat16}),
}
FP8_VARIANTS = {"O5": ("O5", {}), "O6 emulated": ("O6", {"fp8": "emulate"}), "O6 _scaled_mm": ("O6", {"fp8": True})}


def train_worker(spec, level, overrides, lr, steps, threads, seed=0, *, report):
    """In a fresh process: AdamW on the LM at ``level`` (rounding ``seed`` where it rounds
    stochastically); losses, step times, persistent bytes."""
    torch.set_num_threads(threads)
    batches = lm_batches(spec, 8)
    torch.manual_seed(0)
    model = TinyLM(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    if seed:
        ampkit.stochastic_rounding.manual_seed(seed)
    losses, times = [], []
    for i in range(steps):
        if i and i % 50 == 0:
            report(f"    {level} lr={lr:g}: step {i}/{steps} ({sum(times):.1f} s)")
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    opt.zero_grad()
    mem = persistent_bytes([model], [opt])
    from ampkit import float8
    fp8 = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    emulated = sorted({str(m.config.emulate) for m in model.modules() if type(m).__name__ == "Float8Linear"})
    return {"losses": losses, "step_ms": 1e3 * median(times[5:] or times), "memory": mem,
            "bytes_per_param": (mem["total"] - mem["buffers"]) / mem["params"], "fp8_layers": len(fp8),
            "emulated": emulated, "fp8_matmul_here": float8.has_fp8_matmul(torch.device("cpu")) if fp8 else None}


def timing_worker(spec, variants, steps, threads, report):
    """In a fresh process: the ``variants`` alternating step by step; median ms per step of each."""
    torch.set_num_threads(threads)
    batches = lm_batches(spec, 8)
    loops = {}
    for name in variants:
        level, overrides = VARIANTS[name]
        torch.manual_seed(0)
        model = TinyLM(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=LRS[0])
        loops[name] = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    times = {name: [] for name in variants}
    for i in range(steps + 5):
        x, y = batches[i % len(batches)]
        order = list(loops.items()) if i % 2 == 0 else list(loops.items())[::-1]
        for name, (model, opt) in order:
            start = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(model(x), y)
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    return {name: 1e3 * median(t) for name, t in times.items()}


def tail(losses, n):
    return sum(losses[-n:]) / len(losses[-n:])


def bench_bf16(spec, steps, threads, seeds, log):
    timed = ("O5", "O7", "O7 bf16 state")
    step_ms = isolated(timing_worker, spec, timed, max(10, steps // 4), threads, report=log)
    log(f"step time, {threads} threads: " + ", ".join(f"{k} {v:.1f} ms" for k, v in step_ms.items()))
    step_ms_1t = isolated(timing_worker, spec, timed, max(10, steps // 4), 1, report=log)  # less exposed to other load
    log("step time, 1 thread: " + ", ".join(f"{k} {v:.1f} ms" for k, v in step_ms_1t.items()))
    rows = []
    for lr in LRS:
        for name, (level, overrides) in VARIANTS.items():
            r = isolated(train_worker, spec, level, overrides, lr, steps, threads, report=log)
            mem = r["memory"]
            rows.append({"variant": name, "lr": lr, "loss": tail(r["losses"], 20), "run_step_ms": r["step_ms"],
                         "step_ms": step_ms.get(name), "step_ms_1t": step_ms_1t.get(name), "memory": mem, "bytes_per_param": r["bytes_per_param"],
                         "elementwise_bytes_per_param": (mem["total"] - mem["buffers"] - mem["optimizer_scalars"]) / mem["params"]})
            log(f"{name} lr={lr:g}: loss {rows[-1]['loss']:.4f}")
        for seed in range(1, seeds):  # how much the loss moves with the rounding noise alone
            r = isolated(train_worker, spec, "O7", {}, lr, steps, threads, seed, report=log)
            rows.append({"variant": f"O7 seed {seed}", "lr": lr, "loss": tail(r["losses"], 20), "run_step_ms": r["step_ms"],
                         "bytes_per_param": r["bytes_per_param"]})
            log(f"O7 seed {seed} lr={lr:g}: loss {rows[-1]['loss']:.4f}")
    for row in rows:
        o5 = next(r for r in rows if r["variant"] == "O5" and r["lr"] == row["lr"])
        row["vs_O5_loss"] = row["loss"] - o5["loss"]
        row["speed_vs_O5"] = None if row.get("step_ms") is None else o5["step_ms"] / row["step_ms"]
        row["speed_vs_O5_1t"] = None if row.get("step_ms_1t") is None else o5["step_ms_1t"] / row["step_ms_1t"]
    return rows


def bench_fp8(spec, steps, threads, log):
    rows = []
    try:
        ampkit.float8.require()
    except ImportError as e:
        return [{"variant": "O6", "skipped": str(e)}]
    for name, (level, overrides) in FP8_VARIANTS.items():
        if name == "O6 _scaled_mm" and not ampkit.float8.has_fp8_matmul(torch.device("cpu")):
            rows.append({"variant": name, "skipped": "no torch._scaled_mm on this device"})
            continue
        r = isolated(train_worker, spec, level, overrides, 1e-3, steps, threads, report=log)
        rows.append({"variant": name, "loss": tail(r["losses"], 10), "last_loss": r["losses"][-1],
                     "step_ms": r["step_ms"], "bytes_per_param": r["bytes_per_param"], "fp8_layers": r["fp8_layers"],
                     "emulated": ",".join(r["emulated"]) or "-"})
        log(f"{name}: loss {rows[-1]['loss']:.4f}")
    o5 = rows[0]
    for row in rows:
        if "loss" in row:
            row["vs_O5_loss"] = row["loss"] - o5["loss"]
    return rows


def targets(bf16, fp8):
    out = []
    for lr in LRS:
        at = {r["variant"]: r for r in bf16 if r["lr"] == lr}
        if "O7" not in at:
            continue
        for v in ("O7", "O7 bf16 state"):
            out.append({"target": f"{v} loss within 0.002 of O5 (lr {lr:g})", "measured": f"{at[v]['vs_O5_loss']:+.4f}",
                        "met": abs(at[v]["vs_O5_loss"]) <= 0.002})
        seeded = [r["vs_O5_loss"] for r in bf16 if r["lr"] == lr and (r["variant"] == "O7" or r["variant"].startswith("O7 seed"))]
        if len(seeded) > 1:
            mean = sum(seeded) / len(seeded)
            out.append({"target": f"O7 loss within 0.002 of O5 (lr {lr:g}), mean of {len(seeded)} rounding seeds",
                        "measured": f"{mean:+.4f} (seeds {min(seeded):+.4f}..{max(seeded):+.4f})", "met": abs(mean) <= 0.002})
        for v in ("O7 nearest (control)", "plain bf16 (control)"):
            out.append({"target": f"{v} clearly worse than O5 (lr {lr:g}; > 0.01)", "measured": f"{at[v]['vs_O5_loss']:+.4f}",
                        "met": at[v]["vs_O5_loss"] > 0.01})
        for v, limit in (("O7", 10), ("O7 bf16 state", 6)):
            out.append({"target": f"{v} <= {limit} bytes/param, step counters apart (lr {lr:g})",
                        "measured": f"{at[v]['elementwise_bytes_per_param']:.3f} ({at[v]['bytes_per_param']:.4f} with them)",
                        "met": at[v]["elementwise_bytes_per_param"] <= limit})
    for v in ("O7", "O7 bf16 state"):
        row = next((r for r in bf16 if r["variant"] == v and r.get("speed_vs_O5") is not None), None)
        if row is not None:
            out.append({"target": f"{v} speed >= 0.9x O5 (alternating steps)", "measured": f"{row['speed_vs_O5']:.2f}x",
                        "met": row["speed_vs_O5"] >= 0.9})
            out.append({"target": f"{v} speed >= 0.9x O5 (alternating steps, 1 thread)", "measured": f"{row['speed_vs_O5_1t']:.2f}x",
                        "met": row["speed_vs_O5_1t"] >= 0.9})
    for row in fp8:
        if "vs_O5_loss" in row and row["variant"] != "O5":
            out.append({"target": f"{row['variant']} loss within 0.01 of O5", "measured": f"{row['vs_O5_loss']:+.4f}",
                        "met": abs(row["vs_O5_loss"]) <= 0.01})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="O7 (compensated bf16) and O6 (fp8) against O5")
    p.add_argument("--quick", action="store_true", help="tiny LM and few steps: checks that it runs; figures not valid")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fp8-steps", type=int, default=60)
    p.add_argument("--d-model", type=int, help=f"LM width (default {LM.d_model}, the demo's; see --size)")
    p.add_argument("--seeds", type=int, default=5, help="O7 runs with rounding seeds 0..N-1 (the spread is the noise)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one less per busy core by the load average)")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help=f"auto: without --d-model, the small LM ({EMULATED_LM.d_model} wide) where "
                        f"ampkit.capabilities() calls bfloat16 emulated here")
    args = p.parse_args(argv)
    threads = args.threads or default_threads()
    small = args.size == "small" or (args.size == "auto" and not args.d_model and emulated(("O5",), torch.device("cpu")))
    spec = QUICK_LM if args.quick else EMULATED_LM if small else dataclasses.replace(LM, d_model=args.d_model or LM.d_model)
    steps, fp8_steps = (25, 10) if args.quick else (args.steps, args.fp8_steps)
    torch.set_num_threads(threads)
    info = machine(torch.device("cpu"))
    print(f"ampkit {ampkit.__version__} frontier{' --quick' if args.quick else ''}: {info}", flush=True)
    started, wall = time.perf_counter(), {}
    log = Log("bf16")
    bf16 = bench_bf16(spec, steps, threads, 2 if args.quick else args.seeds, log)
    wall["bf16"] = time.perf_counter() - log.start
    log = Log("fp8")
    fp8 = bench_fp8(spec, fp8_steps, threads, log)
    wall["fp8"] = time.perf_counter() - log.start
    goals = targets(bf16, fp8)
    print(f"\n1. Compensated bf16 (LM {vars(spec)}, AdamW, {steps} steps; loss = mean of the last 20; "
          f"bytes/param measured: weights + masters + optimizer state + kept grad buffers; {wall['bf16']:.0f} s)")
    print(table(bf16, [("variant", "variant", "{}"), ("lr", "lr", "{:g}"), ("loss", "loss", "{:.4f}"), ("vs O5", "vs_O5_loss", "{:+.4f}"),
                       ("bytes/param", "bytes_per_param", "{:.4f}"), ("w/o step counters", "elementwise_bytes_per_param", "{:.3f}"),
                       ("ms/step (own run)", "run_step_ms", "{:.1f}"), ("ms/step (alternating)", "step_ms", "{:.1f}"),
                       ("speed vs O5", "speed_vs_O5", "{:.2f}x"), ("ms/step 1 thread", "step_ms_1t", "{:.1f}"),
                       ("speed vs O5, 1 thread", "speed_vs_O5_1t", "{:.2f}x")]))
    print(f"\n2. fp8 (same LM, AdamW lr 1e-3, {fp8_steps} steps; loss = mean of the last 10; {wall['fp8']:.0f} s)")
    print(table(fp8, [("variant", "variant", "{}"), ("loss", "loss", "{:.4f}"), ("last", "last_loss", "{:.4f}"), ("vs O5", "vs_O5_loss", "{:+.4f}"),
                      ("fp8 layers", "fp8_layers", "{}"), ("emulated", "emulated", "{}"), ("ms/step", "step_ms", "{:.1f}"),
                      ("bytes/param", "bytes_per_param", "{:.2f}"), ("skipped", "skipped", "{}")]))
    print("\nTargets" + (" (--quick: not valid)" if args.quick else ""))
    print(table(goals, [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")]))
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s; load average (1 min) {info['load_average']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"on {info['cores']} cores (more than the core count: other work shared the CPUs).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average_end": os.getloadavg()[0], "argv": sys.argv, "quick": args.quick, "seconds": seconds,
                       "wall_s": wall, "sizes": "quick" if args.quick else "small" if small else "full",
                       "lm": vars(spec), "steps": steps, "seeds": args.seeds, "fp8_steps": fp8_steps, "bf16": bf16, "fp8": fp8, "targets": goals}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
