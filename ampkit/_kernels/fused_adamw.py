"""O7's AdamW step on one bfloat16 tensor in one pass: the eager reference and the C kernel.

Design (the arithmetic and its order): docs/design/kernels.md, "O7's AdamW".
"""
import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from . import counter_bits, native
from .counter_bits import Index
from .ieee import sqrt
from .rounding import BLOCK, round_counter_

__all__ = ["Hyper", "step_", "steps_"]


@dataclass(frozen=True)
class Hyper:
    """One tensor's step constants (Python floats, rounded to float32 where they are used)."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (decay the weight) or Adam (L2: add to the gradient)
    maximize: bool
    step: float  # the tensor's step count, this step included (torch keeps it as a float)

    def consts(self) -> list:
        """``[decay, l2, beta1, 1 - beta1, beta2, 1 - beta2, sqrt(bc2), eps, step size, sign]``."""
        bc1, bc2 = 1 - self.beta1 ** self.step, 1 - self.beta2 ** self.step
        decay = 1 - self.lr * self.weight_decay if self.decoupled else 1.0
        l2 = 0.0 if self.decoupled else self.weight_decay
        return [decay, l2, self.beta1, 1 - self.beta1, self.beta2, 1 - self.beta2, bc2 ** 0.5, self.eps,
                self.lr / bc1, -1.0 if self.maximize else 1.0]


def arithmetic(w, grad, m, v, hyper: Hyper):
    """The new float32 ``(w, m, v)`` of the step, in torch ops (one rounding each, in the
    order docs/design/kernels.md gives; the arguments are read, not written)."""
    decay, l2, b1, omb1, b2, omb2, bc2s, eps, step_size, sign = hyper.consts()
    g = grad.float().mul(sign)
    p = w.float()
    if l2 != 0:
        g = g.add(p.mul(l2))
    p = p.mul(decay)
    m32 = m.float().mul(b1).add(g.mul(omb1))
    v32 = v.float().mul(b2).add(g.mul(g).mul(omb2))
    denom = sqrt(v32).div(bc2s).add(eps)  # correctly rounded, as the kernel's sqrtf
    return p.sub(m32.div(denom).mul(step_size)), m32, v32


def step_eager(w, grad, m, v, hyper: Hyper, seed: int, step: int, tensor: int, index: Index) -> None:
    """The reference: torch ops, one rounding each (``w`` bf16; ``m``, ``v`` float32 or bf16)."""
    p, m32, v32 = arithmetic(w, grad, m, v, hyper)
    round_counter_(w, p, seed, step, tensor, 0, index)
    for state, new, stream in ((m, m32, 1), (v, v32, 2)):
        if state.dtype == torch.bfloat16:
            round_counter_(state, new, seed, step, tensor, stream, index)
        else:
            state.copy_(new)


def step_native(lib, w, grad, m, v, hyper: Hyper, seed: int, step: int, tensor: int, first: int) -> None:
    """`step_eager` in one pass of the C kernel (contiguous CPU tensors, ``first`` an int)."""
    steps_native(lib, [(w, grad, m, v, hyper, tensor, first)], seed, step)


def steps_native(lib, steps: list, seed: int, step: int) -> None:
    """`step_native` of each ``(w, grad, m, v, hyper, tensor, first)`` of ``steps`` in one call of
    the C kernel (``adamw_bf16_many``)."""
    rows, consts = [], []
    for w, grad, m, v, hyper, tensor, first in steps:
        n = w.numel()
        rows.append([w.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), n, first,
                     counter_bits.key(seed, step, tensor, 0), m.dtype == torch.bfloat16, native.threads(n)])
        consts += hyper.consts()
    native.call_rows(lib.adamw_bf16_many, rows, native.floats(consts))


def step_(w, grad, m, v, hyper: Hyper, seed: int, step: int, tensor: int, index: Index,
          lib: Optional[ctypes.CDLL] = None) -> None:
    """One AdamW step of bf16 ``w`` (its bf16 ``grad``, its state ``m``, ``v``) in place: with
    the kernel ``lib`` where it applies (CPU, ``index`` an int), else `step_eager` in
    blocks that stay in cache; the same bits either way. Non-contiguous tensors are stepped
    through contiguous copies."""
    n = w.numel()
    if n == 0:
        return
    tensors = [w, grad, m, v]
    flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    if lib is not None and isinstance(index, int) and w.device.type == "cpu" and grad.dtype == torch.bfloat16:
        step_native(lib, *flat, hyper, seed, step, tensor, index)  # contiguous: the addresses of flat memory
    else:
        views = [f.view(-1) for f in flat]
        index = index.reshape(-1).to(w.device) if torch.is_tensor(index) else index
        for lo in range(0, n, BLOCK):
            hi = min(n, lo + BLOCK)
            step_eager(*(t[lo:hi] for t in views), hyper, seed, step, tensor,
                       index[lo:hi] if torch.is_tensor(index) else index + lo)
    for t, f in zip(tensors, flat):
        if f is not t and t is not grad:
            t.copy_(f)


def steps_(steps: list, seed: int, step: int, lib: Optional[ctypes.CDLL] = None) -> None:
    """`step_` of each ``(w, grad, m, v, hyper, tensor, first)`` of ``steps`` (``first`` an int, as
    the op's): those the kernel ``lib`` reads where they are (not empty) in one call, the others
    one at a time."""
    run, others = native.split(steps, lambda s: lib is not None and s[0].numel() > 0 and s[1].dtype == torch.bfloat16
                               and native.direct(s[:4]))
    if run:
        steps_native(lib, run, seed, step)
    for w, grad, m, v, hyper, tensor, first in others:
        step_(w, grad, m, v, hyper, seed, step, tensor, first, lib)
