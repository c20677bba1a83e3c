"""``ampkit env``: what this machine gives ampkit (compiler, OpenMP, CPU, kernels, cache, measured
capabilities, every ``AMPKIT_*`` switch); ``ampkit kernels --build``: the C kernels built ahead of time."""
import platform
from typing import List

import torch

from .._common.cpu import cpu_info
from .._common.switches import SWITCHES, get
from .._hardware import capabilities
from .._kernels import native
from .._kernels.native import build
from .._version import __version__


def _openmp() -> str:
    """Whether the loaded kernels use OpenMP (linked to libgomp), or why that is unknown."""
    lib = native.library()
    if lib is None:
        return "unknown (no kernels)"
    with open(lib._name, "rb") as f:
        return "yes (libgomp.so.1, torch's pool)" if b"libgomp.so.1" in f.read() else "no (kernels on one thread)"


def report() -> List[str]:
    """The lines of ``ampkit env``."""
    cc = build.compiler()
    name, flags = cpu_info()
    lines = [f"ampkit {__version__}, torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}",
             f"compiler: {cc} ({build.compiler_version(cc)})" if cc else "compiler: none (cc, gcc, clang or $CC)",
             f"OpenMP: {_openmp()}",
             f"CPU: {name or 'unknown'}; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}; "
             f"flags: {' '.join(sorted(flags)) or 'unknown'}",
             f"kernels: {native.status()}",
             f"cache: {build.cache_dir()}",
             f"capabilities: {capabilities().line()}",
             "switches:"]
    lines += [f"  {s.name}={get(s.name)!r} (default {s.default!r}): {s.meaning}" for s in SWITCHES]
    return lines


def main_env() -> int:
    print("\n".join(report()))
    return 0


def main_kernels() -> int:
    """Build (or find built) the kernels in the cache, where every later process loads them from, and
    say where and what; 1 where they cannot be built (with the compiler's errors)."""
    lib = native.library()
    print(f"kernels: {native.status()}")
    if lib is None:
        return 1
    print(f"sources: {', '.join(p.name for p in build.sources())} in {build.CSRC}\n"
          f"functions: {', '.join(native.lib.SYMBOLS)}\nOpenMP: {_openmp()}")
    return 0
