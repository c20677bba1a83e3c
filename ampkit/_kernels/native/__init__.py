"""The fused CPU kernels: C sources (``csrc/``) built on first use (`build`), typed (`lib`), loaded once.

`library` is ``None`` where they cannot be built (the callers then run the eager references, with
the same numbers); `status` says why. Design: ``docs/design/kernels.md``.
"""
import array
import ctypes
import subprocess
import tempfile
from typing import Optional

import torch

from ..._common import switches
from ..._common.logs import logger
from . import build
from .build import cache_dir, compiler
from .lib import declare

__all__ = ["library", "status", "is_compatible", "compiler", "cache_dir", "threads", "ptr", "direct", "split", "address",
           "call_rows", "floats", "MIN_PER_THREAD"]

MIN_PER_THREAD = 1 << 15  # elements: below this a call stays on one thread

_state = {}  # "lib": the library or None (tried); "why": why None; "log": the compiler's errors; "path": the file


def _load(cc: str) -> ctypes.CDLL:
    """The cached kernels, or (with one warning saying why) kernels built in a private folder for this process."""
    try:
        return ctypes.CDLL(build.build(cc))
    except build.Untrusted as e:
        logger.warning("ampkit: not loading cached kernels: %s; building them in a private folder for this process "
                       "(make the cache yours and not writable by others, e.g. chmod go-w, or set AMPKIT_CACHE_DIR "
                       "to such a folder).", e)
    with tempfile.TemporaryDirectory(prefix="ampkit-kernels-") as private:  # 0700; the library stays mapped
        return ctypes.CDLL(build.build(cc, private))


def library() -> Optional[ctypes.CDLL]:
    """The kernels, built on first use; ``None`` (logged once) where they cannot be built, or
    where ``AMPKIT_NATIVE=0`` turns them off."""
    if "lib" in _state:
        return _state["lib"]
    lib, why, log = None, "AMPKIT_NATIVE=0", ""
    if switches.on("AMPKIT_NATIVE"):
        cc = compiler()
        try:
            if cc is None:
                raise FileNotFoundError("no C compiler (cc, gcc, clang or $CC) on the PATH")
            lib, why = declare(_load(cc)), None
        except (OSError, subprocess.SubprocessError) as e:
            log = build.compiler_log(e)
            detail = log.splitlines()[0] if log else ""
            why = f"{e}{': ' + detail if detail else ''}"
            logger.warning("ampkit: fused CPU kernels unavailable (%s); using the eager path (same numbers, slower).",
                           why)
    _state.update(lib=lib, why=why, log=log, path=getattr(lib, "_name", None))
    return lib


def is_compatible() -> bool:
    """Whether the kernels run here (built and loaded); `status` says why not."""
    return library() is not None


def status() -> str:
    """Where the loaded kernels are, or why there are none (with the compiler's error log)."""
    if library() is not None:
        return f"built: {_state['path']}"
    return f"not built: {_state['why']}" + "".join(f"\n  {line}" for line in _state.get("log", "").splitlines())


def threads(n: int) -> int:
    """The threads a kernel call over ``n`` elements runs on: torch's, one when ``n`` is small."""
    return max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD))


def direct(tensors) -> bool:
    """Whether a kernel reads ``tensors`` (None: absent) where they are: on the CPU and contiguous."""
    for t in tensors:  # a loop, not all() over a generator: this runs for every tensor of every step
        if t is not None and not (t.is_cpu and t.is_contiguous()):
            return False
    return True


def split(items: list, fits) -> tuple:
    """``items`` as (those for which ``fits(item)``, the others), each in order."""
    yes, no = [], []
    for item in items:
        (yes if fits(item) else no).append(item)
    return yes, no


def address(t: Optional[torch.Tensor]) -> int:
    """Contiguous ``t``'s address in a kernel's row (0 for None: none)."""
    return 0 if t is None else t.data_ptr()


def call_rows(fn, rows: list, *args):
    """``fn(len(rows), words, *args)``: a kernel's ``_many`` entry over one row of ints a tensor (its
    addresses, then its sizes) in one ctypes call, where a tensor each cost a call of 7-18
    arguments; its result. The words are an ``array.array`` the ctypes array views (filled in C:
    a ctypes array built from the ints cost 140 us for 64 rows of 21, this 18)."""
    words = array.array("Q")
    for row in rows:
        words.extend(row)
    return fn(len(rows), (ctypes.c_uint64 * len(words)).from_buffer(words), *args)


def floats(values: list):
    """``values`` as a ctypes float array (a kernel's per-tensor constants), filled in C from an
    ``array.array`` it views, as `call_rows`' words."""
    data = array.array("f", values)
    return (ctypes.c_float * len(data)).from_buffer(data)


def ptr(t: torch.Tensor, at: int = 0) -> int:
    """The address of element ``at`` of contiguous ``t``, a plain int: the symbol table's
    argtypes convert it (a ctypes object per argument cost about 0.6 us a pointer)."""
    return t.data_ptr() + at * t.element_size() if at else t.data_ptr()
