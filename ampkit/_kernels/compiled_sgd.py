"""O7's SGD step (``fused_sgd.py``) as one ``torch.compile`` kernel per tensor, for accelerators.

`fused_sgd.step_eager`'s arithmetic traced into one graph, compiled and run as O7's AdamW
(``compiled_update.py``: its `OPTIONS`, counter words, rounding, launch and fallback), so
bit for bit the eager reference as computed on CPU: the weight rounded stochastically with
stream 0, a bf16 buffer with stream 1 of each element's word. The options (maximize, weight
decay, Nesterov, a buffer made on this step) enter as float32 flags beside the constants and
are selected inside, so one graph serves them all; the index kind, the buffer (none, float32,
bf16) and size 1 against 2+ compile apart (at most 6 graphs per index kind).
"""
import functools

import torch

from . import fused_sgd
from .compiled_update import OPTIONS, _draws16, _round, _word, guarded, launch
from .counter_bits import Index
from .fused_sgd import Hyper

__all__ = ["step_compiled", "step_"]


def _consts(hyper: Hyper, new: bool) -> list:
    """``Hyper.consts()`` then the flags maximize, Nesterov and new as 1.0 or 0.0, and a pad (an even count)."""
    return hyper.consts() + [float(hyper.maximize), float(hyper.nesterov), float(new), 0.0]


def _update(w, grad, buf, c, keys, index) -> None:
    """The whole step of flat ``w`` (and ``buf``, None at momentum 0) in place, `fused_sgd.arithmetic`'s
    operations in its order; ``c``: `_consts` as float32, ``keys``: the int64 key of word 0, the first index."""
    g, p = grad.float(), w.float()
    g = torch.where(c[4] != 0, -g, g)
    g = torch.where(c[0] != 0, g + p * c[0], g)  # the reference skips the decay term when it is 0
    word = _word(keys[0], index)
    if buf is not None:
        b = torch.where(c[6] != 0, g, buf.float() * c[1] + g * c[2])
        g = torch.where(c[5] != 0, g + b * c[1], b)
        buf.copy_(_round(b, _draws16(word, 1)) if buf.dtype == torch.bfloat16 else b)
    w.copy_(_round(p - g * c[3], _draws16(word, 0)))


def _update_run(w, grad, buf, c, keys):
    """`_update` of the run of elements from ``keys[1]``."""
    _update(w, grad, buf, c, keys, torch.arange(w.numel(), dtype=torch.int64, device=w.device) + keys[1])


def _update_indexed(w, grad, buf, c, keys, index):
    """`_update` of the elements ``index`` (int64, one per element)."""
    _update(w, grad, buf, c, keys, index)


@functools.lru_cache(maxsize=None)
def _compiled(indexed: bool):
    """The compiled update (one per index kind, so each has its own recompile budget)."""
    return torch.compile(_update_indexed if indexed else _update_run, dynamic=True, fullgraph=True, options=OPTIONS)


def step_compiled(w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, index: Index) -> None:
    """`fused_sgd.step_eager` of flat contiguous tensors on one device in one compiled kernel."""
    launch(_compiled, [w, grad, buf], _consts(hyper, new), seed, step, tensor, index)


def step_(w, grad, buf, hyper: Hyper, new: bool, seed: int, step: int, tensor: int, index: Index) -> None:
    """One SGD step of bf16 ``w`` in place, as ``fused_sgd.step_`` (the same bits) but in one
    compiled kernel (``compiled_update.guarded``: its fallback to the eager reference)."""
    if w.numel() != 0:
        guarded(step_compiled, fused_sgd.step_, [w, grad, buf], hyper, new, seed, step, tensor, index)
