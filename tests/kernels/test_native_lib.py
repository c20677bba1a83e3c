"""The symbol table (``ampkit/_kernels/native/lib.py``) is the sources' exported functions, typed
as their C definitions are, and ctypes holds every call to it."""
import ctypes
import re
import subprocess

import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.native import build
from ampkit._kernels.native.lib import CONSTS, COUNTS, DATA, ROWS, SYMBOLS

# A definition at the start of a line: its result, name and parameters (static ones are the sources' own).
DEFINITION = re.compile(r"^(?!static\b)(void|int|int64_t)\s+(\w+)\(([^)]*)\)\s*\{", re.M)
CTYPES = {"int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64, "uint32_t": ctypes.c_uint32, "int": ctypes.c_int,
          "float": ctypes.c_float}
# pointers to ctypes objects; others: tensors
TYPED = {"c": CONSTS, "consts": CONSTS, "rows": ROWS, "bad": COUNTS, "nfound": COUNTS, "done": COUNTS}


def definitions() -> dict:
    out = {}
    for path in build.sources():
        for result, name, params in DEFINITION.findall(path.read_text()):
            out[name] = (result, [" ".join(p.split()) for p in params.split(",")])
    return out


def ctype(param: str):
    """The ctypes type the table should give C parameter ``param`` (say ``const float *c``)."""
    kind, _, name = param.replace("const ", "").rpartition(" ")
    if name.startswith("*"):
        return TYPED.get(name[1:], DATA)
    return TYPED.get(name, DATA) if kind.endswith("*") else CTYPES[kind]


def test_the_table_is_the_sources_exported_functions():
    assert set(SYMBOLS) == set(definitions())


@pytest.mark.parametrize("name", sorted(SYMBOLS))
def test_each_entry_has_its_definitions_types(name):
    result, params = definitions()[name]
    want_result, arguments = SYMBOLS[name]
    assert want_result == {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64}[result]
    assert list(arguments) == [ctype(p) for p in params], params


def test_a_wrong_argument_is_a_ctypes_error_not_a_call(lib):
    x, out = torch.ones(4), torch.empty(4, dtype=torch.bfloat16)
    with pytest.raises(ctypes.ArgumentError):  # a tensor where its address goes
        lib.round_bf16(x, native.ptr(out), 4, 0, 1, 0, 1)
    with pytest.raises(ctypes.ArgumentError):  # an int64 array where the float constants go
        lib.adamw_master_many(1, (ctypes.c_uint64 * 7)(*(native.ptr(x) for _ in range(4)), 0, 4, 1), (ctypes.c_int64 * 10)())
    with pytest.raises(TypeError, match="takes at least 5 arguments"):  # too few
        lib.any_nonfinite(native.ptr(x), 4, 4)
    assert lib.any_nonfinite(native.ptr(x), 4, 4, 0x7F800000, 1) == 0  # plain ints convert


def test_every_source_compiles_without_a_warning(tmp_path):
    """-Wall -Wextra -Werror on each C file, with the library's flags."""
    cc = build.compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang or $CC) on the PATH")
    flags = [f for f in build.FLAGS if f != "-shared"] + [build.OPENMP, "-Wall", "-Wextra", "-Werror", "-c"]
    for path in build.sources():
        proc = subprocess.run([cc, *flags, str(path), "-o", str(tmp_path / f"{path.stem}.o")], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"{path.name}:\n{proc.stderr}"
