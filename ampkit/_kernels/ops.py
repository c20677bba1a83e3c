"""The fused update steps as declared torch ops (``torch.ops.ampkit.*``): each op's declaration,
its fake (for ``torch.compile``: it writes its mutated arguments in place and returns nothing) and
its CPU kernel (the C kernel, or the eager reference where there is none: the same bits) side by side.

Declared, an op is one node of a compiled graph instead of an opaque ctypes call that Dynamo
cannot trace. Design: ``docs/design/kernels.md``.
"""
import dataclasses

import torch

from . import fused_adamw, native
from .counter_bits import Index
from .fused_adamw import Hyper

__all__ = ["adamw_step_"]


@torch.library.custom_op("ampkit::adamw_bf16", mutates_args=("w", "m", "v"), device_types="cpu")
def adamw_bf16(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, count: torch.Tensor,
               hyper: list[float], flags: list[bool], seed: int, step: int, tensor: int, first: int) -> None:
    """O7's step (`fused_adamw.step_`) of bf16 ``w`` from element ``first`` on; ``count``: the
    tensor's step count (this step included); ``hyper``: lr, beta1, beta2, eps, weight_decay;
    ``flags``: decoupled, maximize."""
    h = Hyper(*hyper, *flags, count.item())
    fused_adamw.step_(w, grad, m, v, h, seed, step, tensor, first, native.library())


@adamw_bf16.register_fake
def _(w, grad, m, v, count, hyper, flags, seed, step, tensor, first) -> None:
    return None


def adamw_step_(w, grad, m, v, hyper: Hyper, count: torch.Tensor, seed: int, step: int, tensor: int,
                index: Index) -> None:
    """`fused_adamw.step_` of CPU tensors with ``hyper`` at step ``count`` (a tensor, read in the
    op: ``hyper.step`` is not used): the declared op where ``index`` is an int (the C kernel's
    case), else the eager reference."""
    if not isinstance(index, int):
        hyper = dataclasses.replace(hyper, step=count.item())
        return fused_adamw.step_(w, grad, m, v, hyper, seed, step, tensor, index)
    values = [hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay]
    torch.ops.ampkit.adamw_bf16(w, grad, m, v, count, values, [hyper.decoupled, hyper.maximize], seed, step, tensor,
                                index)
