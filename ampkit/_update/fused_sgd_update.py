"""Fused SGD: ``torch.optim.SGD`` steps in one pass per tensor (``_kernels/fused_sgd.py``).

* O5's fp32 masters of bf16 parameters (`step_masters`): master, its fp32 gradient and the
  momentum buffer read once; master, buffer and the bf16 model weight (to nearest even) written once.
* O7 (`step`): the bf16 weight, its bf16 gradient and the float32 or bf16 buffer read once and
  written once, rounded stochastically with the chunked update's bits (weight stream 0, buffer 1);
  on CUDA (and other Triton devices) as one ``torch.compile`` kernel per tensor
  (``_kernels/compiled_sgd.py``, where ``compiled_update.available``), with the same bits.
* Remainder masters (`step_remainders`): the bf16 weight, its int16 remainder and side table, the
  bf16 gradient and the float32 buffer read and written once; the masters equal O5's fused ones.

Eligible: an exact ``torch.optim.SGD`` (not a subclass; no ``differentiable`` or ``fused``) on CPU
tensors (O7's: or where the compiled kernel runs) with dense gradients. The arithmetic is torch's
SGD with one rounding per operation: torch's own ``add(alpha=)`` is one fused multiply-add in its
AVX2 / AVX512 loops, so results agree with it to the last float32 bit or so, bit for bit on its
portable kernels. The state stays torch's (``momentum_buffer``, keyed by the parameter or the
master; none when momentum is 0), so checkpoints move between the fused path and plain torch.
"""
from typing import Optional

import torch

from .._kernels import compiled_sgd, compiled_update, ops
from .._kernels.fused_sgd import Hyper
from .fused_update import by_group, enabled, master_pair
from .shards import global_index, like, local

STATE_KEY = "momentum_buffer"


def is_sgd(optimizer) -> bool:
    """``optimizer`` is an exact ``torch.optim.SGD``."""
    return type(optimizer) is torch.optim.SGD


def exact_group(optimizer, group: dict) -> bool:
    """An exact SGD whose ``group`` asks for nothing the kernels do not do (differentiable, fused)."""
    return is_sgd(optimizer) and not (group.get("differentiable") or group.get("fused"))


def hyper(group: dict) -> Hyper:
    """The `Hyper` of ``group``, read at each step (schedulers change ``lr``)."""
    return Hyper(float(group["lr"]), float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"]),
                 bool(group["nesterov"]), bool(group.get("maximize", False)))


def group_hypers(items) -> dict:
    """``id(group) -> hyper(group)`` for the groups of ``items`` (each ``(group, ...)``), read once a step."""
    groups = {id(item[0]): item[0] for item in items}
    return {key: hyper(group) for key, group in groups.items()}


def _state_as_kept(state, p: torch.Tensor, dtype) -> bool:
    buf = state.get(STATE_KEY) if state else None
    return (not state or (len(state) == 1 and STATE_KEY in state)) and (
        buf is None or (torch.is_tensor(buf) and buf.dtype == dtype and buf.shape == p.shape and not buf.is_sparse))


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor, state_dtype) -> bool:
    """Whether bf16 ``p`` of ``group`` steps in O7's `step`: on CPU or where the compiled kernel
    runs (``compiled_update.available``: CUDA with Triton), a dense bf16 gradient, an
    `exact_group`, its buffer (if any) as this path keeps it."""
    w = local(p)
    if (p.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16 or grad.is_sparse
            or (not w.is_cpu and not compiled_update.available(w.device)) or not exact_group(optimizer, group)):
        return False
    return _state_as_kept(optimizer.state.get(p), p, torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32)


def remainder_eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether bf16 ``p`` with remainder masters steps in `step_remainders`: on CPU (the kernel
    is C), `eligible` with a float32 buffer (if any)."""
    return local(p).is_cpu and eligible(optimizer, group, p, grad, torch.float32)


def _buffer(optimizer, group: dict, p: torch.Tensor, dtype) -> tuple:
    """``(p``'s momentum buffer, whether it is made on this step)``: None when momentum is 0 (torch
    then keeps none); a new one (its values the step's) kept as torch keeps it."""
    if group["momentum"] == 0:
        return None, False
    state = optimizer.state[p]
    buf = state.get(STATE_KEY)
    if buf is not None:
        return buf, False
    state[STATE_KEY] = like(torch.empty_like(local(p), dtype=dtype), p)
    return state[STATE_KEY], True


def step(optimizer, params, grads: dict, state_dtype, rounder, ids: dict) -> None:
    """One SGD step of each ``(group, p)`` of ``params`` (all `eligible`): on CPU the declared op
    once per group, elsewhere the compiled kernel per tensor."""
    dtype = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
    compiles, hypers, cpu = {}, group_hypers(params), []  # per device, per group; the CPU tensors' steps
    for group, p in params:
        buf, new = _buffer(optimizer, group, p, dtype)
        w, buf = local(p), None if buf is None else local(buf)
        if w.device not in compiles:
            compiles[w.device] = compiled_update.available(w.device)
        if not compiles[w.device]:
            cpu.append((group, w, local(grads[p]), buf, new, ids[p], global_index(p)))
            continue
        with torch.no_grad():
            compiled_sgd.step_(w, local(grads[p]), buf, hypers[id(group)], new, rounder.seed, rounder.step, ids[p],
                               global_index(p))
    with torch.no_grad():
        for group, run in by_group(cpu):
            ops.sgd_steps_(run, hypers[id(group)], rounder.seed, rounder.step)


def master_eligible(optimizer, group: dict, master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """Whether O5's fp32 ``master`` of bf16 model ``param`` (None: an fp32 parameter the optimizer
    holds itself) steps in `step_masters`: an `exact_group` not being traced by ``torch.compile``,
    `_master_kept`."""
    return exact_group(optimizer, group) and not torch.compiler.is_compiling() and _master_kept(optimizer, master, param)


def _master_kept(optimizer, master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """``fused_update.master_pair`` and a float32 buffer (if any): `master_eligible` but the group."""
    return master_pair(master, param) and _state_as_kept(optimizer.state.get(master), master, torch.float32)


def masters_to_step(optimizer, owner: dict) -> list:
    """``(group, master, param)`` of each master (``owner``: master -> bf16 model parameter) and
    fp32 parameter (``param`` None) that `step_masters` steps this time: as
    ``fused_update.masters_to_step``'s, for SGD."""
    if not enabled() or not is_sgd(optimizer) or torch.compiler.is_compiling():
        return []
    items = [(g, m, owner.get(m)) for g in optimizer.param_groups if exact_group(optimizer, g)
             for m in g["params"] if _master_kept(optimizer, m, owner.get(m))]
    return items if any(p is not None for _, _, p in items) else []  # fp32 ones only beside masters


def step_masters(optimizer, items) -> None:
    """One SGD step of each O5 master of ``items`` (from `masters_to_step`), writing its bf16 model
    parameter too (where it has one): the declared op once per group."""
    steps = []
    for group, m, p in items:
        buf, new = _buffer(optimizer, group, m, torch.float32)
        steps.append((group, local(m), local(m.grad), None if buf is None else local(buf), new, local(p)))
    with torch.no_grad():
        for group, run in by_group(steps):
            ops.sgd_master_steps_(run, hyper(group))


def step_remainders(optimizer, params, grads: dict, remainders) -> None:
    """One SGD step of each ``(group, p)`` of ``params`` (all `eligible` with a float32 buffer),
    whose master is bf16 ``p`` with ``remainders[i]`` (``_kernels/fused_sgd_remainder.py``)."""
    steps = []
    for (group, p), r in zip(params, remainders):
        buf, new = _buffer(optimizer, group, p, torch.float32)
        steps.append((group, local(p), r, local(grads[p]), None if buf is None else local(buf), new))
    with torch.no_grad():
        for group, run in by_group(steps):
            ops.sgd_remainder_steps_(run, hyper(group))
