"""Fused AdamW: ``torch.optim.AdamW`` / ``Adam`` steps in one pass per tensor.

* O7 (``update_rounding="stochastic"``, float32 or bfloat16 optimizer state): the rounded
  update hands the bf16 parameters to ``_kernels/fused_adamw.py``: gradient, weight and state
  are read once and written once, with the stochastic rounding inside, in place of fp32
  copies stepped by the optimizer and rounded back.
* O5's fp32 masters of bf16 parameters (`step_masters`): master, its fp32 gradient
  and the state are read once; master, state and the bf16 model weight (rounded to nearest
  even, as O5's copy to the model) written once (``_kernels/fused_masters.py``).
* Remainder masters (`step_remainders`): the bf16 weight, its int16 remainder and side
  table, the bf16 gradient and the state, read and written once; the masters equal O5's
  fused ones bit for bit.

Eligible: a plain ``torch.optim.AdamW`` or ``Adam`` (no amsgrad, capturable, differentiable
or fused) on CPU tensors (FSDP2's ``CPUOffloadPolicy`` included) with dense gradients. The
arithmetic is ampkit's fixed order (``_kernels/fused_adamw.py``), which agrees with torch's
AdamW to the last float32 bit or two, not bit for bit. The state stays torch's (``step``,
``exp_avg``, ``exp_avg_sq``, keyed by the parameter, or by the master at O5), so checkpoints
move between the fused path and plain torch. Without a C compiler the eager references run,
with the same numbers. ``AMPKIT_FUSED=0`` turns the fused paths off (every parameter goes
through the optimizer's own step, torch's numbers). Every kernel is a declared op
(``_kernels/ops.py``); a ``torch.compile``d step runs O7's, O8's and the remainder masters'
update eagerly (``ChunkedUpdate.eager_under_compile``), fused kernels included, and turns O5's
fused masters off (`plain_group`).

O7's update also runs on CUDA (and other Triton device) parameters, as one ``torch.compile``
kernel per tensor (``_kernels/compiled_update.py``) where Triton is installed, with the same
numbers as the C kernel; ``AMPKIT_COMPILED_UPDATE=0`` turns that off (accelerator
parameters then take the optimizer's own step).
"""
from typing import Optional

import torch

from .._common import switches
from .._kernels import compiled_update, ops
from .._kernels.fused_adamw import Hyper, arithmetic
from .shards import global_index, is_dtensor, like, local

KINDS = (torch.optim.AdamW, torch.optim.Adam)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def enabled() -> bool:
    """``AMPKIT_FUSED`` is not ``0``."""
    return switches.on("AMPKIT_FUSED")


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor, state_dtype) -> bool:
    """Whether ``p`` of ``group`` steps in O7's `step`: a bf16 parameter on CPU or where
    the compiled kernel runs (``compiled_update.available``: CUDA with Triton), with a dense
    bf16 gradient, of an exact AdamW / Adam whose group asks for nothing this kernel does not
    do, and state (if any) as this path keeps it; under ``torch.compile`` on CPU only (the
    declared op). (Elsewhere torch's own AdamW kernels stay: the eager reference off CPU is no
    faster than them.)"""
    w = local(p)
    if not _bf16_dense(p, grad) or not exact_group(optimizer, group) or (
            not w.is_cpu and not compiled_update.available(w.device)):
        return False
    return _state_as_kept(optimizer.state.get(p), p, state_dtype if state_dtype == torch.bfloat16 else torch.float32)


def remainder_eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether bf16 ``p`` with remainder masters steps in `step_remainders`: `plain`
    (CPU only: the kernel is C) and float32 state (if any) as this path keeps it."""
    return plain(optimizer, group, p, grad) and _state_as_kept(optimizer.state.get(p), p, torch.float32)


def master_eligible(optimizer, group: dict, master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """Whether O5's fp32 ``master`` of bf16 model ``param`` (None: an fp32 parameter the
    optimizer holds itself) steps in `step_masters`: `master_pair`, an exact AdamW / Adam,
    fp32 state (if any)."""
    return plain_group(optimizer, group) and _master_kept(optimizer, master, param)


def _master_kept(optimizer, master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """`master_pair` and fp32 state (if any): `master_eligible` but the group."""
    return master_pair(master, param) and _state_as_kept(optimizer.state.get(master), master, torch.float32)


def master_pair(master: torch.Tensor, param: Optional[torch.Tensor]) -> bool:
    """Whether fp32 ``master`` of bf16 model ``param`` is what the fused master kernels take: a
    dense fp32 gradient, the same shape, both on the CPU (whatever the optimizer). ``param``
    None: ``master`` is an fp32 parameter of its own (a norm kept in fp32), not a DTensor (FSDP2's
    fp32 shards, which ampkit does not master, take the optimizer's own step)."""
    grad = master.grad
    if (grad is None or master.dtype != torch.float32 or grad.dtype != torch.float32 or grad.is_sparse
            or not local(master).is_cpu):
        return False
    if param is None:
        return not is_dtensor(master)
    return param.dtype == torch.bfloat16 and master.shape == param.shape and local(param).is_cpu


def plain_group(optimizer, group: dict) -> bool:
    """`exact_group`, and no ``torch.compile`` tracing the step (O5's masters then take the
    optimizer's own step: traced, O5's fused step adds a graph break)."""
    return exact_group(optimizer, group) and not torch.compiler.is_compiling()


def exact_group(optimizer, group: dict) -> bool:
    """Whether ``optimizer`` is an exact AdamW / Adam and ``group`` asks for nothing the fused
    kernels do not do (amsgrad, capturable, differentiable, fused)."""
    return type(optimizer) in KINDS and not (group.get("amsgrad") or group.get("capturable")
                                             or group.get("differentiable") or group.get("fused"))


def plain(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``p`` is a bf16 CPU parameter with a dense bf16 gradient of an exact AdamW /
    Adam whose group asks for nothing the fused kernels do not do (whatever its state)."""
    return _bf16_dense(p, grad) and local(p).is_cpu and exact_group(optimizer, group)


def _bf16_dense(p: torch.Tensor, grad: torch.Tensor) -> bool:
    return p.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16 and not grad.is_sparse


def _state_as_kept(state, p: torch.Tensor, dtype) -> bool:
    if not state:
        return True
    return (tuple(state) == STATE_KEYS and all(state[k].dtype == dtype and state[k].shape == p.shape for k in STATE_KEYS[1:])
            and not (torch.is_tensor(state["step"]) and not state["step"].is_cpu))


def _begin(optimizer, group: dict, p: torch.Tensor, dtype) -> tuple:
    """`_advance`, and this step's `Hyper`."""
    state = _advance(optimizer, p, dtype)
    return state, hyper(optimizer, group, state["step"].item())


def _advance(optimizer, p: torch.Tensor, dtype) -> dict:
    """`_state` with its step count advanced."""
    state = _state(optimizer, p, dtype)
    state["step"] += 1
    return state


def _state(optimizer, p: torch.Tensor, dtype) -> dict:
    """``p``'s state, made as torch makes it on a first step (in ``dtype``) where it has none."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0)
        for k in STATE_KEYS[1:]:
            state[k] = like(torch.zeros_like(local(p), dtype=dtype, memory_format=torch.preserve_format), p)
    return state


def hyper(optimizer, group: dict, step: float) -> Hyper:
    """The `Hyper` of AdamW / Adam ``optimizer``'s ``group`` at ``step`` (this one included)."""
    beta1, beta2 = group["betas"]
    return Hyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                 group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW),
                 bool(group.get("maximize", False)), step)


def step(optimizer, params, grads: dict, state_dtype, rounder, ids: dict) -> None:
    """One AdamW / Adam step of each ``(group, p)`` of ``params`` (all `eligible`): the step
    counts advanced in one foreach call, then on CPU the declared op once per group, elsewhere
    the compiled kernel per tensor."""
    dtype = state_dtype if state_dtype == torch.bfloat16 else torch.float32
    states = _advanced(optimizer, [p for _, p in params], dtype)
    compiles, cpu = {}, []  # per device; the CPU tensors' (group, p, state)
    for (group, p), state in zip(params, states):
        device = local(p).device
        if device not in compiles:
            compiles[device] = compiled_update.available(device)
        if not compiles[device]:
            cpu.append((group, p, state))
            continue
        with torch.no_grad():
            compiled_update.step_(local(p), local(grads[p]), local(state["exp_avg"]), local(state["exp_avg_sq"]),
                                  hyper(optimizer, group, state["step"].item()), rounder.seed, rounder.step, ids[p],
                                  global_index(p))
    with torch.no_grad():  # the declared op reads the step count itself: a compiled step has no .item() here
        for group, run in by_group(cpu):
            ops.adamw_steps_([(local(p), local(grads[p]), local(st["exp_avg"]), local(st["exp_avg_sq"]), st["step"],
                               ids[p], global_index(p)) for p, st in run], hyper(optimizer, group, 0.0),
                             rounder.seed, rounder.step)


def _advanced(optimizer, params: list, dtype) -> list:
    """The state of each of ``params`` (`_state`), its step count advanced (one foreach call)."""
    states = [_state(optimizer, p, dtype) for p in params]
    if states:
        torch._foreach_add_([state["step"] for state in states], 1)
    return states


def by_group(items) -> list:
    """``(group, [rest of each item])`` of ``(group, *rest)`` items, groups in their first item's order."""
    runs = {}
    for group, *rest in items:
        runs.setdefault(id(group), (group, []))[1].append(rest)
    return list(runs.values())


def step_fp32_(optimizer, params) -> None:
    """One AdamW / Adam step of each ``(group, p)`` of ``params`` (float32 tensors with float32
    gradients and state: O8's widened copies) in place, in ampkit's arithmetic
    (``fused_adamw.arithmetic``): what the fused kernels compute, where they cannot run."""
    for group, p in params:
        state, hyper = _begin(optimizer, group, p, torch.float32)
        with torch.no_grad():
            w, m, v = local(p), local(state["exp_avg"]), local(state["exp_avg_sq"])
            torch._foreach_copy_([w, m, v], list(arithmetic(w, local(p.grad), m, v, hyper)))


def masters_to_step(optimizer, owner: dict) -> list:
    """``(group, master, param)`` of each of ``optimizer``'s masters (``owner``: master -> bf16
    model parameter) and fp32 parameters (``param`` None) that `step_masters` steps this time:
    `master_eligible`, each group checked once; fp32 parameters only beside a master (O2's
    float16 masters take the optimizer's own step, its fp32 parameters with them); none with
    ``AMPKIT_FUSED=0``."""
    if not enabled() or type(optimizer) not in KINDS or torch.compiler.is_compiling():
        return []
    items = [(g, m, owner.get(m)) for g in optimizer.param_groups if exact_group(optimizer, g)
             for m in g["params"] if _master_kept(optimizer, m, owner.get(m))]
    return items if any(p is not None for _, _, p in items) else []  # fp32 ones only beside masters


def step_masters(optimizer, items) -> None:
    """One AdamW / Adam step of each O5 master of ``items`` (from `masters_to_step`),
    writing its bf16 model parameter too (where it has one)."""
    states = _advanced(optimizer, [m for _, m, _ in items], torch.float32)
    with torch.no_grad():  # the declared op reads the step count itself, as `step`'s
        for group, run in by_group((g, m, p, st) for (g, m, p), st in zip(items, states)):
            ops.master_steps_([(local(m), local(m.grad), local(st["exp_avg"]), local(st["exp_avg_sq"]), st["step"],
                                local(p)) for m, p, st in run], hyper(optimizer, group, 0.0))


def step_remainders(optimizer, params, grads: dict, remainders) -> None:
    """One AdamW / Adam step of each ``(group, p)`` of ``params`` (all `eligible` with
    float32 state), whose master is ``p`` with ``remainders[i]``."""
    states = _advanced(optimizer, [p for _, p in params], torch.float32)
    with torch.no_grad():  # the declared op reads the step count itself, as `step`'s
        for group, run in by_group((g, p, r, st) for (g, p), r, st in zip(params, remainders, states)):
            ops.remainder_steps_([(local(p), r, local(grads[p]), local(st["exp_avg"]), local(st["exp_avg_sq"]),
                                   st["step"]) for p, r, st in run], hyper(optimizer, group, 0.0))


def order_state(opt, ids: dict) -> None:
    """``opt.state``'s entries in the order of ``ids`` (tensor -> index), others last: the
    order torch's own step would have made them in."""
    entries = sorted(opt.state.items(), key=lambda kv: ids.get(kv[0], len(ids)))
    opt.state.clear()
    opt.state.update(entries)
