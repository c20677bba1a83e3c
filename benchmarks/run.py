"""ampkit benchmarks: seven families measured side by side in one run, tables to stdout, JSON to a file.

    python benchmarks/run.py [--quick] [--json PATH] [--only overhead,speedup,unscale,memory,scaling,compile,update]
                             [--compile-levels native|all|O0,O5] [--device cpu|cuda] [--threads N] [--size auto|full|small]

1. overhead: ampkit O1/O4 vs a hand-written torch.autocast + torch.amp.GradScaler loop, and
   O2/O5 vs a hand-written half model + fp32 master loop; per level one fresh process in
   which the two variants alternate step by step, 3 repeats of 60 steps. The ratio is the median
   of the per-step ratios (each ampkit step over the hand-written step next to it, so a load that
   comes and goes hits both). Target: ratio <= 1.02.
2. speedup: steps/s of O0, O4, O5 on the transformer (d_model 512) and the CNN, each
   repeat of each level in a fresh process, levels interleaved. Target: O5 >= 2.5x O0 (LM).
3. unscale: ampkit's unscale + overflow check over >= 50M gradient elements (fp32 grads,
   and half grads into fp32 masters) vs a torch copy of the same bytes (and, for half grads,
   vs the bare half -> fp32 conversion copy), and host syncs per
   step counted at the dispatcher. Targets: >= 0.5 of copy bandwidth; exactly 1 sync.
4. memory: peak RSS per level on the transformer with an activation-heavy batch, one fresh
   process per level. Target: O3 and O5 <= 0.6x O0.
5. scaling: step time and peak memory of O0 and O5 at x1, x4, x16 parameters.
6. compile: per level, eager ampkit vs compiled ampkit (the README pattern: compiled model,
   eager scale_loss, compiled optimizer step) vs the hand-written loop compiled the same way,
   AdamW, one fresh process per level, the three alternating step by step; then eager vs
   compiled at O0/O5 on the speed-up family's transformer (where O5 is among the levels). O6/O7 have no hand-written loop, and
   at O7 only the model is compiled (the README's pattern there). Targets: compiled ampkit <= 1.02x
   compiled hand-written; O5 compiled >= 1.3x O5 eager (transformer, native-bf16 CPU). On a
   CPU each row also profiles 3 eager and 3 compiled steps, alternating (self CPU time in matmul
   kernels and in all other ops): the matmuls' share s of the eager step bounds what compiling,
   which leaves the matmuls to the same oneDNN kernels, can gain: at most 1/s. A tighter bound
   adds the optimizer's memory floor: AdamW must read and write every weight (or master) and
   its two fp32 state tensors, read every gradient, and at O2/O5 write the model's half copy
   (28 bytes per parameter at O0 and O5), which takes at least those bytes over the bandwidth
   of a large same-dtype copy measured in the same process.
7. update: the AdamW update alone per level (O5, remainder, O7 and O7 bf16 state fused and
   through the optimizer's own step, O8, torch's fused fp32 AdamW) against the time its
   fewest bytes take at the measured copy bandwidth. Target: each level <= 1.5x its bound.

Each family is a module of ``benchmarks/families/`` (its measurement, its report lines and its
targets); the shared helpers are ``benchmarks/common.py`` and the timed training loops
``benchmarks/loops.py``; this script parses the options and dispatches.
Every family prints progress lines to stderr as it goes (per level, worker and repeat, with the
seconds since the family started) and its wall time in its table and the JSON (``wall_s``).
``--size auto`` (the default) uses the EMULATED shapes for a family whose half dtype
``ampkit.capabilities()`` calls emulated on this CPU (on AVX2 a bf16 or fp16 matmul runs about 60x
slower than fp32, and the full shapes took an hour per family); ``full`` and ``small`` force one.
``--threads`` defaults to torch's threads less one per busy core (1-minute load average): on a
shared machine a second thread waits for its descheduled partner in every op.
``--quick`` shrinks sizes and repeats to check that everything runs (well under a minute); its
figures are not valid for the targets. Nothing here runs in the unit tests.
``benchmarks/plot.py`` draws speed-up and memory per level from the JSON.
"""

import argparse
import importlib
import time

import torch

import ampkit
from ampkit.apps.demo import machine

from common import FULL, QUICK, Log, default_threads, finish, table

FAMILIES = ("overhead", "speedup", "unscale", "memory", "scaling", "compile", "update")


def family(name: str):
    """The module of family ``name``: ``run(cfg, device, args, log)``, ``report(result)``, ``targets(result)``."""
    return importlib.import_module(f"families.{name}")


def report(results, quick):
    out = [line for name, r in results.items() for line in family(name).report(r)]
    out += ["\nWall time per family (sizes: full, or small where the family's half dtype is emulated here)",
            table([{"family": f, **r} for f, r in results.items()],
                  [("family", "family", "{}"), ("sizes", "sizes", "{}"), ("seconds", "wall_s", "{:.0f}")])]
    targets = check_targets(results)
    if targets:
        out += ["\nTargets" + (" (--quick: sizes too small, not valid for the targets)" if quick else ""),
                table(targets, [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")])]
    return "\n".join(out)


def check_targets(results):
    return [t for name, r in results.items() for t in family(name).targets(r)]


def main(argv=None):
    p = argparse.ArgumentParser(description="ampkit benchmarks (see docs/benchmarks/)")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run, not valid for the targets")
    p.add_argument("--json", metavar="PATH", help="write machine, config and results as JSON")
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one less per busy core by the load average)")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help="auto (the default): the small shapes for a family whose half dtype ampkit.capabilities() "
                        "calls emulated here, full elsewhere; full or small: those shapes everywhere")
    p.add_argument("--compile-levels", default="native",
                   help="levels of the compile family: native (O0 and those ampkit.capabilities() calls fast here; "
                        "the default), all, or a comma-separated list")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = set(only) - set(FAMILIES)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {','.join(FAMILIES)}")
    args.threads = args.threads or default_threads()
    torch.set_num_threads(args.threads)
    cfg, device = (QUICK if args.quick else FULL), torch.device(args.device)
    info = machine(device)
    print(f"ampkit {ampkit.__version__} benchmarks{' --quick' if args.quick else ''}: {info}", flush=True)
    results, started = {}, time.perf_counter()
    for name in (f for f in FAMILIES if f in only):
        log = Log(name)
        log(f"start ({args.threads} threads)")
        results[name] = family(name).run(cfg, device, args, log)
        results[name]["wall_s"] = time.perf_counter() - log.start
        results[name].setdefault("sizes", "quick" if args.quick else "full")
        log(f"done in {results[name]['wall_s']:.0f} s")
    finish(report(results, args.quick), info, args, started, results, check_targets(results))


if __name__ == "__main__":
    main()
