"""This machine's CPU as ``/proc/cpuinfo`` names it: what ``capabilities()`` judges and what the
C kernels' build cache is keyed by."""
import platform
from typing import Tuple

__all__ = ["cpu_info"]


def cpu_info() -> Tuple[str, frozenset]:
    """(CPU model name, flags) from ``/proc/cpuinfo``; the platform's name and no flags elsewhere."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return name, frozenset()
    for line in first.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "cpu model") and value.strip():
            name = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    return name, frozenset(flags)
