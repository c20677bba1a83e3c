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

__all__ = ["Hyper", "step_master_", "step_", "steps_master_", "steps_"]

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
    steps_master_native(lib, [(x, grad, buf, new, w)], hyper)


def steps_master_native(lib, steps: list, hyper: Hyper) -> None:
    """`step_master_native` of each ``(x, grad, buf, new, w)`` of ``steps`` (one param group's
    ``hyper``) in one call of the C kernel (``sgd_master_many``)."""
    rows = [[x.data_ptr(), grad.data_ptr(), native.address(buf), native.address(w), x.numel(), _mode(buf, new),
             native.threads(x.numel())] for x, grad, buf, new, w in steps]
    native.call_rows(lib.sgd_master_many, rows, hyper.flags(), (ctypes.c_float * 4)(*hyper.consts()))


def step_master_(x, grad, buf, hyper: Hyper, new: bool, w: Optional[torch.Tensor] = None,
                 lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of float32 master ``x`` (its float32 ``grad``, float32 momentum buffer
    ``buf``, None when momentum is 0, written from the gradient when ``new``) in place, and
    ``w = x`` in bfloat16 when ``w`` is given: with the kernel ``lib`` on CPU, else
    `step_master_eager`; the same bits either way."""
    tensors = _check_master(x, grad, buf, w)
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
    steps_native(lib, [(w, grad, buf, new, tensor, first)], hyper, seed, step)


def steps_native(lib, steps: list, hyper: Hyper, seed: int, step: int) -> None:
    """`step_native` of each ``(w, grad, buf, new, tensor, first)`` of ``steps`` (one param group's
    ``hyper``) in one call of the C kernel (``sgd_bf16_many``)."""
    rows = [[w.data_ptr(), grad.data_ptr(), native.address(buf), w.numel(), first, counter_bits.key(seed, step, tensor, 0),
             _mode(buf, new), buf is not None and buf.dtype == torch.bfloat16, native.threads(w.numel())]
            for w, grad, buf, new, tensor, first in steps]
    native.call_rows(lib.sgd_bf16_many, rows, hyper.flags(), (ctypes.c_float * 4)(*hyper.consts()))


def step_(w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, index: Index,
          lib: Optional[ctypes.CDLL] = None) -> None:
    """One SGD step of bf16 ``w`` (its bf16 ``grad``, its float32 or bf16 momentum buffer ``buf``,
    None when momentum is 0, written from the gradient when ``new``) in place, rounded
    stochastically: with the kernel ``lib`` where it applies (CPU, ``index`` an int), else
    `step_eager`; the same bits either way."""
    tensors = _check_step(w, grad, buf)
    if w.numel() == 0:
        return
    with _contiguous(tensors, written=[0, 2]) as flat:
        b = flat[2] if buf is not None else None
        if lib is not None and isinstance(index, int) and w.device.type == "cpu":
            step_native(lib, flat[0], flat[1], b, hyper, new, seed, step, tensor, index)
        else:
            step_eager(flat[0], flat[1], b, hyper, new, seed, step, tensor,
                       index.reshape(-1).to(w.device) if torch.is_tensor(index) else index)


def steps_(steps: list, hyper: Hyper, seed: int, step: int, lib: Optional[ctypes.CDLL] = None) -> None:
    """`step_` of each ``(w, grad, buf, new, tensor, first)`` of ``steps`` (one param group's
    ``hyper``; ``first`` an int, as the op's): those the kernel ``lib`` reads where they are (not
    empty) in one call, the others one at a time (all checked first)."""
    for w, grad, buf, *_ in steps:
        _check_step(w, grad, buf)
    run, others = native.split(steps, lambda s: lib is not None and s[0].numel() > 0 and native.direct(s[:3]))
    if run:
        steps_native(lib, run, hyper, seed, step)
    for w, grad, buf, new, tensor, first in others:
        step_(w, grad, buf, hyper, new, seed, step, tensor, first, lib)


def steps_master_(steps: list, hyper: Hyper, lib: Optional[ctypes.CDLL] = None) -> None:
    """`step_master_` of each ``(x, grad, buf, new, w)`` of ``steps`` (one param group's ``hyper``):
    those the kernel ``lib`` reads where they are (not empty) in one call, the others one at a
    time (all checked first)."""
    for x, grad, buf, _, w in steps:
        _check_master(x, grad, buf, w)
    run, others = native.split(steps, lambda s: lib is not None and s[0].numel() > 0 and native.direct(s[:3] + s[4:]))
    if run:
        steps_master_native(lib, run, hyper)
    for x, grad, buf, new, w in others:
        step_master_(x, grad, buf, hyper, new, w, lib)


def _check_step(w, grad, buf) -> list:
    """`step_`'s tensors (``buf`` where given), checked."""
    tensors = [w, grad] + ([] if buf is None else [buf])
    state = torch.bfloat16 if torch.is_tensor(buf) and buf.dtype == torch.bfloat16 else torch.float32
    _check(tensors, [torch.bfloat16, torch.bfloat16, state][:len(tensors)], "sgd step_", ["w", "grad", "buf"][:len(tensors)])
    return tensors


_MASTER_ARGS = {(b, w): ([name for name, given in (("x", 1), ("grad", 1), ("buf", b), ("w", w)) if given],
                        [dtype for dtype, given in ((torch.float32, 1), (torch.float32, 1), (torch.float32, b),
                                                    (torch.bfloat16, w)) if given])
                for b in (False, True) for w in (False, True)}  # (buf given, w given) -> names, dtypes


def _check_master(x, grad, buf, w) -> list:
    """`step_master_`'s tensors (``buf``, ``w`` where given), checked."""
    tensors = [x, grad] + [t for t in (buf, w) if t is not None]
    names, dtypes = _MASTER_ARGS[buf is not None, w is not None]
    _check(tensors, dtypes, "sgd step_master_", names)
    return tensors
