"""The kernel cache fails safe: a library that does not match the size and sha256 recorded
when it was built is rebuilt with one warning (a truncated one would kill the process with
SIGBUS), and a cache another user could have written is not loaded from: the kernels are
built in a private folder instead, with one warning saying why."""
import logging
import os
import shutil
import subprocess
import sys

import pytest

from ampkit._kernels import native

# Loads the kernels from $AMPKIT_CACHE_DIR and runs one: prints 1 (an inf is there).
PROBE = """
import ctypes, torch
from ampkit._kernels import native
x = torch.tensor([1.0, float("inf")])
lib = native.library()
print(lib.any_nonfinite(native.ptr(x), ctypes.c_int64(2), 4, ctypes.c_uint32(0x7F800000), native.threads(2)))
"""


@pytest.fixture(scope="module")
def built(lib, tmp_path_factory):
    """The library built once in a folder of its own: its path (its record beside it)."""
    return native.build.build(native.compiler(), str(tmp_path_factory.mktemp("kernels")))


@pytest.fixture
def cached(built, tmp_path, monkeypatch):
    """A fresh cache under ``tmp_path`` holding a copy of the built library; its path there."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {})
    folder = native.build.cache_folder()
    for name in (built, built + ".json"):
        shutil.copy(name, folder)
    return os.path.join(folder, os.path.basename(built))


def warnings_in(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "ampkit"]


def test_a_build_records_its_size_and_hash_in_a_private_folder(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    path = native.build.build(native.compiler())
    assert native.build.damage(path) is None
    assert [os.stat(p).st_mode & 0o077 for p in (tmp_path / "cache", os.path.dirname(path))] == [0, 0]
    assert os.stat(path).st_mode & 0o022 == 0


@pytest.mark.slow
def test_a_truncated_library_is_rebuilt_with_one_warning_not_a_crash(cached):
    size = os.path.getsize(cached)
    os.truncate(cached, size // 2)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, AMPKIT_CACHE_DIR=os.environ["AMPKIT_CACHE_DIR"]))
    assert proc.returncode == 0 and proc.stdout.split() == ["1"], proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ampkit:")]
    assert len(lines) == 1 and cached in lines[0] and "cut short" in lines[0], proc.stderr
    assert os.path.getsize(cached) == size and native.build.damage(cached) is None


def test_a_library_with_another_hash_is_rebuilt_with_one_warning(cached, caplog):
    with open(cached, "r+b") as f:  # the same size, one byte changed
        f.seek(os.path.getsize(cached) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert native.build.damage(cached) is not None
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        assert native.library() is not None
    lines = warnings_in(caplog)
    assert len(lines) == 1 and "sha256" in lines[0] and "rebuilding" in lines[0]
    assert native.build.damage(cached) is None


def private_build(caplog) -> tuple:
    """library() with its warnings: (the path it loaded, the warnings)."""
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        lib = native.library()
    assert lib is not None
    return lib._name, warnings_in(caplog)


@pytest.mark.parametrize("where, mode", [("cache", 0o770), ("kernels", 0o707)])
def test_a_cache_folder_writable_by_others_is_not_loaded_from(cached, caplog, where, mode):
    folder = os.environ["AMPKIT_CACHE_DIR"] if where == "cache" else os.path.dirname(cached)
    os.chmod(folder, mode)
    loaded, lines = private_build(caplog)
    assert os.path.dirname(loaded) != os.path.dirname(cached)
    assert len(lines) == 1 and folder in lines[0] and "writable by group or others" in lines[0]
    assert "private folder" in lines[0] and "chmod go-w" in lines[0]


def test_a_library_owned_by_another_user_is_not_loaded(cached, caplog, monkeypatch):
    real = os.stat

    def stat(path, *args, **kwargs):  # the library as another user's: its uid moved by one
        st = real(path, *args, **kwargs)
        fields = tuple(st)
        return os.stat_result(fields[:4] + (st.st_uid + 1,) + fields[5:]) if os.fspath(path) == cached else st

    monkeypatch.setattr(os, "stat", stat)
    loaded, lines = private_build(caplog)
    assert os.path.dirname(loaded) != os.path.dirname(cached)
    assert len(lines) == 1 and cached in lines[0] and "not by this user" in lines[0]


def test_a_library_writable_by_others_is_not_loaded(cached, caplog):
    os.chmod(cached, 0o777)
    loaded, lines = private_build(caplog)
    assert loaded != cached and len(lines) == 1 and cached in lines[0]
