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
from .._kernels.fused_adamw_8bit import BLOCK, backups, restore_, span, until_short
from . import fused_update, state_8bit
from .shards import global_index, like, local
from .shared_blocks import whole_blocks

KEYS = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}  # the packed keys and their code dtypes
NAMES = {"step"} | {k + suffix for k in KEYS for suffix in (state_8bit.CODES, state_8bit.SCALES)}  # packed state
_PACKED = [(k + state_8bit.CODES, k + state_8bit.SCALES, dtype) for k, dtype in KEYS.items()]


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``p`` steps here: ``fused_update.plain``, no block of ``p``'s full tensor split
    between ranks' parts (``shared_blocks.whole_blocks``, FSDP2's and HSDP's layouts; the same
    answer on every rank: a split block needs its maximum over all of them, which the chunks'
    packing shares and the kernel does not), and state (if any) as ``state_8bit`` packs Adam's.
    (A compiled step runs O8's update eagerly: ``ChunkedUpdate.eager_under_compile``.)"""
    if not fused_update.plain(optimizer, group, p, grad) or not whole_blocks(p, BLOCK):
        return False
    state = optimizer.state.get(p)
    return not state or _packed(state, local(p), span(local(p).numel(), global_index(p)))


def _packed(state: dict, q: torch.Tensor, blocks: int) -> bool:
    """Whether ``state`` is ``state_8bit``'s packing of Adam's for the part ``q`` of ``blocks`` scales."""
    if state.keys() != NAMES or not torch.is_tensor(state["step"]) or not state["step"].is_cpu:
        return False
    for codes, scales, dtype in _PACKED:
        c, s = local(state[codes]), state[scales]
        if c.dtype != dtype or c.shape != q.shape or s.dtype != torch.float32 or s.numel() != blocks:
            return False
    return True


def step(optimizer, chunk: list, grads: dict, rounder, ids: dict, skip: Callable, scratch: dict) -> Optional[Callable]:
    """One AdamW / Adam step of each ``(group, p)`` of ``chunk`` (all `eligible`); ``skip``,
    ``scratch`` and the result as `run_chunk`'s."""
    bound = next(b[3] for b in state_8bit.BOUNDED if isinstance(optimizer, b[0]))
    return run_chunk(chunk, scratch, skip, functools.partial(_start, optimizer),
                     functools.partial(_step_all, optimizer, grads, rounder, ids, bound),
                     functools.partial(_undo, optimizer))


def run_chunk(chunk: list, scratch: dict, skip: Callable, start: Callable, step_all: Callable,
              undo_one: Callable, backups_of: Callable = backups) -> Optional[Callable]:
    """Step the ``(group, p)`` of ``chunk`` in an O8 kernel that backs up what it overwrites
    (``backups_of``, in ``scratch``): ``start(p, q)`` says whether ``p``'s state was made now;
    ``step_all(items)`` steps the ``(group, p, q, created, backup)`` in turn and says how many
    wrote (`by_group_until_bad`; fewer than all: the next would have written a non-finite
    weight, it and the rest wrote nothing, the chunk is skipped); ``undo_one(p, created,
    backup)`` puts one back (``backup`` None: it never stepped). ``skip(bad, device)`` says
    whether the chunk, whose parameters ``bad`` got non-finite weights here (maybe none), is
    skipped (on any rank). None when it was (nothing written), else a function that undoes the
    step (until the next call with ``scratch``)."""
    parts = [local(p) for _, p in chunk]
    saved = backups_of([(q.numel(), span(q.numel(), global_index(p))) for q, (_, p) in zip(parts, chunk)], scratch)
    started = [(p, start(p, q), backup) for (_, p), q, backup in zip(chunk, parts, saved)]
    wrote = step_all([(g, p, q, created, backup) for (g, _), q, (p, created, backup) in zip(chunk, parts, started)])
    bad = [chunk[wrote][1]] if wrote < len(chunk) else []

    def undo():
        for i in reversed(range(len(started))):
            p, created, backup = started[i]
            undo_one(p, created, backup if i <= wrote else None)

    if skip(bad, parts[0].device):
        undo()
        return None
    return undo


def by_group_until_bad(items, step_group: Callable) -> int:
    """`run_chunk`'s ``step_all`` over runs of ``items`` (``(group, ...)``) of one group:
    ``step_group(group, run)`` says how many of ``run`` wrote; the runs stop at the first that
    did not write all. How many wrote."""
    return until_short(items, lambda item: id(item[0]), lambda _, run: step_group(run[0][0], run))


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


def _step_all(optimizer, grads: dict, rounder, ids: dict, bound, items) -> int:
    """`run_chunk`'s ``step_all``: each parameter's step count advanced (one foreach call), then
    the declared op once per run of parameters of one group; how many wrote."""
    states = {p: optimizer.state[p] for _, p, *_ in items}
    torch._foreach_add_([st["step"] for st in states.values()], 1)

    def step_group(group, run) -> int:
        steps, caps = [], {}  # the cap of each step count in the group (most share one)
        for _, p, q, _, backup in run:
            state = states[p]
            count = state["step"].item()
            cap = caps[count] if count in caps else caps.setdefault(count, bound(group, count))
            m, v = ((local(state[k + state_8bit.CODES]), state[k + state_8bit.SCALES]) for k in KEYS)
            steps.append((q, local(grads[p]), *m, *v, state["step"], cap if math.isfinite(cap) else math.nan, ids[p],
                          global_index(p), backup))
        with torch.no_grad():  # the declared op reads the step counts itself, as fused_update.step's
            return ops.adamw_8bit_steps_(steps, fused_update.hyper(optimizer, group, 0.0), rounder.seed, rounder.step)
    return by_group_until_bad(items, step_group)


def _undo(optimizer, p: torch.Tensor, created: bool, backup: Optional[tuple]) -> None:
    """Put back ``p``'s weight, codes and scales from before the step (``backup`` None: it never
    stepped) and its step count; drop the state the step made."""
    state = optimizer.state.pop(p) if created else optimizer.state[p]
    if backup is not None:
        with torch.no_grad():
            restore_(local(p), local(state["exp_avg" + state_8bit.CODES]), state["exp_avg" + state_8bit.SCALES],
                     local(state["exp_avg_sq" + state_8bit.CODES]), state["exp_avg_sq" + state_8bit.SCALES], backup)
    state["step"] -= 1
