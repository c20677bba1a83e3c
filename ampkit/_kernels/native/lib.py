"""The symbol table: every function the C kernels export, with its argument and result types.

ctypes checks each call against it, so a wrong argument is a ``ctypes.ArgumentError``, not a crash.
"""
import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_uint32, c_uint64, c_void_p

__all__ = ["SYMBOLS", "declare"]

DATA = c_void_p  # a tensor's elements (`native.ptr`); NULL (None) where the kernel allows it
CONSTS = POINTER(c_float)  # the step constants, ``(c_float * k)(*hyper.consts())`` of the op's Hyper
ROWS = POINTER(c_uint64)  # a `_many` entry's rows: each tensor's addresses and ints, ``(c_uint64 * k)(*words)``
COUNTS = POINTER(c_int64)  # int64 results: ``ctypes.byref(c_int64())`` or ``(c_int64 * k)()``

SYMBOLS = {  # name: (result, arguments), in the order of the C definitions (csrc/*.c)
    "round_bf16": (None, (DATA, DATA, c_int64, c_int64, c_uint64, c_int, c_int)),
    "round_bf16_paired": (None, (DATA, DATA, c_int64, c_int64, c_uint64, c_int)),
    "adamw_bf16_many": (None, (c_int64, ROWS, CONSTS)),
    "adamw_8bit_many": (c_int64, (c_int64, ROWS, CONSTS)),
    "adamw_master_many": (None, (c_int64, ROWS, CONSTS)),
    "adamw_remainder": (None, (DATA, DATA, DATA, DATA, DATA, c_int64, c_int64, DATA, c_int64, DATA, c_int64, COUNTS,
                               COUNTS, CONSTS, c_int)),
    "adamw_remainder_many": (None, (c_int64, ROWS, CONSTS, DATA, COUNTS, COUNTS)),
    "sgd_master_many": (None, (c_int64, ROWS, c_int, CONSTS)),
    "sgd_bf16_many": (None, (c_int64, ROWS, c_int, CONSTS)),
    "sgd_8bit_many": (c_int64, (c_int64, ROWS, c_int, CONSTS)),
    "sgd_remainder": (None, (DATA, DATA, DATA, DATA, c_int64, c_int64, DATA, c_int64, DATA, c_int64, COUNTS, COUNTS, c_int,
                             c_int, CONSTS, c_int)),
    "sgd_remainder_many": (None, (c_int64, ROWS, c_int, CONSTS, DATA, COUNTS, COUNTS)),
    "any_nonfinite": (c_int, (DATA, c_int64, c_int, c_uint32, c_int)),
    "widen_scaled": (c_int, (DATA, DATA, c_int64, c_int, c_float, c_int)),
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every function of `SYMBOLS` typed (an AttributeError names a missing one)."""
    for name, (result, arguments) in SYMBOLS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = result, list(arguments)
    return lib
