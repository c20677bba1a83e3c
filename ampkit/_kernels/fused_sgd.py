"""SGD with momentum in one pass per tensor: O5's float32 masters and O7's bf16 weights.

Each step has an eager reference and a C kernel with the same bits. Design: docs/design/kernels.md, "SGD".
"""
import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

from . import counter_bits, native
from .counter_bits import Index
from .fused_masters import _check, _contiguous
from .rounding import round_counter_

__all__ = ["Hyper", "step_master_", "step_"]

MAXIMIZE, DECAY, NESTEROV = 1, 2, 4  # the kernels' flags (csrc/sgd.c)
NO_BUFFER, NEW_BUFFER, BUFFER = 0, 1, 2  # momentum 0; the buffer made on this step; a buffer carried on


@dataclass(frozen=True)
class Hyper:
    """One group's SGD settings (Python floats, rounded to float32 where they are used)."""
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool

    def consts(self) -> list:
        """``[weight_decay, momentum, 1 - dampening, lr]``."""
        return [self.weight_decay, self.momentum, 1 - self.dampening, self.lr]

    def flags(self) -> int:
        return MAXIMIZE * self.maximize | DECAY * (self.weight_decay != 0) | NESTEROV * self.nesterov


def arithmetic(p, grad, buf, hyper: Hyper, new: bool):
    """The new float32 ``(p, buf)`` of the step (``buf`` None when momentum is 0; ``new``: it is
    made on this step, from the gradient), in torch ops, one rounding each (the arguments are
    read, not written)."""
    wd, momentum, undamped, lr = hyper.consts()
    g, p = grad.float(), p.float()
    g = g.neg() if hyper.maximize else g
    if wd != 0:
        g = g.add(p.mul(wd))
    if buf is not None:
        buf = g if new else buf.float().mul(momentum).add(g.mul(undamped))
        g = g.add(buf.mul(momentum)) if hyper.nesterov else buf
    return p.sub(g.mul(lr)), buf


def _mode(buf, new: bool) -> int:
    return NO_BUFFER if buf is None else NEW_BUFFER if new else BUFFER


def step_master_eager(x, grad, buf, hyper: Hyper, new: bool, w: Optional[torch.Tensor] = None) -> None:
    """The reference: `arithmetic` on float32 ``x``, ``grad``, ``buf``; then ``w`` (bf16,
    optional) ``= x`` rounded to nearest even."""
    p, b = arithmetic(x, grad, buf, hyper, new)
    if buf is not None:
        buf.copy_(b)
    x.copy_(p)
    if w is not None:
        w.copy_(p)


def step_master_native(lib, x, grad, buf, hyper: Hyper, new: bool, w: Optional[torch.Tensor]) -> None:
    """`step_master_eager` in one pass of the C kernel (contiguous flat CPU tensors)."""
    n = x.numel()
    lib.sgd_master(native.ptr(x), native.ptr(grad), None if buf is None else native.ptr(buf),
                   None if w is None else native.ptr(w), n, _mode(buf, new), hyper.flags(),
                   (ctypes.c_float * 4)(*hyper.consts()), native.threads(n))


def step_master_(x, grad, buf, hyper: Hyper, new: bool, w: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of float32 master ``x`` (its float32 ``grad``, float32 momentum buffer
    ``buf``, None when momentum is 0, written from the gradient when ``new``) in place, and
    ``w = x`` in bfloat16 when ``w`` is given: with the kernel ``lib`` on CPU, else
    `step_master_eager`; the same bits either way."""
    tensors = [x, grad] + [t for t in (buf, w) if t is not None]
    names = ["x", "grad"] + [name for name, t in (("buf", buf), ("w", w)) if t is not None]
    _check(tensors, [{"w": torch.bfloat16}.get(name, torch.float32) for name in names], "sgd step_master_", names)
    if x.numel() == 0:
        return
    with _contiguous(tensors, written=[0] + list(range(2, len(tensors)))) as flat:
        b, v = (flat[2] if buf is not None else None), (flat[-1] if w is not None else None)
        if lib is not None and x.device.type == "cpu":
            step_master_native(lib, flat[0], flat[1], b, hyper, new, v)
        else:
            step_master_eager(flat[0], flat[1], b, hyper, new, v)


def step_eager(w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, index: Index) -> None:
    """The reference: `arithmetic`; ``w`` (and a bf16 ``buf``) rounded with the counter bits of
    streams 0 (and 1), O7's chunked update's bits for a weight and its first elementwise state."""
    p, b = arithmetic(w, grad, buf, hyper, new)
    if buf is not None and buf.dtype == torch.bfloat16:
        round_counter_(buf, b, seed, step, tensor, 1, index)
    elif buf is not None:
        buf.copy_(b)
    round_counter_(w, p, seed, step, tensor, 0, index)


def step_native(lib, w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, first: int) -> None:
    """`step_eager` in one pass of the C kernel (contiguous flat CPU tensors, ``first`` an int)."""
    n = w.numel()
    fn = lib.sgd_bf16_state if buf is not None and buf.dtype == torch.bfloat16 else lib.sgd_fp32_state
    fn(native.ptr(w), native.ptr(grad), None if buf is None else native.ptr(buf), n,
       first, counter_bits.key(seed, step, tensor, 0), _mode(buf, new),
       hyper.flags(), (ctypes.c_float * 4)(*hyper.consts()), native.threads(n))


def step_(w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, index: Index,
          lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of bf16 ``w`` (its bf16 ``grad``, its float32 or bf16 momentum buffer ``buf``,
    None when momentum is 0, written from the gradient when ``new``) in place, rounded
    stochastically: with the kernel ``lib`` where it applies (CPU, ``index`` an int), else
    `step_eager`; the same bits either way."""
    tensors = [w, grad] + ([] if buf is None else [buf])
    names = ["w", "grad", "buf"][:len(tensors)]
    state = torch.bfloat16 if torch.is_tensor(buf) and buf.dtype == torch.bfloat16 else torch.float32
    _check(tensors, [torch.bfloat16, torch.bfloat16, state][:len(tensors)], "sgd step_", names)
    if w.numel() == 0:
        return
    with _contiguous(tensors, written=[0, 2]) as flat:
        b = flat[2] if buf is not None else None
        if lib is not None and isinstance(index, int) and w.device.type == "cpu":
            step_native(lib, flat[0], flat[1], b, hyper, new, seed, step, tensor, index)
        else:
            step_eager(flat[0], flat[1], b, hyper, new, seed, step, tensor,
                       index.reshape(-1).to(w.device) if torch.is_tensor(index) else index)
