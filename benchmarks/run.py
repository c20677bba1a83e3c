"""ampkit benchmarks: nine families measured side by side in one run, tables to stdout, JSON to a file.

    python benchmarks/run.py [--quick] [--json PATH]
                             [--only overhead,speedup,unscale,memory,scaling,compile,update,o7_compile,sgd_step]
                             [--compile-levels native|all|O0,O5] [--device cpu|cuda] [--threads N] [--size auto|full|small]
    python benchmarks/run.py --only convergence [--quick] [--json PATH] [--fashion-mnist DIR] [--text DIR] [--jobs N]

The families, in order: overhead, speedup, unscale, memory, scaling, compile, update, o7_compile, sgd_step;
each one's docstring (``benchmarks/families/<name>.py``) says what it measures, how, and its targets.
A tenth, convergence (every level and peer trained on Fashion-MNIST and real text over seeds, against
O0; about 45 minutes on 2 cores, on data a Debian package installs), runs only when ``--only`` names it.

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
from ampkit._cli.demo import machine

from common import FULL, QUICK, Log, default_threads, finish, table

FAMILIES = ("overhead", "speedup", "unscale", "memory", "scaling", "compile", "update", "o7_compile", "sgd_step",
            "convergence")
DEFAULT = FAMILIES[:-1]  # convergence: only when named


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
    p.add_argument("--only", default=",".join(DEFAULT), help=f"comma-separated subset of {','.join(FAMILIES)} "
                   f"(default: all but convergence)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one less per busy core by the load average)")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help="auto (the default): the small shapes for a family whose half dtype ampkit.capabilities() "
                        "calls emulated here, full elsewhere; full or small: those shapes everywhere")
    p.add_argument("--compile-levels", default="native",
                   help="levels of the compile family: native (O0 and those ampkit.capabilities() calls fast here; "
                        "the default), all, or a comma-separated list")
    p.add_argument("--fashion-mnist", metavar="DIR", help="convergence: the folder of Fashion-MNIST's four IDX .gz files "
                   "(default: where apt-get install dataset-fashion-mnist puts them)")
    p.add_argument("--jobs", type=int, default=1, help="convergence: tasks trained at once, each in its own process")
    p.add_argument("--text", metavar="DIR", help="convergence: a folder of plain text files (default: where apt-get "
                   "install fortunes puts them)")
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
