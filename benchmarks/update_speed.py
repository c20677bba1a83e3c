"""Step time of the masterless levels against O5, alternating step by step in one process.

    python benchmarks/update_speed.py [--steps N] [--threads N] [--size auto|full|small] [--tiny-batch] [--json PATH]

AdamW on the demo LM (``ampkit._cli.demo.DEMO_LM``; where ``ampkit.capabilities()`` calls
bfloat16 emulated, ``--size auto`` takes frontier.py's ``EMULATED_LM``: its matmuls are
small, so the optimizer step is a larger share of the step than on hardware with bf16).
Variants: O5, remainder masters (O5 with ``master_weights="remainder"``), O7, O7 with bf16
optimizer state, and O8 where ``ampkit._config.levels.OPT_LEVELS`` has it. Each step runs every
variant in turn (order reversed on odd steps), timing the whole step and the update alone
(from the end of ``backward()``: leaving ``scale_loss``, where O5 moves the gradients, and
``opt.step()``); medians after 5 warm-up steps. The bound: bytes each variant's update moves
per parameter at least (:data:`BYTES`) over the measured bandwidth of a large float32 copy.
Ratios vs O5 are of medians and of the least times ("least": on a shared machine the least
disturbed step, closest to each variant's own cost).
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
from ampkit._cli.demo import DEMO_LM, machine
from ampkit._cli.demo_models import TinyLM, lm_batches, lm_loss
from frontier import EMULATED_LM  # benchmarks/frontier.py
from common import default_threads, emulated, stream_gbps, table  # benchmarks/common.py

VARIANTS = {  # name: (level, overrides)
    "O5": ("O5", {}),
    "remainder": ("O5", {"master_weights": "remainder"}),
    "O7": ("O7", {}),
    "O7 bf16 state": ("O7", {"optimizer_state_dtype": torch.bfloat16}),
    "O8": ("O8", {}),
}
TARGETS = {"remainder": 1.00, "O7": 0.98, "O7 bf16 state": 1.00, "O8": 1.05}  # the update issue's (step vs O5)
# Fewest bytes per parameter one AdamW step moves (read + written), each tensor touched once:
# O5: bf16 grad in, fp32 master and two fp32 moments read and written, bf16 weight out.
# remainder: bf16 weight, int16 remainder, bf16 grad in; weight and remainder out; fp32 moments.
# O7: bf16 weight and grad in, bf16 weight out, fp32 moments; bf16 state: bf16 moments.
# O8: 8-bit moments (a float32 scale per 256 elements neglected).
BYTES = {"O5": 2 + 8 + 16 + 2, "remainder": 6 + 4 + 16, "O7": 4 + 2 + 16, "O7 bf16 state": 4 + 2 + 8, "O8": 4 + 2 + 4}


def variants():
    return [v for v, (level, _) in VARIANTS.items() if level in ampkit._config.levels.OPT_LEVELS]


def timing(spec, names, steps, threads):
    """The ``names`` alternating step by step: median and least ms of the whole step and of the update."""
    torch.set_num_threads(threads)
    batches = lm_batches(spec, 8)
    loops = {}
    for name in names:
        level, overrides = VARIANTS[name]
        torch.manual_seed(0)
        model = TinyLM(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
        loops[name] = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    whole, update = {n: [] for n in names}, {n: [] for n in names}
    for i in range(steps + 5):
        x, y = batches[i % len(batches)]
        for name, (model, opt) in (list(loops.items()) if i % 2 == 0 else list(loops.items())[::-1]):
            start = time.perf_counter()
            opt.zero_grad()
            loss = lm_loss(model(x), y)
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
                mid = time.perf_counter()  # the update: gradient checks and moves on leaving the block, the step
            opt.step()
            end = time.perf_counter()
            if i >= 5:
                whole[name].append(end - start)
                update[name].append(end - mid)
    params = sum(p.numel() for p in loops[names[0]][0].parameters())
    return params, {n: (1e3 * median(whole[n]), 1e3 * median(update[n]), 1e3 * min(whole[n]), 1e3 * min(update[n])) for n in names}


def rows_of(params, ms, gbps):
    o5 = ms["O5"]
    rows = []
    for name, (step, update, step_min, update_min) in ms.items():
        rows.append({"variant": name, "step_ms": step, "update_ms": update, "step_vs_O5": step / o5[0],
                     "update_vs_O5": update / o5[1], "step_min_vs_O5": step_min / o5[2], "update_min_vs_O5": update_min / o5[3],
                     "target": TARGETS.get(name), "bytes_per_param": BYTES[name],
                     "floor_ms": 1e3 * BYTES[name] * params / (gbps * 1e9), "floor_vs_O5": BYTES[name] / BYTES["O5"],
                     "met": None if name not in TARGETS else step / o5[0] <= TARGETS[name]})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="step time of O7, remainder masters (and O8) against O5")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=None, help="default: torch's, one less per busy core")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto")
    p.add_argument("--tiny-batch", action="store_true",
                   help="batch 1 of 8 tokens: the update at the LM's parameter count without the matmuls' cost")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    small = args.size == "small" or (args.size == "auto" and emulated(("O5",), torch.device("cpu")))
    spec = EMULATED_LM if small else DEMO_LM
    if args.tiny_batch:
        spec = dataclasses.replace(spec, batch=1, seq_len=8)
    info = machine(torch.device("cpu"))
    gbps = stream_gbps(torch.device("cpu"))
    params, ms = timing(spec, variants(), args.steps, threads)
    rows = rows_of(params, ms, gbps)
    print(f"ampkit update speed: {info}")
    print(f"LM {vars(spec)} ({'EMULATED_LM: bf16 emulated here' if small else 'DEMO_LM'}{', tiny batch' if args.tiny_batch else ''}), {params} parameters, "
          f"AdamW, {args.steps} steps alternating, {threads} threads; copy bandwidth {gbps:.1f} GB/s")
    print(table(rows, [("variant", "variant", "{}"), ("ms/step", "step_ms", "{:.2f}"), ("step vs O5", "step_vs_O5", "{:.3f}x"),
                       ("least", "step_min_vs_O5", "{:.3f}x"), ("update ms", "update_ms", "{:.2f}"),
                       ("update vs O5", "update_vs_O5", "{:.3f}x"), ("least", "update_min_vs_O5", "{:.3f}x"),
                       ("target", "target", "<= {:.2f}x"), ("met", "met", "{}"), ("bytes/param", "bytes_per_param", "{}"),
                       ("floor ms", "floor_ms", "{:.3f}"), ("floor vs O5", "floor_vs_O5", "{:.2f}x")]))
    print(f"load average (1 min) {info['load_average']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, on {info['cores']} cores")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average_end": os.getloadavg()[0], "argv": sys.argv, "threads": threads,
                       "lm": vars(spec), "sizes": "small" if small else "full", "tiny_batch": args.tiny_batch, "params": params, "copy_gbps": gbps,
                       "steps": args.steps, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
