"""The memory frontier, side by side in one run: ampkit's bf16 levels and other libraries' low-memory
bf16 optimizers against O5, and O6 (fp8).

    python benchmarks/frontier.py [--quick] [--json PATH] [--steps N] [--seeds N] [--lrs 5e-4,1e-4]
                                  [--only O7,torchao] [--no-peers] [--device cpu|cuda] [--fp8-steps N]
                                  [--train-batches N] [--threads N] [--d-model N] [--size auto|full|small]

Progress lines go to stderr as the runs go, with the seconds since each part started; each part's
wall time is in its table heading and the JSON (``wall_s``).

1. bf16 frontier: the demo LM (``ampkit._cli.demo.DEMO_LM``; ``--d-model`` for another width; where
   ``ampkit.capabilities()`` calls bfloat16 emulated, ``EMULATED_LM`` unless ``--size full``; ``--d-model`` sets the width)
   trained with AdamW for ``--steps`` steps at each of ``--lrs``. Variants: ampkit's O5, O5 with
   ``master_weights="remainder"``, O7 (fp32 optimizer state), O7 with bf16 state, O8 (where
   ``ampkit._config.levels.OPT_LEVELS`` has it) and the control O7 with ``update_rounding="nearest"``;
   the peers of ``benchmarks/peers.py`` (plain ``torch.optim.AdamW`` on bf16 weights as the other
   control, torchao ``_AdamW`` and ``AdamW8bit`` with bf16 stochastic rounding, optimi ``AdamW`` with
   Kahan summation, bitsandbytes ``AdamW8bit``), each on the model cast to bf16; a peer whose library
   does not import is skipped with a note. Seeds 0..``--seeds``-1: a seed fixes the initial weights
   (``torch.manual_seed``), the batches (``lm_batches(seed=...)``: a seeded Markov chain; a fresh batch
   every step, or ``--train-batches N`` cycled; 4 held-out batches drawn after them from the same
   chain) and the rounding (ampkit's ``stochastic_rounding.manual_seed``; torchao draws from torch's
   global generator).
   Every variant's loss is computed in fp32 from the logits. Loss: mean of the last 20 steps; its gap
   to O5 is taken per seed (same weights, batches and seed) and shown as the mean and the range over
   seeds. Held-out loss: the mean over the held-out batches after the last step, its gap paired the
   same way. Memory (seed 0, first lr): persistent bytes per parameter after the last ``zero_grad()``,
   each storage once: for ampkit ``ampkit.footprint.persistent_bytes`` (weights, masters or
   remainders, optimizer state, kept grad buffers), for peers ``peers.state_bytes`` (weights, every
   tensor in the optimizer state, tensor subclasses by their inner tensors: 8-bit codes, block scales,
   quantization maps, Kahan buffers); gradients and activations are per-step and not counted, model
   buffers are left out, one-element state (step counters) is shown apart. Step time: every variant in
   one process, alternating step by step (so load on the machine hits all alike), seed 0, the first
   lr; each variant's first step is timed apart ("first-step compile s": torchao compiles its step
   there, with the inductor cache as found), then the median of each after 5 warm-up steps; once
   with the default threads and, on a CPU, once more with one thread where that differs (on a shared
   machine every multi-threaded kernel can wait for a descheduled thread, which penalises whichever
   variant launches more kernels).
2. fp8: the same LM for ``--fp8-steps`` steps at O5, O6 emulated and O6 with the device's
   ``torch._scaled_mm`` (where it has one); loss: mean of the last 10 steps; seed 0, fresh batches
   (or ``--train-batches N`` cycled).

3. Targets (issue 24): loss within 0.002 of O5 (remainder, O7) or 0.005 (O7 bf16 state, O8), mean of
   the seeds at each lr; bytes per parameter (remainder 12, O7 10, O7 bf16 state 6, O8 4.1); the whole
   step's time against O5's, AdamW, the peers alternating beside them (O7 0.98x, O8 and remainder
   1.00x, O7 bf16 state 1.05x; the cost table's "vs O5" is the same ratio for every row, peers
   included); the controls more than 0.01 worse; fp8 within 0.01.

Each training run is a fresh process (``ampkit._cli.demo.isolated``). ``--device cuda`` runs the same
on a GPU; a variant that fails on the device is reported as skipped with its error.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
from statistics import mean, median

import torch

import ampkit
import peers  # benchmarks/peers.py
from ampkit import float8
from ampkit._cli.demo import DEMO_LM, isolated, machine
from ampkit._cli.demo_models import LMConfig, TinyLM, lm_batches, lm_loss
from ampkit._config.levels import OPT_LEVELS
from ampkit.footprint import persistent_bytes
from common import Log, default_threads, emulated, table  # benchmarks/common.py: the same helpers

LM = DEMO_LM
QUICK_LM = LMConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4)
# The LM where bfloat16 is emulated on this CPU (``--size auto``): there a bf16 matmul runs 3-60x slower than fp32.
EMULATED_LM = LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=4)
LRS = (5e-4, 1e-4)
HELD_OUT = 4  # batches, drawn after the training batches from the same chain
AMPKIT = {  # name: (level, overrides); the ampkit variants of the bf16 frontier
    "O5": ("O5", {}),
    "O5 remainder": ("O5", {"master_weights": "remainder"}),
    "O7": ("O7", {}),
    "O7 bf16 state": ("O7", {"optimizer_state_dtype": torch.bfloat16}),
    "O8": ("O8", {}),  # 8-bit optimizer state: runs where the level exists
    "O7 nearest (control)": ("O7", {"update_rounding": "nearest"}),
}
FP8_VARIANTS = {"O5": ("O5", {}), "O6 emulated": ("O6", {"fp8": "emulate"}), "O6 _scaled_mm": ("O6", {"fp8": True})}
LEVELS = {**AMPKIT, **FP8_VARIANTS}


def variants(only, with_peers):
    """The bf16 variants to run (O5 always: the reference), and notes on those left out."""
    names, notes = [], []
    for name in [*AMPKIT, *(peers.PEERS if with_peers else ())]:
        if only and name != "O5" and not any(name.startswith(p) for p in only):
            continue
        if name in AMPKIT:
            why = None if AMPKIT[name][0] in OPT_LEVELS else f"this ampkit has no level {AMPKIT[name][0]}"
        else:
            why = peers.missing(name)
        if why:
            notes.append(f"{name}: skipped, {why}")
        else:
            names.append(name)
    return names, notes


def scaled_backward(opt, loss):
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()


def seed_rounding(opt, seed):
    """Seed ampkit's stochastic rounding of ``opt``'s updates, where its level rounds stochastically."""
    try:
        ampkit.stochastic_rounding.manual_seed(seed, opt)
    except RuntimeError:  # the level rounds to nearest: nothing to seed
        pass


def build(name, spec, lr, device, seed=0):
    """Variant ``name``: the LM seeded with ``seed``, its optimizer, and how it backpropagates a loss."""
    torch.manual_seed(seed)
    model = TinyLM(spec).to(device)
    if name in LEVELS:
        level, overrides = LEVELS[name]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, **peers.ADAMW)
        model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
        seed_rounding(opt, seed)
        return model, opt, partial(scaled_backward, opt)
    model = model.to(torch.bfloat16)
    return model, peers.make(name, model, lr), torch.Tensor.backward


def train_step(model, opt, backward, x, y):
    opt.zero_grad()
    loss = lm_loss(model(x).float(), y)
    backward(loss)
    opt.step()
    return loss


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seeded_batches(spec, seed, device, train):
    """``train`` training batches and ``HELD_OUT`` held-out ones, from the same seeded chain."""
    batches = [(x.to(device), y.to(device)) for x, y in lm_batches(spec, train + HELD_OUT, seed)]
    return batches[:train], batches[train:]


def footprint(model, opt, by_ampkit):
    """Persistent bytes (``by_ampkit``: ampkit's own count, else ``peers.state_bytes``) and bytes per parameter."""
    mem = persistent_bytes([model], [opt]) if by_ampkit else peers.state_bytes(model, opt)
    return {"memory": mem, "bytes_per_param": (mem["total"] - mem["buffers"]) / mem["params"],
            "elementwise_bytes_per_param": (mem["total"] - mem["buffers"] - mem["optimizer_scalars"]) / mem["params"]}


def train_worker(spec, name, lr, steps, threads, seed, device, train, *, report):
    """In a fresh process: variant ``name`` from ``seed``; losses, held-out loss, step times, persistent bytes."""
    torch.set_num_threads(threads)
    device = torch.device(device)
    batches, held_out = seeded_batches(spec, seed, device, train)
    model, opt, backward = build(name, spec, lr, device, seed)
    losses, times = [], []
    for i in range(steps):
        if i and i % 100 == 0:
            report(f"    {name} lr={lr:g} seed {seed}: step {i}/{steps} ({sum(times):.1f} s)")
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        loss = train_step(model, opt, backward, x, y)
        sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    opt.zero_grad()
    with torch.no_grad():
        held = mean(lm_loss(model(x).float(), y).item() for x, y in held_out)
    fp8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    return {"losses": losses, "heldout": held, "step_ms": 1e3 * median(times[5:] or times), "first_step_s": times[0],
            **footprint(model, opt, name in LEVELS), "fp8_layers": len(fp8),
            "emulated": sorted({str(m.config.emulate) for m in fp8}),
            "fp8_matmul_here": float8.has_fp8_matmul(device) if fp8 else None}


def first_line_of(error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def timing_worker(spec, names, lr, steps, threads, device, *, report):
    """In a fresh process: the variants alternating step by step; per variant the first step's seconds
    (timed alone: torchao compiles there) and the median ms per step after 5 warm-up steps."""
    torch.set_num_threads(threads)
    device = torch.device(device)
    batches, _ = seeded_batches(spec, 0, device, steps + 6)
    loops, out = {}, {}
    for name in names:
        try:
            loop = build(name, spec, lr, device)
            start = time.perf_counter()
            train_step(*loop, *batches[0])
            sync(device)
            loops[name], out[name] = loop, {"first_step_s": time.perf_counter() - start, "times": []}
        except Exception as e:  # a peer that cannot run on this device
            out[name] = {"skipped": first_line_of(e)}
    for i in range(1, steps + 6):
        x, y = batches[i % len(batches)]
        for name, loop in (list(loops.items()) if i % 2 else list(loops.items())[::-1]):
            start = time.perf_counter()
            train_step(*loop, x, y)
            sync(device)
            if i > 5:
                out[name]["times"].append(time.perf_counter() - start)
        if i % 25 == 0:
            report(f"    timing, {threads} thread(s): step {i}/{steps + 5}")
    for r in out.values():
        if "times" in r:
            r["step_ms"] = 1e3 * median(r.pop("times"))
    return out


def tail(losses, n):
    return sum(losses[-n:]) / len(losses[-n:])


def costs(spec, names, lr, steps, threads, device, log):
    """Step times from one timing process (and one with 1 thread on a CPU); bytes come from the training runs."""
    timed = {threads: isolated(timing_worker, spec, names, lr, steps, threads, str(device), report=log)}
    if device.type == "cpu" and threads != 1:  # less exposed to other load
        timed[1] = isolated(timing_worker, spec, names, lr, steps, 1, str(device), report=log)
    rows = []
    for name in names:
        row = {"variant": name, **timed[threads][name]}
        if threads != 1 and "step_ms" in timed.get(1, {}).get(name, {}):
            row["step_ms_1t"] = timed[1][name]["step_ms"]
        rows.append(row)
    for row in rows:
        for key, suffix in (("step_ms", ""), ("step_ms_1t", "_1t")):
            if row.get(key) is not None and rows[0].get(key) is not None:
                row["time_vs_O5" + suffix] = row[key] / rows[0][key]
    log("step time: " + ", ".join(f"{r['variant']} {r['step_ms']:.1f} ms" for r in rows if "step_ms" in r))
    return rows


def runs(spec, names, lrs, steps, seeds, threads, device, train, log):
    """Every variant at every lr and seed, each in a fresh process; one dict per run."""
    out = []
    for lr in lrs:
        for seed in range(seeds):
            for name in names:
                row = {"variant": name, "lr": lr, "seed": seed}
                try:
                    r = isolated(train_worker, spec, name, lr, steps, threads, seed, str(device), train, report=log)
                except RuntimeError as e:  # a peer that cannot run on this device
                    out.append({**row, "skipped": first_line_of(e)})
                    log(f"{name} lr={lr:g} seed {seed}: skipped, {out[-1]['skipped']}")
                    continue
                out.append({**row, "loss": tail(r["losses"], 20), **{k: r[k] for k in (
                    "heldout", "step_ms", "first_step_s", "memory", "bytes_per_param", "elementwise_bytes_per_param")}})
                log(f"{name} lr={lr:g} seed {seed}: loss {out[-1]['loss']:.4f}, held-out {r['heldout']:.4f}")
    return out


def summary(all_runs, names, lrs):
    """Per variant and lr: mean loss and held-out loss over seeds, and their gaps to O5 paired by seed."""
    rows = []
    for lr in lrs:
        o5 = {r["seed"]: r for r in all_runs if r["variant"] == "O5" and r["lr"] == lr and "loss" in r}
        for name in names:
            done = [r for r in all_runs if r["variant"] == name and r["lr"] == lr and "loss" in r and r["seed"] in o5]
            if not done:
                skipped = next((r["skipped"] for r in all_runs if r["variant"] == name and "skipped" in r), None)
                rows.append({"variant": name, "lr": lr, "skipped": skipped})
                continue
            row = {"variant": name, "lr": lr, "seeds": len(done)}
            for key in ("loss", "heldout"):
                paired = [r[key] - o5[r["seed"]][key] for r in done]
                row.update({key: mean(r[key] for r in done), f"{key}_vs_O5": mean(paired),
                            f"{key}_gaps": (min(paired), max(paired))})
            rows.append(row)
    return rows


def bench_bf16(spec, names, lrs, steps, seeds, threads, device, train, log):
    cost = costs(spec, names, lrs[0], max(10, steps // 4), threads, device, log)
    done = runs(spec, names, lrs, steps, seeds, threads, device, train, log)
    for row in cost:  # bytes from seed 0 at the first lr (the same at every lr and seed)
        run = next((r for r in done if r["variant"] == row["variant"] and "memory" in r), None)
        if run is not None:
            row.update({k: run[k] for k in ("memory", "bytes_per_param", "elementwise_bytes_per_param")})
    return summary(done, names, lrs), cost, done


def bench_fp8(spec, steps, threads, device, train, log):
    rows = []
    try:
        float8.require()
    except ImportError as e:
        return [{"variant": "O6", "skipped": str(e)}]
    for name in FP8_VARIANTS:
        if name == "O6 _scaled_mm" and not float8.has_fp8_matmul(device):
            rows.append({"variant": name, "skipped": f"no torch._scaled_mm on {device}"})
            continue
        r = isolated(train_worker, spec, name, 1e-3, steps, threads, 0, str(device), train, report=log)
        rows.append({"variant": name, "loss": tail(r["losses"], 10), "last_loss": r["losses"][-1],
                     "step_ms": r["step_ms"], "bytes_per_param": r["bytes_per_param"], "fp8_layers": r["fp8_layers"],
                     "emulated": ",".join(r["emulated"]) or "-"})
        log(f"{name}: loss {rows[-1]['loss']:.4f}")
    o5 = rows[0]
    for row in rows:
        if "loss" in row:
            row["vs_O5_loss"] = row["loss"] - o5["loss"]
    return rows


LOSS_LIMITS = {"O5 remainder": 0.002, "O7": 0.002, "O7 bf16 state": 0.005, "O8": 0.005}  # |loss - O5|, mean of seeds
def _remainder_bytes_target(row: dict) -> dict:
    """Remainder masters: exactly 12 bytes a parameter plus 8 a side-table entry (the masters' bytes
    beyond the int16 remainders are the tables' entries), step counters apart."""
    mem = row["memory"]
    table_bytes = mem["masters"] - 2 * mem["params"]
    exact = 12 + table_bytes / mem["params"]
    return {"target": "O5 remainder == 12 bytes/param + 8 per side-table entry, step counters apart",
            "measured": f"{row['elementwise_bytes_per_param']:.7f} ({table_bytes // 8} entries: {exact:.7f})",
            "met": table_bytes % 8 == 0 and abs(row["elementwise_bytes_per_param"] - exact) < 1e-9}


BYTE_LIMITS = {"O5 remainder": 12, "O7": 10, "O7 bf16 state": 6, "O8": 4.1}  # bytes/param, step counters apart
TIME_LIMITS = {"O5 remainder": 1.00, "O7": 0.98, "O7 bf16 state": 1.05, "O8": 1.00}  # step time / O5's


def targets(bf16, cost, fp8):
    out = []
    by_name = {r["variant"]: r for r in cost}
    for row in bf16:
        v, lr, gap = row["variant"], row["lr"], row.get("loss_vs_O5")
        if gap is None:
            continue
        spread = f"{gap:+.4f} (seeds {row['loss_gaps'][0]:+.4f}..{row['loss_gaps'][1]:+.4f})"
        if v in LOSS_LIMITS:  # remainder: O5's numbers up to a lost value (README)
            out.append({"target": f"{v} loss within {LOSS_LIMITS[v]} of O5 (lr {lr:g}), mean of {row['seeds']} seeds",
                        "measured": spread, "met": abs(gap) <= LOSS_LIMITS[v]})
        elif v.endswith("(control)"):
            out.append({"target": f"{v} clearly worse than O5 (lr {lr:g}; > 0.01)", "measured": spread, "met": gap > 0.01})
    for v in BYTE_LIMITS:
        row = by_name.get(v, {})
        if "elementwise_bytes_per_param" in row and v == "O5 remainder":
            out.append(_remainder_bytes_target(row))
        elif "elementwise_bytes_per_param" in row:
            out.append({"target": f"{v} <= {BYTE_LIMITS[v]} bytes/param, step counters apart",
                        "measured": f"{row['elementwise_bytes_per_param']:.3f} ({row['bytes_per_param']:.4f} with them)",
                        "met": row["elementwise_bytes_per_param"] <= BYTE_LIMITS[v]})
        for key, how in (("time_vs_O5", ""), ("time_vs_O5_1t", ", 1 thread")):
            if row.get(key):
                out.append({"target": f"{v} step time <= {TIME_LIMITS[v]:.2f}x O5 (AdamW, alternating steps{how})",
                            "measured": f"{row[key]:.3f}x", "met": row[key] <= TIME_LIMITS[v]})
    for row in fp8:
        if "vs_O5_loss" in row and row["variant"] != "O5":
            out.append({"target": f"{row['variant']} loss within 0.01 of O5", "measured": f"{row['vs_O5_loss']:+.4f}",
                        "met": abs(row["vs_O5_loss"]) <= 0.01})
    return out


def gaps(key):
    return lambda r: r.get(f"{key}_gaps") and "{:+.4f}..{:+.4f}".format(*r[f"{key}_gaps"])


def print_report(spec, steps, seeds, train, bf16, cost, fp8, goals, wall, fp8_steps, quick):
    data = f"{train} training batches, cycled" if train < steps else "a fresh batch every step"
    print(f"\n1. bf16 frontier (LM {vars(spec)}, AdamW, {steps} steps, {data}, seeds 0..{seeds - 1}; loss = mean of the "
          f"last 20; held-out = {HELD_OUT} batches after the last step; gaps to O5 paired by seed; {wall['bf16']:.0f} s)")
    print(table(bf16, [("variant", "variant", "{}"), ("lr", "lr", "{:g}"), ("loss", "loss", "{:.4f}"),
                       ("vs O5 (mean)", "loss_vs_O5", "{:+.4f}"), ("vs O5 (seeds)", gaps("loss"), "{}"),
                       ("held-out", "heldout", "{:.4f}"), ("held-out vs O5", "heldout_vs_O5", "{:+.4f}"),
                       ("held-out vs O5 (seeds)", gaps("heldout"), "{}"), ("skipped", "skipped", "{}")]))
    print("\nCost (bytes/param after the last zero_grad(), seed 0: ampkit.footprint.persistent_bytes for ampkit, "
          "peers.state_bytes for the peers; step time: every variant alternating step by step in one process; "
          "vs O5: step time over O5's)")
    print(table(cost, [("variant", "variant", "{}"), ("bytes/param", "bytes_per_param", "{:.4f}"),
                       ("w/o step counters", "elementwise_bytes_per_param", "{:.3f}"), ("ms/step", "step_ms", "{:.1f}"),
                       ("vs O5", "time_vs_O5", "{:.3f}x"), ("ms/step 1 thread", "step_ms_1t", "{:.1f}"),
                       ("vs O5, 1 thread", "time_vs_O5_1t", "{:.3f}x"), ("first-step compile s", "first_step_s", "{:.2f}"),
                       ("skipped", "skipped", "{}")]))
    if fp8:
        print(f"\n2. fp8 (same LM, AdamW lr 1e-3, {fp8_steps} steps; loss = mean of the last 10; {wall['fp8']:.0f} s)")
        print(table(fp8, [("variant", "variant", "{}"), ("loss", "loss", "{:.4f}"), ("last", "last_loss", "{:.4f}"),
                          ("vs O5", "vs_O5_loss", "{:+.4f}"), ("fp8 layers", "fp8_layers", "{}"), ("emulated", "emulated", "{}"),
                          ("ms/step", "step_ms", "{:.1f}"), ("bytes/param", "bytes_per_param", "{:.2f}"), ("skipped", "skipped", "{}")]))
    print("\nTargets" + (" (--quick: not valid)" if quick else ""))
    print(table(goals, [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")]))


def parse(argv):
    p = argparse.ArgumentParser(description="ampkit's bf16 levels and peer optimizers against O5; O6 (fp8)")
    p.add_argument("--quick", action="store_true", help="tiny LM, few steps, 2 seeds, the first lr: checks that it runs")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, each fixing init, batches and rounding")
    p.add_argument("--lrs", default=",".join(map(str, LRS)), help="learning rates, comma-separated")
    p.add_argument("--only", help="comma-separated prefixes of the variants to run (O5 always runs), e.g. O7,torchao")
    p.add_argument("--no-peers", action="store_true", help="ampkit's variants only")
    p.add_argument("--train-batches", type=int, help="training batches, cycled (default: one per step, none "
                   "repeated; 8 is the earlier frontier figures' setting, in which the LM memorises them)")
    p.add_argument("--fp8-steps", type=int, default=60, help="0 skips the fp8 part")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--d-model", type=int, help="the LM's width (default: that of the LM --size picks)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one less per busy core by the load average)")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help=f"auto: the small LM ({EMULATED_LM.d_model} wide, batch {EMULATED_LM.batch}x{EMULATED_LM.seq_len}) where "
                        f"ampkit.capabilities() calls bfloat16 emulated here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    device = torch.device(args.device)
    threads = args.threads or default_threads()
    small = args.size == "small" or (args.size == "auto" and emulated(("O5",), device))
    spec = QUICK_LM if args.quick else EMULATED_LM if small else LM
    spec = dataclasses.replace(spec, d_model=args.d_model) if args.d_model else spec
    steps, fp8_steps, seeds = (25, 10, 2) if args.quick else (args.steps, args.fp8_steps, args.seeds)
    lrs = [float(x) for x in args.lrs.split(",")][:1 if args.quick else None]
    names, notes = variants(args.only and args.only.split(","), not args.no_peers)
    torch.set_num_threads(threads)
    info = machine(device)
    print(f"ampkit {ampkit.__version__} frontier{' --quick' if args.quick else ''}: {info}", flush=True)
    for note in notes:
        print(f"  {note}", flush=True)
    started, wall = time.perf_counter(), {}
    log = Log("bf16")
    train = args.train_batches or steps
    bf16, cost, done = bench_bf16(spec, names, lrs, steps, seeds, threads, device, train, log)
    wall["bf16"] = time.perf_counter() - log.start
    log = Log("fp8")
    fp8 = bench_fp8(spec, fp8_steps, threads, device, args.train_batches or fp8_steps, log) if fp8_steps > 0 else []
    wall["fp8"] = time.perf_counter() - log.start
    goals = targets(bf16, cost, fp8)
    print_report(spec, steps, seeds, train, bf16, cost, fp8, goals, wall, fp8_steps, args.quick)
    seconds = time.perf_counter() - started
    print(f"\n{seconds:.0f} s; load average (1 min) {info['load_average']:.2f} at the start, {os.getloadavg()[0]:.2f} "
          f"at the end, on {info['cores']} cores (more than the core count: other work shared the CPUs).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average_end": os.getloadavg()[0], "argv": sys.argv, "quick": args.quick,
                       "seconds": seconds, "wall_s": wall, "sizes": "quick" if args.quick else "small" if small else "full",
                       "lm": vars(spec), "steps": steps, "seeds": seeds, "train_batches": train, "lrs": lrs,
                       "skipped": notes, "fp8_steps": fp8_steps, "bf16": bf16, "costs": cost, "runs": done, "fp8": fp8,
                       "targets": goals}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
