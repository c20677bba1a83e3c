"""How fast a device computes in half precision, what each opt level buys there, and ``"auto"``.

``capabilities(device)`` measures it: a probe of well under a second times a matmul and a
convolution (forward and backward) in float32, bfloat16 and float16 on the device, the fastest of a
few alternating calls, cached as JSON under the kernels' cache root (``$AMPKIT_CACHE_DIR``, default
``~/.cache/ampkit``) per machine (CPU name and flags, or GPU), torch version and thread count. A
half dtype is fast where it takes at most ``FAST`` of float32's time on every op class, slower
above ``SLOW`` on any. CPU flags do not say this: a Xeon VM with AVX512-BF16 ran bfloat16 matmuls at
1.9x float32's time. Where the probe cannot run (``AMPKIT_PROBE=0``, or it fails) the answer is read
from the hardware description instead (CPU flags from ``/proc/cpuinfo`` and
``torch.backends.cpu.get_cpu_capability()``; CUDA compute capability), and ``Capabilities.source``
says which. ``auto_level(device)`` turns that into the level ``initialize(opt_level="auto")`` uses,
with the reason.
"""
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ._common import switches
from ._common.cpu import cpu_info as _cpu_info  # a module name of its own: tests replace it
from ._common.files import fsync_dir
from ._common.logs import logger
from ._config.levels import OPT_LEVELS
from ._kernels.native import cache_dir

SPEED = "speed and memory"
MEMORY = "memory only"
SLOWER = "memory only, slower than O0"
FP8_EMULATED = "fp8 numerics only, slower than O5 (no fp8 matmul)"
NONE = "baseline"

# oneDNN ISA caps below the first one with bfloat16 dot products (AVX512_CORE_BF16).
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_CPU_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "bf16", "asimdhp")

PROBE_ENV = "AMPKIT_PROBE"  # "0": no probe, the hardware description decides
FAST, SLOW = 0.9, 1.1  # a half dtype's time over float32's: fast at most FAST on every op class, slower above SLOW on any
HALVES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES = {"float32": torch.float32, **HALVES}
_OPS = ("matmul", "conv")
_MATMUL = 256  # a square matmul: about 0.3 ms in float32 on one CPU core
_CONV = (4, 16, 16)  # batch, channels (in = out), side: a 3x3 convolution, forward and backward
_REPS = 5  # timed rounds after one warm-up call each; the fastest is kept
_CLEAR = 3.0  # after 2 rounds a dtype above this multiple of float32's slowest time on an op class is done there
# No device runs a half op in under 1/64 of float32's time (AMX and tensor cores peak near 16x): a probe that
# says so was disturbed (float32's every sample slowed by other work), and is measured again, never cached.
_PLAUSIBLE = 1 / 64


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Native half-precision support of one device, and the expected gain per opt level.

    Attributes:
        device: the device, e.g. ``"cpu"`` or ``"cuda:0"``.
        name: CPU model or GPU name.
        isa: CPU: torch's kernel level (AVX512, AVX2, ...) plus the relevant flags; CUDA: ``sm_XY``.
        native_bf16: bfloat16 matmuls run natively (not converted to float32 around each op).
        native_fp16: the same for float16.
        bf16_via: what runs them natively (``"AMX"``, ``"AVX512-BF16"``, ``"tensor cores"``), ``""`` if emulated.
        fp16_via: the same for float16.
        levels: opt level -> expected gain there (``SPEED``, ``MEMORY``, ``SLOWER``, ``FP8_EMULATED``, ``NONE``).
        source: where the gains come from: ``"measured at N threads"`` (CUDA: ``"measured"``), or the
            hardware description and why the probe did not decide (``"CPU flags (AMPKIT_PROBE=0)"``).
        measured: half dtype -> op class -> its time over float32's (``{}`` where not measured).
    """

    device: str
    name: str
    isa: str
    native_bf16: bool
    native_fp16: bool
    bf16_via: str
    fp16_via: str
    levels: Dict[str, str]
    source: str = "hardware description"
    measured: Dict[str, Dict[str, float]] = dataclasses.field(default_factory=dict)

    def fast(self, dtype: torch.dtype) -> bool:
        """Whether the levels computing in half ``dtype`` (fp8 aside) are expected to beat O0 here."""
        return any(self.levels.get(name) == SPEED for name, p in OPT_LEVELS.items() if p.half_dtype == dtype and not p.fp8)

    def line(self) -> str:
        """One line naming the device, its half-precision support and where that comes from (for figures and logs)."""
        def show(dtype, native, via):
            hardware = f"native ({via})" if native else "emulated"
            if dtype not in self.measured:
                return f"{dtype} {hardware}"
            times = ", ".join(f"{op} {ratio:.2f}x" for op, ratio in self.measured[dtype].items())
            verdict = "faster" if self.fast(HALVES[dtype]) else "not faster"
            return f"{dtype} {times} float32's time ({verdict}; {hardware})"
        return (f"{self.device}: {self.name} [{self.isa}]; {show('bfloat16', self.native_bf16, self.bf16_via)}, "
                f"{show('float16', self.native_fp16, self.fp16_via)} [{self.source}]")

    def summary(self) -> str:
        """The line, then what each level buys here."""
        rows = [self.line()] + [f"  {lvl}: {gain}" for lvl, gain in self.levels.items()]
        return "\n".join(rows)


def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _onednn_cap() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_info(index: int) -> Tuple[str, Tuple[int, int]]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def _levels(bf16: str, fp16: str, fp8: str = FP8_EMULATED) -> Dict[str, str]:
    """Every row of the opt-level table, by what it computes in: fp8, bfloat16, float16 or fp32."""
    def gain(props):
        if props.fp8:
            return fp8
        return {torch.bfloat16: bf16, torch.float16: fp16}.get(props.half_dtype, NONE)
    return {name: gain(props) for name, props in OPT_LEVELS.items()}


def _gain(ratios: Dict[str, float]) -> str:
    """A half dtype's gain from its time over float32's per op class: the slowest op class decides."""
    worst = max(ratios.values())
    return SPEED if worst <= FAST else MEMORY if worst <= SLOW else SLOWER


def _gains(measured: dict, bf16: bool, fp16: bool, otherwise: str) -> Tuple[str, str]:
    """The bfloat16 and float16 levels' gains: measured, else ``SPEED`` where native and ``otherwise`` elsewhere."""
    if measured:
        return _gain(measured["bfloat16"]), _gain(measured["float16"])
    return (SPEED if bf16 else otherwise), (SPEED if fp16 else otherwise)


def _cpu(measured: dict, source: str) -> Capabilities:
    name, flags = _cpu_info()
    isa = _cpu_capability()
    cap = _onednn_cap()
    limited = cap in _NO_BF16_ISAS
    if "amx_bf16" in flags and not limited:
        bf16_via = "AMX"
    elif ("avx512_bf16" in flags or "bf16" in flags) and not limited:
        bf16_via = "AVX512-BF16" if "avx512_bf16" in flags else "BF16 instructions"
    else:
        bf16_via = ""
    # torch's CPU float16 GEMMs and convolutions are fast only with AMX-FP16; with AVX512-FP16 or
    # without either they convert to float32 around each op.
    fp16_via = "AMX-FP16" if "amx_fp16" in flags and not limited else ""
    shown = [f for f in _CPU_FLAGS if f in flags]
    isa_line = isa + (" " + " ".join(shown) if shown else "") + (f" ONEDNN_MAX_CPU_ISA={cap}" if cap else "")
    bf16, fp16 = _gains(measured, bool(bf16_via), bool(fp16_via), SLOWER)
    return Capabilities(
        device="cpu", name=name, isa=isa_line, native_bf16=bool(bf16_via), native_fp16=bool(fp16_via),
        bf16_via=bf16_via, fp16_via=fp16_via, levels=_levels(bf16, fp16),
        source=source if measured else f"CPU flags ({source})", measured=measured,
    )


def _cuda(device: torch.device, measured: dict, source: str) -> Capabilities:
    index = _cuda_index(device)
    name, (major, minor) = _cuda_info(index)
    fp16 = major >= 7  # tensor cores from Volta
    bf16 = major >= 8  # bfloat16 tensor cores from Ampere
    fp8 = (major, minor) >= (8, 9)  # fp8 tensor cores from Ada and Hopper
    bf16_gain, fp16_gain = _gains(measured, bf16, fp16, MEMORY)
    return Capabilities(
        device=f"cuda:{index}", name=name, isa=f"sm_{major}{minor}", native_bf16=bf16, native_fp16=fp16,
        bf16_via="tensor cores" if bf16 else "", fp16_via="tensor cores" if fp16 else "",
        levels=_levels(bf16_gain, fp16_gain, SPEED if fp8 else FP8_EMULATED),
        source=source if measured else f"compute capability ({source})", measured=measured,
    )


# --- the speed probe ---------------------------------------------------------------------


def _workloads(device: torch.device, dtype: torch.dtype) -> Dict[str, Callable[[], object]]:
    """One call of each op class in ``dtype`` on ``device``, on fixed inputs (a generator of its own)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)
    a, b = rand(_MATMUL, _MATMUL), rand(_MATMUL, _MATMUL)
    batch, channels, side = _CONV
    x, gy = rand(batch, channels, side, side).requires_grad_(), rand(batch, channels, side, side)
    w = (rand(channels, channels, 3, 3) / 12).requires_grad_()
    return {"matmul": lambda: torch.mm(a, b),
            "conv": lambda: torch.autograd.grad(F.conv2d(x, w, padding=1), (x, w), gy)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clearly_slower(samples: Dict[Tuple[str, str], list], op: str, name: str) -> bool:
    """Whether 2 or more samples of dtype ``name`` on ``op`` all exceed ``_CLEAR`` times float32's slowest."""
    return len(samples[op, name]) >= 2 and min(samples[op, name]) > _CLEAR * max(samples[op, "float32"])


def _timings(device: torch.device) -> Dict[str, Dict[str, float]]:
    """Seconds of one call per op class and dtype, the fastest of ``_REPS`` rounds after a warm-up round,
    each round through every dtype in turn: other work on the machine only ever adds time, so the
    fastest round is the one it disturbed least. An emulated dtype (tens of times float32's time)
    leaves after 2 rounds, once every sample shows it."""
    with torch.enable_grad(), torch.inference_mode(False), torch.autocast(device.type, enabled=False):
        calls = {(op, name): fn for name, dtype in _DTYPES.items() for op, fn in _workloads(device, dtype).items()}
        samples = {key: [] for key in calls}
        for rep in range(_REPS + 1):
            for key, fn in calls.items():
                if _clearly_slower(samples, *key):
                    continue
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                if rep:
                    samples[key].append(time.perf_counter() - start)
    return {op: {name: min(samples[op, name]) for name in _DTYPES} for op in _OPS}


def _probe_key(device: torch.device) -> dict:
    """What a measurement depends on: the machine, torch's build and kernel choice, the thread count."""
    if device.type == "cuda":
        name, capability = _cuda_info(_cuda_index(device))
        machine = {"gpu": name, "capability": list(capability), "cuda": torch.version.cuda}
    else:
        name, flags = _cpu_info()
        machine = {"cpu": name, "flags": sorted(flags), "isa": _cpu_capability(), "onednn_max_isa": _onednn_cap()}
    return {**machine, "torch": torch.__version__, "threads": torch.get_num_threads()}


def _cache_path(key: dict) -> str:
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "probe", f"speed_{tag}.json")


def _cached(path: str, key: dict) -> Optional[Dict[str, Dict[str, float]]]:
    """The seconds cached at ``path`` for ``key``; None where the file is missing, damaged or another key's."""
    try:
        with open(path) as f:
            entry = json.load(f)
        seconds = entry["seconds"]
        if entry["key"] == key and all(float(seconds[op][name]) > 0 for op in _OPS for name in _DTYPES):
            return seconds if _plausible(seconds) else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _plausible(seconds: Dict[str, Dict[str, float]]) -> bool:
    """Whether no half dtype took under `_PLAUSIBLE` of float32's time on an op class."""
    return all(seconds[op][name] >= _PLAUSIBLE * seconds[op]["float32"] for op in _OPS for name in HALVES)


def _store(path: str, entry: dict) -> None:
    """Write ``entry`` to ``path`` atomically and durably (temporary file, fsync, rename); best effort."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
            json.dump(entry, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)
        fsync_dir(folder)
    except OSError as e:
        logger.info("ampkit: could not cache the speed probe at %s (%s); it runs again next time.", path, e)


def _measure(device: torch.device) -> Tuple[Dict[str, Dict[str, float]], str]:
    """(half dtype -> op class -> its time over float32's, where that comes from); ``({}, why)`` where
    the probe does not run."""
    if not switches.on(PROBE_ENV):
        return {}, f"{PROBE_ENV}=0"
    key = _probe_key(device)
    path = _cache_path(key)
    seconds = _cached(path, key)
    if seconds is None:
        try:
            seconds = _timings(device)
            if not _plausible(seconds):
                seconds = _timings(device)
        except Exception as e:  # a dtype or op this build lacks must not stop initialize: the flags decide
            logger.info("ampkit: the speed probe failed on %s (%s: %s); the hardware description decides.",
                        device, type(e).__name__, e)
            return {}, f"the speed probe failed: {type(e).__name__}"
        if not _plausible(seconds):
            logger.info("ampkit: the speed probe on %s was disturbed twice (a half dtype under 1/64 of float32's "
                        "time); the hardware description decides.", device)
            return {}, "the speed probe was disturbed"
        _store(path, {"key": key, "seconds": seconds})
    ratios = {name: {op: seconds[op][name] / seconds[op]["float32"] for op in _OPS} for name in HALVES}
    threads = key["threads"]
    return ratios, (f"measured at {threads} thread" + "s" * (threads > 1) if device.type == "cpu" else "measured")


def capabilities(device=None) -> Capabilities:
    """How fast ``device`` (default: CUDA if available, else the CPU) computes in half precision,
    and what each opt level buys there.

    Measured by a probe of well under a second (cached per machine, torch version and thread
    count); with ``AMPKIT_PROBE=0``, or where the probe fails, read from the hardware description.
    ``source`` says which. Other device types (mps, xpu, ...) are not measured and report no
    native support, so ``"auto"`` stays at O0 there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        return Capabilities(device=str(device), name=device.type, isa="unknown", native_bf16=False, native_fp16=False,
                            bf16_via="", fp16_via="", levels=_levels(MEMORY, MEMORY),
                            source=f"not measured on {device.type}")
    measured, source = _measure(device)
    return _cpu(measured, source) if device.type == "cpu" else _cuda(device, measured, source)


def _agreed(caps: Capabilities) -> Capabilities:
    """Rank 0's capabilities on every rank of a process group: ranks that measured a little differently
    must still pick the same level."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return caps
    box = [caps]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def auto_level(device) -> Tuple[str, str]:
    """The level ``opt_level="auto"`` picks for a model on ``device``, and why (one sentence): O5 where
    bfloat16 is fast, else O2 where float16 is, else O0 (with several processes: rank 0's answer)."""
    caps = _agreed(capabilities(device))
    if caps.fast(torch.bfloat16):
        return "O5", (f"opt_level='auto' chose O5 (bf16 model, fp32 master weights): bfloat16 is faster than "
                      f"float32 on {caps.line()}.")
    if caps.fast(torch.float16):
        return "O2", (f"opt_level='auto' chose O2 (fp16 model, fp32 master weights, dynamic loss scaling): "
                      f"float16 is faster than float32 but bfloat16 is not on {caps.line()}.")
    return "O0", (f"opt_level='auto' chose O0 (fp32): no half dtype is faster than float32 on {caps.line()} "
                  f"(O5 here: {caps.levels['O5']}); pass opt_level='O5' if you need its memory saving "
                  f"(about half the activation memory) more than speed.")


def model_device(model: torch.nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter or buffer (None for an empty model)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None
