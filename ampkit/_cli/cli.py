"""The ``ampkit`` command: ``ampkit demo``, ``ampkit levels``, ``ampkit env`` and ``ampkit kernels``.

torch is imported only by the commands that need it: ``--help`` and ``--version`` start fast.
"""
import argparse
from typing import List, Optional

from .._version import __version__


def _levels(text: str) -> List[str]:
    from .._config import levels

    chosen = [s.strip() for s in text.split(",") if s.strip()]
    for lvl in chosen:
        try:
            levels.check_opt_level(lvl)
        except ValueError as e:  # "initialize(opt_level='x'): unknown opt level..." without the call
            raise argparse.ArgumentTypeError(f"{lvl!r}: {str(e).split('): ', 1)[1]}") from None
    return chosen or list(levels.OPT_LEVELS)


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _device(text: str) -> str:
    if text == "auto":
        return text
    import torch

    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here; use cpu or auto")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampkit", description="Apex-style mixed precision (O0-O8) on modern PyTorch.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the built-in models at every opt level and print one table")
    demo.add_argument("--levels", type=_levels, default=None, help="comma-separated, e.g. O0,O5 (default: all)")
    demo.add_argument("--steps", type=_steps, default=None,
                      help="training steps per model and level at the full batch (default: 3-30, sized to this "
                           "machine by a quick probe so the demo takes under a minute)")
    demo.add_argument("--model", choices=["all", "lm", "cnn"], default="all",
                      help="lm: tiny transformer LM; cnn: small BatchNorm conv net (default: all)")
    demo.add_argument("--device", type=_device, default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    demo.add_argument("--json", metavar="PATH", help="also write the machine description and the rows as JSON")
    sub.add_parser("levels", help="print the opt-level property table")
    sub.add_parser("env", help="the compiler, OpenMP, CPU, C kernels, cache, measured capabilities and AMPKIT_* switches")
    kernels = sub.add_parser("kernels", help="ampkit kernels --build: the C kernels built ahead of time")
    kernels.add_argument("--build", action="store_true", required=True,
                         help="build them now into the cache ($AMPKIT_CACHE_DIR, default ~/.cache/ampkit; set it to "
                              "build elsewhere), where every later process loads them from")
    sub.add_parser("report", add_help=False,
                   help="which layers of the demo models each opt level would hurt (ampkit report --help)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.command == "report":
        from .report import main_report

        return main_report(rest)
    if rest:
        parser().error(f"unrecognized arguments: {' '.join(rest)}")
    from .._config import levels

    if args.command == "levels":
        print(levels.format_table())
        return 0
    if args.command in ("env", "kernels"):
        from . import env

        return env.main_env() if args.command == "env" else env.main_kernels()
    from . import demo

    models = demo.MODELS if args.model == "all" else (args.model,)
    demo.main(args.levels or list(levels.OPT_LEVELS), args.steps, models, args.device, args.json)
    return 0
