"""What a device does natively in half precision, what each opt level buys there, and ``"auto"``.

``capabilities(device)`` reads what the hardware and this torch build can do (CPU flags from
``/proc/cpuinfo`` and ``torch.backends.cpu.get_cpu_capability()``; CUDA compute capability)
without running anything, and ``auto_level(device)`` turns that into the level
``initialize(opt_level="auto")`` uses, with the reason.
"""
import dataclasses
import os
from typing import Dict, Optional, Tuple

import torch

from ..core.cpu import cpu_info as _cpu_info  # a module name of its own: tests replace it
from ..core.levels import OPT_LEVELS

SPEED = "speed and memory"
MEMORY = "memory only"
SLOWER = "memory only, slower than O0 (emulated)"
FP8_EMULATED = "fp8 numerics only, slower than O5 (no fp8 matmul)"
NONE = "baseline"

# oneDNN ISA caps below the first one with bfloat16 dot products (AVX512_CORE_BF16).
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_CPU_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "bf16", "asimdhp")


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
    """

    device: str
    name: str
    isa: str
    native_bf16: bool
    native_fp16: bool
    bf16_via: str
    fp16_via: str
    levels: Dict[str, str]

    def line(self) -> str:
        """One line naming the device and its half-precision support (for figures and logs)."""
        def show(native, via):
            return f"native ({via})" if native else "emulated"
        return (f"{self.device}: {self.name} [{self.isa}]; bfloat16 {show(self.native_bf16, self.bf16_via)}, "
                f"float16 {show(self.native_fp16, self.fp16_via)}")

    def summary(self) -> str:
        """The line, then what each level buys here."""
        rows = [self.line()] + [f"  {lvl}: {gain}" for lvl, gain in self.levels.items()]
        return "\n".join(rows)


def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _cuda_info(index: int) -> Tuple[str, Tuple[int, int]]:
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def _levels(bf16: str, fp16: str, fp8: str = FP8_EMULATED) -> Dict[str, str]:
    """Every row of the opt-level table, by what it computes in: fp8, bfloat16, float16 or fp32."""
    def gain(props):
        if props.fp8:
            return fp8
        return {torch.bfloat16: bf16, torch.float16: fp16}.get(props.half_dtype, NONE)
    return {name: gain(props) for name, props in OPT_LEVELS.items()}


def _cpu() -> Capabilities:
    name, flags = _cpu_info()
    isa = _cpu_capability()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
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
    return Capabilities(
        device="cpu", name=name, isa=isa_line, native_bf16=bool(bf16_via), native_fp16=bool(fp16_via),
        bf16_via=bf16_via, fp16_via=fp16_via,
        levels=_levels(SPEED if bf16_via else SLOWER, SPEED if fp16_via else SLOWER),
    )


def _cuda(device: torch.device) -> Capabilities:
    index = device.index if device.index is not None else torch.cuda.current_device()
    name, (major, minor) = _cuda_info(index)
    fp16 = major >= 7  # tensor cores from Volta
    bf16 = major >= 8  # bfloat16 tensor cores from Ampere
    fp8 = (major, minor) >= (8, 9)  # fp8 tensor cores from Ada and Hopper
    return Capabilities(
        device=f"cuda:{index}", name=name, isa=f"sm_{major}{minor}", native_bf16=bf16, native_fp16=fp16,
        bf16_via="tensor cores" if bf16 else "", fp16_via="tensor cores" if fp16 else "",
        levels=_levels(SPEED if bf16 else MEMORY, SPEED if fp16 else MEMORY, SPEED if fp8 else FP8_EMULATED),
    )


def capabilities(device=None) -> Capabilities:
    """What ``device`` (default: CUDA if available, else the CPU) does natively in half precision.

    Read from the hardware description, not measured. Other device types (mps, xpu, ...)
    report no native support, so ``"auto"`` stays at O0 there.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu()
    if device.type == "cuda":
        return _cuda(device)
    return Capabilities(device=str(device), name=device.type, isa="unknown", native_bf16=False, native_fp16=False,
                        bf16_via="", fp16_via="", levels=_levels(MEMORY, MEMORY))


def auto_level(device) -> Tuple[str, str]:
    """The level ``opt_level="auto"`` picks for a model on ``device``, and why (one sentence)."""
    caps = capabilities(device)
    if caps.native_bf16:
        return "O5", (f"opt_level='auto' chose O5 (bf16 model, fp32 master weights): bfloat16 matmuls run natively "
                      f"on {caps.line()}.")
    if caps.native_fp16:
        return "O2", (f"opt_level='auto' chose O2 (fp16 model, fp32 master weights, dynamic loss scaling): "
                      f"float16 runs natively but bfloat16 does not on {caps.line()}.")
    return "O0", (f"opt_level='auto' chose O0 (fp32): half precision is emulated on {caps.line()}, so every half "
                  f"level would run slower than O0; pass opt_level='O5' if you need its memory saving "
                  f"(about half the activation memory) more than speed.")


def model_device(model: torch.nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter or buffer (None for an empty model)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None
