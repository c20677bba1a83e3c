"""Fused CPU kernels in C, built on first use with the system's C compiler and cached.

One pass per chunk for O7's and O8's AdamW updates: read the gradient, the weight and the
optimizer state once, write the weight and the state once, with the stochastic rounding's
counter bits (``core/counter_bits.py``) computed inside. The source is plain C (no torch
headers, so the build takes about a second, not the minute of a
``torch.utils.cpp_extension`` build); it is compiled with ``-ffp-contract=off`` and without
fast-math, so every float operation is one IEEE-rounded operation, exactly as in the eager
torch reference (``-fno-trapping-math`` only lets the compiler ignore floating-point
exception flags, so that it vectorizes selects on float comparisons), and the results are
bit for bit the eager path's whatever SIMD width the compiler picks. The library is cached
under ``$AMPKIT_CACHE_DIR`` (default ``~/.cache/ampkit``), keyed by the source, the flags,
the compiler and the CPU's feature flags, written durably beside a record of its size and
sha256, and loaded only if it matches that record (else rebuilt, with one warning) and only
from folders and a file that are this user's and not writable by others (else built in a
private folder for the process, with one warning); where there is no compiler (or the build fails)
one line is logged and `library` returns ``None``: the callers then run the eager
path, with the same numbers. A call runs on ``torch.get_num_threads()`` threads over disjoint
ranges, which cannot change a result (each element is computed on its own): an OpenMP loop
in the kernel, built with ``-fopenmp`` and so linked to ``libgomp.so.1``, which the process
already has loaded as torch's own OpenMP runtime, so the kernel runs on the threads torch's
operators run on (a separate pool would find them spinning on the cores after each operator);
a compiler without OpenMP builds kernels that run on one thread (logged once).
"""
import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import torch

from .._common.cpu import cpu_info
from .._common.files import fsync_dir
from .._common.logs import logger

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-std=c99"]
OPENMP = "-fopenmp"
MIN_PER_THREAD = 1 << 15  # elements: below this a call stays on one thread

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}
static inline uint64_t word(uint64_t key, int64_t i) { return mix64(key + (uint64_t)(i + 1) * GAMMA); }

/* [0, n) cut into `threads` ranges [lo, hi), run on the OpenMP pool: torch's own (the process loads one
   libgomp.so.1; a build without OpenMP runs them in turn). Every element is computed on its own. */
#define EACH_RANGE(n, lo, hi, BODY)                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)")               \
    for (int t_ = 0; t_ < threads; t_++) {                                                              \
        const int64_t lo = (n) * t_ / threads, hi = (n) * (t_ + 1) / threads;                            \
        BODY                                                                                            \
    }
/* The same ranges, OR-ing EXPR (a uint32_t of the range [lo, hi)) into the caller's `any`. */
#define ANY_RANGE(n, lo, hi, EXPR)                                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(| : any)") \
    for (int t_ = 0; t_ < threads; t_++) {                                                              \
        const int64_t lo = (n) * t_ / threads, hi = (n) * (t_ + 1) / threads;                            \
        any |= EXPR;                                                                                    \
    }
static inline float widen(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t narrow(float f, uint64_t d16) {  /* + a uniform 16-bit integer, truncated */
    uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + (uint32_t)d16) >> 16);
}

static void round_bf16_range(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = narrow(src[i], (word(key, first + i) >> shift) & 0xFFFF);
}

void round_bf16(const float *src, uint16_t *dst, int64_t n, int64_t first, uint64_t key, int shift, int threads) {
    EACH_RANGE(n, lo, hi, round_bf16_range(src + lo, dst + lo, hi - lo, first + lo, key, shift);)
}

/* c: decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bias correction 2), eps, step size, sign */
#define ADAMW_BODY(LOAD_M, LOAD_V, STORE_M, STORE_V)                               \
    for (int64_t i = 0; i < n; i++) {                                               \
        float g = widen(grad[i]) * c[9];                                            \
        float p = widen(w[i]);                                                      \
        g = c[1] != 0.0f ? g + p * c[1] : g;  /* as the reference: no inf * 0 */    \
        p = p * c[0];                                                               \
        float m = LOAD_M * c[2] + g * c[3];                                         \
        float v = LOAD_V * c[4] + (g * g) * c[5];                                   \
        float denom = sqrtf(v) / c[6] + c[7];                                       \
        p = p - (m / denom) * c[8];                                                 \
        uint64_t a = word(key0, first + i);  /* quarters: w, m, v (counter_bits) */  \
        w[i] = narrow(p, a & 0xFFFF);                                               \
        STORE_M; STORE_V;                                                           \
    }

static void adamw_fp32_range(uint16_t *w, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c) {
    ADAMW_BODY(ms[i], vs[i], ms[i] = m, vs[i] = v)
}

static void adamw_bf16_range(uint16_t *w, const uint16_t *grad, uint16_t *ms, uint16_t *vs, int64_t n, int64_t first,
                             uint64_t key0, const float *c) {
    ADAMW_BODY(widen(ms[i]), widen(vs[i]), ms[i] = narrow(m, (a >> 16) & 0xFFFF), vs[i] = narrow(v, (a >> 32) & 0xFFFF))
}

void adamw_fp32_state(uint16_t *w, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                      uint64_t key0, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, adamw_fp32_range(w + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo, key0, c);)
}

void adamw_bf16_state(uint16_t *w, const uint16_t *grad, uint16_t *ms, uint16_t *vs, int64_t n, int64_t first,
                      uint64_t key0, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, adamw_bf16_range(w + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo, key0, c);)
}

/* ---- O8: AdamW / Adam on bf16 weights with 8-bit state (core/fused_adamw_8bit.py) ----
   Blocks of 256 on the full parameter's flat index: local element i (global first + i) is in
   local block (first + i) / 256 - first / 256. The arithmetic of ADAMW_BODY on m = int8 code *
   scale and v = (e4m4 code * scale)**2; the new sqrt(v), then m (capped against the stored
   sqrt(v) times cap; cap NaN: none) quantized per block with the counter draws of streams 2
   and 1. The old weight, codes and scales go to the backups bw, bm, bv, bms, bvs (so a step
   that made a weight non-finite can be undone); *bad counts the blocks with a non-finite new weight. */
#define Q8_BLOCK 256
static inline float q8_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t q8_u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float q8_e4m4(uint8_t c) {  /* a uint8 code's value in units of its scale */
    float v = c >= 16 ? q8_f((uint32_t)(c + (112 << 4)) << 19) : (float)c * 0x1p-18f;
    v = c == 254 ? NAN : v;
    return c == 255 ? INFINITY : v;
}
static inline float q8_scale(uint32_t absmax, int shift, float half_top) {  /* least 2**e with absmax <= top 2**e */
    int e;
    float m = frexpf(q8_f(absmax), &e);
    e = e - shift + (m > half_top);
    e = e < -149 ? -149 : (e > 127 ? 127 : e);
    return ldexpf(1.0f, e);
}

static inline uint32_t q8_absmax(const float *x, int k, float top) {  /* of the x in [-top, top], as bits */
    uint32_t most = 0;
    for (int j = 0; j < k; j++) {
        uint32_t u = q8_u(x[j]) & 0x7FFFFFFFu & -(uint32_t)(fabsf(x[j]) <= top);  /* NaN: 0 */
        most = u > most ? u : most;
    }
    return most;
}

/* One block of k elements (loops without branches, so that they vectorize). */
static void adamw_8bit_block(uint16_t *restrict w, const uint16_t *restrict grad, int8_t *restrict mq,
                             float *restrict ms, uint8_t *restrict vq, float *restrict vs, int k, int64_t first,
                             uint64_t key0, uint64_t key1, const float *restrict c, float cap,
                             uint16_t *restrict bw, int8_t *restrict bm, uint8_t *restrict bv, int64_t *restrict bad) {
    float mb[Q8_BLOCK], rb[Q8_BLOCK], lb[Q8_BLOCK], db[Q8_BLOCK];
    const float top = 1.8125f * 0x1p127f, sm = *ms, sv0 = *vs, c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3],
                c4 = c[4], c5 = c[5], c6 = c[6], c7 = c[7], c8 = c[8], c9 = c[9];
    const int l2 = c1 != 0.0f;
    uint32_t nbad = 0;  /* a flag, not a count: 32-bit lanes in the vector loop */
    uint32_t wd[Q8_BLOCK], vd[Q8_BLOCK];
    for (int j = 0; j < k; j++) {  /* the counter draws first: fewer live registers in the step below */
        const uint64_t a = word(key0, first + j);  /* stream 0 (16-bit): bits 0..15, stream 1 (m, 32-bit): 32..55 */
        wd[j] = (uint32_t)(a & 0xFFFF);
        db[j] = (float)(int32_t)((a >> 32) & 0xFFFFFF);
        vd[j] = (uint32_t)(word(key1, first + j) & 0xFFFFFF);  /* stream 2 (v, 32-bit): bits 0..23 */
    }
    for (int j = 0; j < k; j++) {
        int8_t qm = mq[j]; uint8_t qv = vq[j]; uint16_t wj = w[j];
        bw[j] = wj; bm[j] = qm; bv[j] = qv;
        float r0 = q8_e4m4(qv) * sv0;
        float g = widen(grad[j]) * c9;
        float p = widen(wj);
        g = l2 ? g + p * c1 : g;
        p = p * c0;
        float m = (qm == -128 ? NAN : (float)qm * sm) * c2 + g * c3;
        float v = (r0 * r0) * c4 + (g * g) * c5;
        float r = sqrtf(v);
        float denom = r / c6 + c7;
        p = p - (m / denom) * c8;
        nbad |= !isfinite(p);
        w[j] = narrow(p, wd[j]);
        mb[j] = m; rb[j] = r;
    }
    const float sv = q8_scale(q8_absmax(rb, k, top), 1, 0.90625f);
    for (int j = 0; j < k; j++) {
        float r = rb[j];
        int nan = !(r >= 0.0f), inf = r > top;
        float y = (nan | inf) ? 0.0f : r / sv;
        uint32_t u = q8_u(y);
        float lin = y * 0x1p18f, flin = floorf(lin);
        int normal = y >= 0x1p-14f;
        float low = normal ? (float)((int32_t)(u >> 19) - (112 << 4)) : flin;
        float frac = normal ? (float)(u & 0x7FFFF) * 0x1p-19f : lin - flin;
        float d = (float)(int32_t)vd[j];
        uint8_t code = (uint8_t)(int32_t)(low + (float)(d < frac * 0x1p24f));
        code = nan ? 254 : (inf ? 255 : code);
        vq[j] = code;
        float limit = (q8_e4m4(code) * sv) * cap;
        mb[j] = isinf(limit) ? 0.0f : mb[j];  /* exact Adam's update there is 0 */
        lb[j] = limit;
    }
    const float sm1 = q8_scale(q8_absmax(mb, k, INFINITY), 7, 0.9921875f);
    for (int j = 0; j < k; j++) {
        float m = mb[j];
        int fin = isfinite(m);
        float y = fin ? fabsf(m) / sm1 : 0.0f;
        float low = floorf(y), frac = y - low;
        low = low + (float)(db[j] < frac * 0x1p24f);
        float lim = floorf(lb[j] / sm1);
        lim = isnan(lim) ? INFINITY : lim;
        low = lim < low ? lim : low;
        int8_t code = (int8_t)(int32_t)copysignf(low, m);
        mq[j] = fin ? code : (int8_t)-128;
    }
    *ms = sm1; *vs = sv;
    *bad += nbad;
}

static void adamw_8bit_range(uint16_t *w, const uint16_t *grad, int8_t *mq, float *ms, uint8_t *vq, float *vs,
                             int64_t n, int64_t first, uint64_t key0, uint64_t key1, const float *c, float cap,
                             uint16_t *bw, int8_t *bm, uint8_t *bv, float *bms, float *bvs, int64_t *bad) {
    for (int64_t a = 0; a < n;) {
        int64_t blk = (first + a) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t b = ((first + a) / Q8_BLOCK + 1) * Q8_BLOCK - first;
        b = b > n ? n : b;
        bms[blk] = ms[blk]; bvs[blk] = vs[blk];
        adamw_8bit_block(w + a, grad + a, mq + a, ms + blk, vq + a, vs + blk, (int)(b - a), first + a, key0, key1,
                         c, cap, bw + a, bm + a, bv + a, bad);
        a = b;
    }
}

static int64_t q8_cut(int64_t i, int64_t n, int64_t first) {  /* i moved down to a block boundary (0 and n stay) */
    if (i == 0 || i == n) return i;
    int64_t b = (first + i) / Q8_BLOCK * Q8_BLOCK - first;
    return b > 0 ? b : 0;
}

/* Ranges cut at block boundaries, each with its own backups of the old values; *bad: the blocks with a non-finite new weight. */
void adamw_8bit(uint16_t *w, const uint16_t *grad, int8_t *mq, float *ms, uint8_t *vq, float *vs, int64_t n,
                int64_t first, uint64_t key0, uint64_t key1, const float *c, float cap, uint16_t *bw, int8_t *bm,
                uint8_t *bv, float *bms, float *bvs, int64_t *bad, int threads) {
    int64_t total = 0;
    #pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(+ : total)
    for (int t = 0; t < threads; t++) {
        const int64_t lo = q8_cut(n * t / threads, n, first), hi = q8_cut(n * (t + 1) / threads, n, first);
        const int64_t blk = (first + lo) / Q8_BLOCK - first / Q8_BLOCK;
        int64_t count = 0;
        if (hi > lo)
            adamw_8bit_range(w + lo, grad + lo, mq + lo, ms + blk, vq + lo, vs + blk, hi - lo, first + lo, key0, key1, c,
                             cap, bw + lo, bm + lo, bv + lo, bms + blk, bvs + blk, &count);
        total += count;
    }
    *bad = total;
}
"""

_state = {}  # "lib": the loaded library or None (tried)


def cache_dir() -> str:
    return os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")


class _Untrusted(Exception):
    """A cached library, or its folder, that another user could have written."""


def _check_owner(path: str) -> None:
    """Raise `_Untrusted` unless ``path`` is this user's and not writable by group or others."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise _Untrusted(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise _Untrusted(f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})")


def _cache_folder() -> str:
    """``$AMPKIT_CACHE_DIR/kernels``, made private (0700) where new; `_Untrusted` if it, or the cache, is not."""
    folder = os.path.join(cache_dir(), "kernels")
    for path in (cache_dir(), folder):
        os.makedirs(path, mode=0o700, exist_ok=True)
        _check_owner(path)
    return folder


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _damage(path: str) -> Optional[str]:
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


def _build(compiler: str, flags: list, folder: str) -> str:
    """The library's path in ``folder``: the copy there if it is this user's and matches its
    record, else compiled again (a damaged copy: with one warning)."""
    tag = hashlib.sha256("\0".join([SOURCE, " ".join(flags), compiler, platform.machine(), " ".join(sorted(cpu_info()[1]))]).encode()).hexdigest()[:16]
    path = os.path.join(folder, f"ampkit_kernels_{tag}.so")
    if os.path.exists(path):
        _check_owner(path)
        damage = _damage(path)
        if damage is None:
            return path
        logger.warning("ampkit: the cached kernel library %s %s; rebuilding it (delete that folder if this repeats).",
                       path, damage)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = os.path.join(tmp, "kernels.c"), os.path.join(tmp, "kernels.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([compiler, *flags, src, "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
        _publish(out, path)
    return path


def _build_threaded(compiler: str, folder: Optional[str] = None) -> str:
    """`_build` with OpenMP, else (logged) without: kernels on one thread. ``folder``: the cache's by default."""
    folder = folder or _cache_folder()
    try:
        return _build(compiler, FLAGS + [OPENMP], folder)
    except subprocess.CalledProcessError as e:
        logger.info("ampkit: %s %s failed (%s); the fused CPU kernels run on one thread.", compiler, OPENMP,
                    (e.stderr or b"").decode(errors="replace").strip().splitlines()[:1])
        return _build(compiler, FLAGS, folder)


def _load(compiler: str) -> ctypes.CDLL:
    """The cached kernels, or (with one warning saying why) kernels built in a private folder for this process."""
    try:
        return ctypes.CDLL(_build_threaded(compiler))
    except _Untrusted as e:
        logger.warning("ampkit: not loading cached kernels: %s; building them in a private folder for this process "
                       "(make the cache yours and not writable by others, e.g. chmod go-w, or set AMPKIT_CACHE_DIR "
                       "to such a folder).", e)
    with tempfile.TemporaryDirectory(prefix="ampkit-kernels-") as private:  # mode 0700; the loaded library stays mapped
        return ctypes.CDLL(_build_threaded(compiler, private))


def compiler() -> Optional[str]:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def library() -> Optional[ctypes.CDLL]:
    """The kernels, built on first use; ``None`` (logged once) where they cannot be built, or
    where ``AMPKIT_NATIVE=0`` turns them off."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    if os.environ.get("AMPKIT_NATIVE", "1") != "0":
        cc = compiler()
        try:
            if cc is None:
                raise FileNotFoundError("no C compiler (cc, gcc, clang or $CC) on the PATH")
            lib = _load(cc)
            for name in ("round_bf16", "adamw_fp32_state", "adamw_bf16_state", "adamw_8bit", "adamw_master",
                         "adamw_remainder"):
                getattr(lib, name).restype = None
            lib.any_nonfinite.restype = lib.widen_scaled.restype = ctypes.c_int
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            logger.warning("ampkit: fused CPU kernels unavailable (%s%s); using the eager path (same numbers, slower).",
                           e, (": " + detail.decode(errors="replace").strip().splitlines()[0]) if detail.strip() else "")
            lib = None
    _state["lib"] = lib
    return lib


def threads(n: int) -> ctypes.c_int:
    """The threads a kernel call over ``n`` elements runs on: torch's, one when ``n`` is small."""
    return ctypes.c_int(max(1, min(torch.get_num_threads(), n // MIN_PER_THREAD)))


def ptr(t: torch.Tensor, at: int = 0) -> ctypes.c_void_p:
    """The address of element ``at`` of contiguous ``t``."""
    return ctypes.c_void_p(t.data_ptr() + at * t.element_size())


def u64(x: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(x & ((1 << 64) - 1))


# -- fp32 masters (core/fused_masters.py): O5's and remainder masters' AdamW / Adam in one pass --------
SOURCE += r"""
/* The arithmetic of core/fused_adamw.py on a float32 master P with a float32 gradient G;
   c as there; l2 != 0 adds Adam's L2 term (a select, so the loop stays vectorized). The
   pointers are restrict (the tensors never overlap): without it gcc leaves the loops scalar. */
#define MASTER_STEP(P, G, M, V)                                                      \
    G = G * c[9];                                                                     \
    G = l2 ? G + P * c[1] : G;                                                        \
    P = P * c[0];                                                                     \
    M = M * c[2] + G * c[3];                                                          \
    V = V * c[4] + (G * G) * c[5];                                                    \
    P = P - (M / (sqrtf(V) / c[6] + c[7])) * c[8];

static inline uint32_t bits32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint16_t rne_bf16(uint32_t u) {  /* torch's float -> bfloat16 (c10's scalar NaN) */
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* O5: master x, its float32 grad, state m, v; w (may be NULL): the bf16 model weight, x rounded to nearest even */
static void adamw_master_range(float *restrict x, const float *restrict grad, float *restrict ms, float *restrict vs,
                               uint16_t *restrict w, int64_t n, const float *restrict c) {
    const int l2 = c[1] != 0.0f;
    if (w) {
        for (int64_t i = 0; i < n; i++) {
            float p = x[i], g = grad[i], m = ms[i], v = vs[i];
            MASTER_STEP(p, g, m, v)
            x[i] = p; ms[i] = m; vs[i] = v; w[i] = rne_bf16(bits32(p));
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            float p = x[i], g = grad[i], m = ms[i], v = vs[i];
            MASTER_STEP(p, g, m, v)
            x[i] = p; ms[i] = m; vs[i] = v;
        }
    }
}

void adamw_master(float *x, const float *grad, float *ms, float *vs, uint16_t *w, int64_t n, const float *c, int threads) {
    EACH_RANGE(n, lo, hi, adamw_master_range(x + lo, grad + lo, ms + lo, vs + lo, w ? w + lo : NULL, hi - lo, c);)
}

#define RBLOCK 512
static int64_t first_at_least(const int64_t *t, int64_t n, int64_t key) {
    int64_t lo = 0, hi = n;
    while (lo < hi) { int64_t mid = lo + (hi - lo) / 2; if (t[mid] < key) lo = mid + 1; else hi = mid; }
    return lo;
}

/* Remainder masters (core/remainder.py): elements [first, first + n) of one tensor; the master is
   combined from (w, r, its ascending side table), stepped, and split back; the new table's entries
   of this range go to found (at most cap; the call stops before a block that might not fit there).
   Returns the elements done, n unless found filled up. */
static int64_t adamw_remainder_range(uint16_t *restrict w, int16_t *restrict r, const uint16_t *restrict grad, float *restrict ms,
                        float *restrict vs, int64_t n, int64_t first, const int64_t *restrict table, int64_t ntable,
                        int64_t *restrict found, int64_t cap, int64_t *restrict nfound, const float *restrict c) {
    const int l2 = c[1] != 0.0f;
    int64_t t = first_at_least(table, ntable, first), k = 0, lo = 0;
    union { float f[RBLOCK]; uint32_t u[RBLOCK]; } x;
    for (; lo < n && cap - k >= RBLOCK; lo += RBLOCK) {
        const int64_t len = n - lo < RBLOCK ? n - lo : RBLOCK;
        for (int64_t j = 0; j < len; j++) {  /* combine: code 32767 of an even w is d = +32768 */
            uint32_t b = ((uint32_t)w[lo + j] << 16) + (uint32_t)(int32_t)r[lo + j];
            x.u[j] = b + ((b & 0x1FFFFu) == 0x7FFFu);
        }
        for (; t < ntable && table[t] < first + lo + len; t++) {  /* listed: code 32766 of an even w is d = +32767 */
            const int64_t j = table[t] - first - lo;
            x.u[j] += (x.u[j] & 0x1FFFFu) == 0x7FFEu;
        }
        for (int64_t j = 0; j < len; j++) {
            float p = x.f[j], g = widen(grad[lo + j]), m = ms[lo + j], v = vs[lo + j];
            MASTER_STEP(p, g, m, v)
            ms[lo + j] = m; vs[lo + j] = v; x.f[j] = p;
        }
        uint32_t any = 0;
        for (int64_t j = 0; j < len; j++) {  /* split */
            const uint32_t b = x.u[j], moved = ((b + 1u) & 0x1FFFEu) == 0x8000u;
            w[lo + j] = rne_bf16(b);
            r[lo + j] = (int16_t)(uint16_t)(b - moved);
            any |= moved;
        }
        if (any)
            for (int64_t j = 0; j < len; j++) {
                const uint32_t b = x.u[j];
                if ((b & 0x1FFFFu) == 0x7FFFu && (b & 0x7FFFFFFFu) < 0x7F800000u) found[k++] = first + lo + j;
            }
    }
    *nfound = k;
    return lo < n ? lo : n;
}

/* adamw_remainder_range over elements [first, first + n) of one tensor in `threads` ranges: range t's entries go to
   found + t * cap (nfound[t] of them), done[t] its elements done (less than its length if found
   filled up: the caller goes on from there). */
void adamw_remainder(uint16_t *w, int16_t *r, const uint16_t *grad, float *ms, float *vs, int64_t n, int64_t first,
                     const int64_t *table, int64_t ntable, int64_t *found, int64_t cap, int64_t *nfound, int64_t *done,
                     const float *c, int threads) {
    EACH_RANGE(n, lo, hi, done[t_] = adamw_remainder_range(w + lo, r + lo, grad + lo, ms + lo, vs + lo, hi - lo, first + lo,
                                                        table, ntable, found + t_ * cap, cap, nfound + t_, c);)
}
"""


# -- the gradient check (core/scaler.py): a read, for a loss scale of 1; the move of half gradients
# into float32 master gradients, unscaled and checked in one pass ------------------------------------
SOURCE += r"""
/* Whether any of n elements of 2 or 4 bytes has its exponent bits exp all set (inf or NaN). */
static uint32_t nonfinite16(const uint16_t *restrict x, int64_t n, uint16_t exp) {
    uint32_t any = 0;
    for (int64_t i = 0; i < n; i++) any |= (x[i] & exp) == exp;
    return any;
}
static uint32_t nonfinite32(const uint32_t *restrict x, int64_t n, uint32_t exp) {
    uint32_t any = 0;
    for (int64_t i = 0; i < n; i++) any |= (x[i] & exp) == exp;
    return any;
}

int any_nonfinite(const void *x, int64_t n, int bytes, uint32_t exp, int threads) {
    uint32_t any = 0;
    ANY_RANGE(n, lo, hi, bytes == 2 ? nonfinite16((const uint16_t *)x + lo, hi - lo, (uint16_t)exp)
                                    : nonfinite32((const uint32_t *)x + lo, hi - lo, exp))
    return any != 0;
}

static inline float half_to_float(uint16_t h) {  /* IEEE float16 to float32, exact (F16C's, without it) */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13), special = sign | 0x7F800000u | (m << 13);
    const uint32_t subnormal = sign | q8_u((float)m * 0x1p-24f);
    return q8_f(e == 0 ? subnormal : (e == 31 ? special : normal));
}

/* dst = half src (bfloat16, or float16 when fp16) widened to float32 and multiplied by inv (kept
   as it is when inv is 1), in one pass; whether any src is inf or NaN: torch's copy, then its
   unscale-and-check, which checks the values before it scales them. */
#define WIDEN_LOOP(TO_FLOAT, MASK)                                                   \
    for (int64_t i = 0; i < n; i++) {                                               \
        const float v = TO_FLOAT(src[i]);                                           \
        dst[i] = inv == 1.0f ? v : v * inv;                                         \
        any |= (src[i] & MASK) == MASK;                                             \
    }
static uint32_t widen_range(const uint16_t *restrict src, float *restrict dst, int64_t n, int fp16, float inv) {
    uint32_t any = 0;
    if (fp16)
        WIDEN_LOOP(half_to_float, 0x7C00)
    else
        WIDEN_LOOP(widen, 0x7F80)
    return any;
}

int widen_scaled(const uint16_t *src, float *dst, int64_t n, int fp16, float inv, int threads) {
    uint32_t any = 0;
    ANY_RANGE(n, lo, hi, widen_range(src + lo, dst + lo, hi - lo, fp16, inv))
    return any != 0;
}
"""
