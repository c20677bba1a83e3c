"""O8's fused SGD: ``torch.optim.SGD`` with momentum on bf16 weights with an 8-bit buffer, one pass each.

Gradient, weight and the buffer's codes and scales (``state_8bit``'s layout: ``momentum_buffer``
as int8 codes and block scales) are read and written once, with the draws and codes
``state_8bit`` stores; the kernel backs up what it overwrites, so a chunk with a non-finite
weight is undone. ``AMPKIT_FUSED=0`` keeps the optimizer's own step. Design notes:
docs/design/kernels.md, "O8's SGD with an 8-bit buffer".
"""
import functools
from typing import Callable, Optional

import torch

from .._kernels import ops
from .._kernels.fused_adamw_8bit import BLOCK, span
from .._kernels.fused_sgd_8bit import backups, restore_
from . import fused_update_8bit, state_8bit
from .fused_sgd_update import exact_group, group_hypers
from .shards import global_index, like, local
from .shared_blocks import whole_blocks

CODES, SCALES = "momentum_buffer" + state_8bit.CODES, "momentum_buffer" + state_8bit.SCALES


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``p`` steps here: an exact SGD with momentum whose group asks for nothing the kernel
    does not do (differentiable, fused), a bf16 CPU parameter with a dense bf16 gradient, no
    block of its full tensor split between ranks' parts (as `fused_update_8bit.eligible`), and
    its buffer (if any) as ``state_8bit`` packs it."""
    if (not exact_group(optimizer, group) or group["momentum"] == 0
            or p.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16 or grad.is_sparse
            or not local(p).is_cpu or not whole_blocks(p, BLOCK)):
        return False
    state = optimizer.state.get(p)
    if not state:
        return True
    q = local(p)
    return (set(state) == {CODES, SCALES} and local(state[CODES]).dtype == torch.int8
            and local(state[CODES]).shape == q.shape and state[SCALES].dtype == torch.float32
            and state[SCALES].numel() == span(q.numel(), global_index(p)))


def step(optimizer, chunk: list, grads: dict, rounder, ids: dict, skip: Callable, scratch: dict) -> Optional[Callable]:
    """One SGD step of each ``(group, p)`` of ``chunk`` (all `eligible`); ``skip``, the result
    and ``scratch`` as `fused_update_8bit.run_chunk`'s: the declared op once per run of one group."""
    hypers = group_hypers(chunk)

    def step_group(group, run) -> int:
        steps = [(q, local(grads[p]), local(optimizer.state[p][CODES]), optimizer.state[p][SCALES], new, ids[p],
                  global_index(p), backup) for _, p, q, new, backup in run]
        with torch.no_grad():
            return ops.sgd_8bit_steps_(steps, hypers[id(group)], rounder.seed, rounder.step)
    return fused_update_8bit.run_chunk(chunk, scratch, skip, functools.partial(_start, optimizer),
                                       functools.partial(fused_update_8bit.by_group_until_bad, step_group=step_group),
                                       functools.partial(_undo, optimizer), backups)


def _start(optimizer, p: torch.Tensor, q: torch.Tensor) -> bool:
    """Give ``p`` an empty buffer if it has none (``state_8bit``'s layout; the step makes it from
    the gradient, as torch's first step); whether it had none."""
    if optimizer.state.get(p):
        return False
    optimizer.state[p] = {CODES: like(torch.zeros(q.shape, dtype=torch.int8), p),
                          SCALES: torch.ones(span(q.numel(), global_index(p)))}
    return True


def _undo(optimizer, p: torch.Tensor, created: bool, backup: Optional[tuple]) -> None:
    """Put back ``p``'s weight, codes and scales from before the step (``backup`` None: it never
    stepped; no buffer if it had none)."""
    state = optimizer.state[p]
    if backup is not None:
        with torch.no_grad():
            restore_(local(p), local(state[CODES]), state[SCALES], backup)
    if created:
        optimizer.state.pop(p)
