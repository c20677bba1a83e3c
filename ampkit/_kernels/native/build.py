"""Builds the C sources of ``ampkit/_kernels/csrc`` into one library, cached per source, flags, compiler and CPU.

Where the cache is, how a library is checked before it is loaded, and why the flags cannot change
a result: ``docs/design/kernels.md``.
"""
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional

from ..._common import switches
from ..._common.cpu import cpu_info
from ..._common.files import fsync_dir
from ..._common.logs import logger

CSRC = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c99"]
OPENMP = "-fopenmp"


def sources() -> List[Path]:
    """The C files compiled into the library (one translation unit each)."""
    return sorted(CSRC.glob("*.c"))


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def compiler_version(cc: str) -> str:
    """The first line of ``cc --version``, or why there is none."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def cache_dir() -> str:
    return switches.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")


class Untrusted(Exception):
    """A cached library, or its folder, that another user could have written."""


def check_owner(path: str) -> None:
    """Raise `Untrusted` unless ``path`` is this user's and not writable by group or others."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise Untrusted(f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})")


def cache_folder() -> str:
    """``$AMPKIT_CACHE_DIR/kernels``, made private (0700) where new; `Untrusted` if it, or the cache, is not."""
    folder = os.path.join(cache_dir(), "kernels")
    for path in (cache_dir(), folder):
        os.makedirs(path, mode=0o700, exist_ok=True)
        check_owner(path)
    return folder


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def damage(path: str) -> Optional[str]:
    """What is wrong with the library at ``path`` against the size and sha256 recorded beside it, or ``None``."""
    try:
        with open(path + ".json") as f:
            record = json.load(f)
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "has no readable record of its size and hash"
    if os.path.getsize(path) != size:
        return f"is {os.path.getsize(path)} bytes, not the {size} it had when built (cut short?)"
    return None if _sha256(path) == digest else "does not match the sha256 recorded when it was built"


def _publish(built: str, path: str) -> None:
    """Move the library ``built`` to ``path`` durably (fsync, then an atomic rename), its record first."""
    with open(built, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())
    with open(built + ".json", "w") as f:
        json.dump({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(built + ".json", path + ".json")
    os.replace(built, path)  # atomic: a concurrent build writes the same bytes
    fsync_dir(os.path.dirname(path))


def key(cc: str, flags: list) -> str:
    """The cache key: the sources' and headers' bytes, the flags, the compiler, the machine and the CPU's flags."""
    h = hashlib.sha256()
    for f in sorted(CSRC.glob("*.[ch]")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update("\0".join([" ".join(flags), cc, platform.machine(), " ".join(sorted(cpu_info()[1]))]).encode())
    return h.hexdigest()[:16]


def _build(cc: str, flags: list, folder: str) -> str:
    """The library's path in ``folder``: the copy there if it is this user's and matches its
    record, else compiled again (a damaged copy: with one warning)."""
    path = os.path.join(folder, f"ampkit_kernels_{key(cc, flags)}.so")
    if os.path.exists(path):
        check_owner(path)
        problem = damage(path)
        if problem is None:
            return path
        logger.warning("ampkit: the cached kernel library %s %s; rebuilding it (delete that folder if this repeats).",
                       path, problem)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = os.path.join(tmp, "kernels.so")
        subprocess.run([cc, *flags, *map(str, sources()), "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
        _publish(out, path)
    return path


def build(cc: str, folder: Optional[str] = None) -> str:
    """The library built (or found built) with OpenMP, else (logged) without: kernels on one
    thread. ``folder``: the cache's by default."""
    folder = folder or cache_folder()
    try:
        return _build(cc, FLAGS + [OPENMP], folder)
    except subprocess.CalledProcessError as e:
        logger.info("ampkit: %s %s failed (%s); the fused CPU kernels run on one thread.", cc, OPENMP,
                    first_line(e))
        return _build(cc, FLAGS, folder)


def compiler_log(e: Exception) -> str:
    """The compiler's error output of a failed build (its stderr, decoded), else ``""``."""
    return (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip()


def first_line(e: Exception) -> str:
    """The compiler's first error line of a failed build, else the exception."""
    log = compiler_log(e)
    return log.splitlines()[0] if log else str(e)
