"""O7's AdamW step (``fused_adamw.py``) as one ``torch.compile`` kernel per tensor, for accelerators.

The same arithmetic as `fused_adamw.step_eager`, counter bits included, traced into one
graph and compiled by inductor (Triton on CUDA, ROCm and XPU; C++ on CPU, where only the
tests use it: the C kernel is faster there): gradient, weight and state are read once and
written once. Bit for bit the eager reference as computed on CPU (and so the C kernel), by
construction:

- every float operation is one IEEE-rounded float32 operation: the step constants enter as
  a float32 tensor (not Python floats, which inductor would bake in as constants, dividing
  by a constant as a multiplication by its reciprocal off CPU), and the kernels compile with
  `OPTIONS`: no FMA contraction (``emulate_precision_casts`` turns Triton's
  ``enable_fp_fusion`` off; C++ is built with ``-ffp-contract=off``, inductor's default),
  IEEE division (``eager_numerics.division_rounding``: Triton's ``div_rn`` rather than the
  approximate ``div.full``), no flushing of subnormals (``eager_numerics.disable_ftz``), and
  no unsafe math in C++; square roots are correctly rounded on both (``tl.sqrt_rn``,
  ``std::sqrt``);
- the counter bits are int64 multiplications and additions, which wrap modulo 2**64 in
  either backend, and arithmetic right shifts masked to logical ones, as in
  ``counter_bits.py``.

(Eager CUDA divides by a Python scalar as a multiplication by its reciprocal, so
``step_eager`` itself run on CUDA tensors is not the reference there: compare with it on
CPU copies.) The compiled functions take dynamic shapes (no recompilation per parameter
size; sizes 1 and 2+ compile apart, as dynamic shapes specialize size 1) and are built per
index kind (a run from an offset, or every element's index) on first use; torch._inductor
is imported then, not with ampkit. Where inductor's C++ is scalar (no SIMD), a run on CPU
steps as its elements' index (`_scalar_cpp`).

O7's SGD (``compiled_sgd.py``) compiles and runs the same way, with this module's options,
counter words, rounding, `launch` and `guarded` (the eager fallback).
"""
import functools

import torch

from .._common import switches
from .._common.logs import logger
from . import counter_bits, fused_adamw
from .counter_bits import GAMMA, M1, M2, Index
from .fused_adamw import Hyper

__all__ = ["OPTIONS", "available", "step_compiled", "step_", "launch", "guarded"]

OPTIONS = {  # inductor settings under which the compiled update is the eager reference bit for bit
    "emulate_precision_casts": True,  # Triton: enable_fp_fusion=False (no FMA contraction)
    "eager_numerics.division_rounding": True,  # Triton: div_rn, IEEE division
    "eager_numerics.disable_ftz": True,  # Triton on CUDA: subnormals kept (enable_reflect_ftz=False)
    "cpp.enable_floating_point_contract_flag": "off",  # C++: -ffp-contract=off
    "cpp.enable_unsafe_math_opt_flag": False,  # C++: -fno-unsafe-math-optimizations
}
TRITON_DEVICES = ("cuda", "xpu")  # device types whose inductor backend is Triton (ROCm reports "cuda")
_KEEP = -(1 << 16)  # as int32: the float32 bits bfloat16 keeps
_failed = set()  # device types whose compilation failed (logged once; a cache, as native.library's)
ON_CPU = False  # the tests' switch: CPU parameters too step here (inductor's C++ backend)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s``."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _word(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``counter_bits.words``: the int64 word of each element of ``index`` (``key`` an int64 0-dim tensor)."""
    z = (index + 1) * counter_bits._signed(GAMMA) + key
    z = (z ^ _shr(z, 30)) * counter_bits._signed(M1)
    z = (z ^ _shr(z, 27)) * counter_bits._signed(M2)
    return z ^ _shr(z, 31)


def _draws16(word: torch.Tensor, stream: int) -> torch.Tensor:
    """``counter_bits.draws16`` of ``stream`` (0-3) from the elements' words: an int32 in ``[0, 2**16)``."""
    shift = counter_bits.shift16(stream)
    return ((_shr(word, shift) if shift else word) & 0xFFFF).to(torch.int32)


def _round(x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` to bfloat16, rounded stochastically with ``draws`` (``rounding.round_counter_``)."""
    return ((x.view(torch.int32) + draws) & _KEEP).view(torch.float32).to(torch.bfloat16)


def _update(w, grad, m, v, c, keys, index) -> None:
    """The whole step of flat ``w`` in place (``step_eager``'s operations in its order);
    ``c``: ``Hyper.consts()`` as float32, ``keys``: the int64 key of word 0 (streams 0-2), the first index."""
    g = grad.float() * c[9]
    p = w.float()
    g = torch.where(c[1] != 0, g + p * c[1], g)  # the reference skips the L2 term when l2 == 0
    p = p * c[0]
    m32 = m.float() * c[2] + g * c[3]
    v32 = v.float() * c[4] + (g * g) * c[5]
    denom = torch.sqrt(v32) / c[6] + c[7]
    p = p - (m32 / denom) * c[8]
    word = _word(keys[0], index)
    w.copy_(_round(p, _draws16(word, 0)))
    if m.dtype == torch.bfloat16:
        m.copy_(_round(m32, _draws16(word, 1)))
        v.copy_(_round(v32, _draws16(word, 2)))
    else:
        m.copy_(m32)
        v.copy_(v32)


def _update_run(w, grad, m, v, c, keys):
    """`_update` of the run of elements from ``keys[1]``."""
    _update(w, grad, m, v, c, keys, torch.arange(w.numel(), dtype=torch.int64, device=w.device) + keys[1])


def _update_indexed(w, grad, m, v, c, keys, index):
    """`_update` of the elements ``index`` (int64, one per element)."""
    _update(w, grad, m, v, c, keys, index)


@functools.lru_cache(maxsize=None)
def _compiled(indexed: bool):
    """The compiled update (one per index kind, so each has its own recompile budget)."""
    return torch.compile(_update_indexed if indexed else _update_run, dynamic=True, fullgraph=True, options=OPTIONS)


def available(device: torch.device) -> bool:
    """Whether O7's fused step of parameters on ``device`` compiles here: a Triton device
    (CUDA, ROCm, XPU) with Triton installed whose compilation has not failed, or CPU under
    the tests' switch `ON_CPU`. ``AMPKIT_COMPILED_UPDATE=0`` turns it off."""
    if not switches.on("AMPKIT_COMPILED_UPDATE") or device.type in _failed:
        return False
    if device.type == "cpu":
        return ON_CPU
    if device.type not in TRITON_DEVICES:
        return False
    from torch.utils._triton import has_triton
    return has_triton()


def step_compiled(w, grad, m, v, hyper: Hyper, seed: int, step: int, tensor: int, index: Index) -> None:
    """`fused_adamw.step_eager` of flat contiguous tensors on one device in one compiled kernel."""
    launch(_compiled, [w, grad, m, v], hyper.consts(), seed, step, tensor, index)


def launch(compiled, tensors: list, consts: list, seed: int, step: int, tensor: int, index: Index) -> None:
    """``compiled(indexed)(*tensors, c, keys[, index])`` on flat contiguous ``tensors`` (None
    passes as None): ``c`` the float32 ``consts`` (an even count), ``keys`` the int64 key of word 0
    of ``(seed, step, tensor)`` and the run's first index, both in one host-to-device copy; each
    element's index where ``index`` is a tensor or C++ is scalar here (`_scalar_cpp`)."""
    w = tensors[0]
    keys = [counter_bits._signed(counter_bits.key(seed, step, tensor, 0))]
    packed = torch.tensor(keys + [index if isinstance(index, int) else 0], dtype=torch.int64)
    packed = torch.cat([packed, torch.tensor(consts, dtype=torch.float32).view(torch.int64)])
    packed = packed.to(w.device)  # one host-to-device copy
    c = packed[2:].view(torch.float32)
    args = [t if t is None else t.detach() for t in tensors] + [c, packed[:2]]  # plain tensors, no autograd: fewer guards
    with torch.no_grad():
        if isinstance(index, int) and not (w.device.type == "cpu" and _scalar_cpp()):
            compiled(False)(*args)
        else:
            if isinstance(index, int):
                index = torch.arange(index, index + w.numel(), dtype=torch.int64)
            compiled(True)(*args, index.reshape(-1).to(w.device))


@functools.lru_cache(maxsize=None)
def _scalar_cpp() -> bool:
    """Whether inductor's C++ code here is scalar (no SIMD ISA: ``ATEN_CPU_CAPABILITY=default``
    or none found). Its int64 arithmetic is C++'s signed arithmetic, where overflow is undefined,
    and GCC exploits that in the words of an element counted by the loop (wrong bits after the
    first few elements); words of a loaded index, and the vector code's, wrap. Triton's
    integer arithmetic (LLVM's, without no-wrap flags) wraps by definition."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    return not pick_vec_isa()


def step_(w, grad, m, v, hyper: Hyper, seed: int, step: int, tensor: int, index: Index) -> None:
    """One AdamW step of bf16 ``w`` in place, as ``fused_adamw.step_`` (the same bits) but in one
    compiled kernel (`guarded`)."""
    if w.numel() != 0:
        guarded(step_compiled, fused_adamw.step_, [w, grad, m, v], hyper, seed, step, tensor, index)


def guarded(compiled_step, reference, tensors: list, *args) -> None:
    """``compiled_step(*tensors, *args)`` of ``tensors`` (weight, gradient, state; None passes)
    made flat, non-contiguous ones through contiguous copies written back. Where compilation
    fails, one line is logged, this call runs ``reference(*tensors, *args)`` (the eager
    reference: the same bits on CPU, within a float32 rounding on CUDA), and `available` says no
    for the device from then on (O7 then takes the optimizer's own step there)."""
    device = tensors[0].device.type
    if device in _failed:
        return reference(*tensors, *args)
    flat = [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]
    try:
        compiled_step(*(f if f is None else f.view(-1) for f in flat), *args)
    except Exception as err:  # inductor's errors have no common public base class
        _failed.add(device)
        logger.warning("ampkit: the compiled O7 update failed on %s (%s: %s); the eager reference steps this tensor, "
                       "the optimizer's own step runs from then on", device, type(err).__name__,
                       str(err).splitlines()[0] if str(err) else "")
        return reference(*tensors, *args)
    for k, (t, f) in enumerate(zip(tensors, flat)):
        if f is not t and k != 1:  # the gradient (1) is only read
            t.copy_(f)
