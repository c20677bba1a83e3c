"""O8's fused AdamW: ``torch.optim.AdamW`` / ``Adam`` steps on bf16 weights with 8-bit state, one pass each.

Gradient, weight and the packed state (``state_8bit.py``'s codes and scales) are read and
written once, with the draws, caps and codes ``state_8bit.py`` stores; the kernel backs up what
it overwrites, so a chunk with a non-finite weight is undone. ``AMPKIT_FUSED=0`` keeps the
optimizer's own step. Design notes: docs/design/update-engine.md.
"""
import functools
import math
from typing import Callable, Optional

import torch

from .._kernels import ops
from .._kernels.fused_adamw_8bit import BLOCK, backups, restore_, span
from . import fused_update, state_8bit
from .shards import global_index, like, local
from .shared_blocks import whole_blocks

KEYS = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}  # the packed keys and their code dtypes


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``p`` steps here: ``fused_update.plain``, no block of ``p``'s full tensor split
    between ranks' parts (``shared_blocks.whole_blocks``, FSDP2's and HSDP's layouts; the same
    answer on every rank: a split block needs its maximum over all of them, which the chunks'
    packing shares and the kernel does not), and state (if any) as ``state_8bit`` packs Adam's.
    (A compiled step runs O8's update eagerly: ``ChunkedUpdate.eager_under_compile``.)"""
    if not fused_update.plain(optimizer, group, p, grad) or not whole_blocks(p, BLOCK):
        return False
    first = global_index(p)
    state = optimizer.state.get(p)
    if not state:
        return True
    q = local(p)
    names = {"step"} | {k + suffix for k in KEYS for suffix in (state_8bit.CODES, state_8bit.SCALES)}
    return (set(state) == names and torch.is_tensor(state["step"]) and state["step"].device.type == "cpu"
            and all(local(state[k + state_8bit.CODES]).dtype == dtype and local(state[k + state_8bit.CODES]).shape == q.shape
                    and state[k + state_8bit.SCALES].dtype == torch.float32
                    and state[k + state_8bit.SCALES].numel() == span(q.numel(), first) for k, dtype in KEYS.items()))


def step(optimizer, chunk: list, grads: dict, rounder, ids: dict, skip: Callable, scratch: dict) -> Optional[Callable]:
    """One AdamW / Adam step of each ``(group, p)`` of ``chunk`` (all `eligible`); ``skip``,
    ``scratch`` and the result as `run_chunk`'s."""
    bound = next(b[3] for b in state_8bit.BOUNDED if isinstance(optimizer, b[0]))

    def step_one(group, p, q, created, backup) -> bool:
        return _step_one(optimizer, group, p, q, grads[p], rounder, ids[p], bound, backup)
    return run_chunk(chunk, scratch, skip, functools.partial(_start, optimizer), step_one,
                     functools.partial(_undo, optimizer))


def run_chunk(chunk: list, scratch: dict, skip: Callable, start: Callable, step_one: Callable,
              undo_one: Callable, backups_of: Callable = backups) -> Optional[Callable]:
    """Step each ``(group, p)`` of ``chunk`` in an O8 kernel that backs up what it overwrites
    (``backups_of``, in ``scratch``): ``start(p, q)`` says whether ``p``'s state was made now,
    ``step_one(group, p, q, created, backup)`` whether it wrote (False: a non-finite weight,
    the chunk is skipped), ``undo_one(p, created, backup)`` puts it back. ``skip(bad, device)``
    says whether the chunk, whose parameters ``bad`` got non-finite weights here (maybe none),
    is skipped (on any rank). None when it was (nothing written), else a function that undoes
    the step (until the next call with ``scratch``)."""
    parts = [local(p) for _, p in chunk]
    saved = backups_of([(q.numel(), span(q.numel(), global_index(p))) for q, (_, p) in zip(parts, chunk)], scratch)
    done, bad = [], []
    for (group, p), q, backup in zip(chunk, parts, saved):
        done.append((p, start(p, q), backup))
        if not step_one(group, p, q, done[-1][1], backup):
            bad.append(p)
            break  # the chunk is skipped: the rest need no step

    def undo():
        for p, created, backup in reversed(done):
            undo_one(p, created, backup)

    if skip(bad, parts[0].device):
        undo()
        return None
    return undo


def _start(optimizer, p: torch.Tensor, q: torch.Tensor) -> bool:
    """Give ``p`` zero state if it has none (``state_8bit``'s layout); whether it had none."""
    state = optimizer.state.get(p)
    if state:
        return False
    state = optimizer.state[p] = {"step": torch.tensor(0.0)}
    for k, dtype in KEYS.items():
        state[k + state_8bit.CODES] = like(torch.zeros(q.shape, dtype=dtype), p)
        state[k + state_8bit.SCALES] = torch.ones(span(q.numel(), global_index(p)))
    return True


def _step_one(optimizer, group, p, q, grad, rounder, tensor: int, bound, backup) -> bool:
    """The step of one parameter (local part ``q``); False when it wrote nothing (non-finite weights)."""
    state = optimizer.state[p]
    state["step"] += 1
    cap = bound(group, state["step"].item())
    m, v = ([local(state[k + state_8bit.CODES]), state[k + state_8bit.SCALES]] for k in KEYS)
    with torch.no_grad():  # the declared op reads the step count itself, as fused_update.step's
        return ops.adamw_8bit_step_(q, local(grad), *m, *v, fused_update.hyper(optimizer, group, 0.0), state["step"],
                                    cap if math.isfinite(cap) else math.nan, rounder.seed, rounder.step, tensor,
                                    global_index(p), backup)


def _undo(optimizer, p: torch.Tensor, created: bool, backup: tuple) -> None:
    """Put back ``p``'s weight, codes, scales and step count from before the step."""
    state = optimizer.state.pop(p) if created else optimizer.state[p]
    with torch.no_grad():
        restore_(local(p), local(state["exp_avg" + state_8bit.CODES]), state["exp_avg" + state_8bit.SCALES],
                 local(state["exp_avg_sq" + state_8bit.CODES]), state["exp_avg_sq" + state_8bit.SCALES], backup)
    state["step"] -= 1
