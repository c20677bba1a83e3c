"""O7's fused AdamW: ``torch.optim.AdamW`` / ``Adam`` steps on bf16 weights in one pass each.

At ``update_rounding="stochastic"`` (O7, with float32 or bfloat16 optimizer state) the
transient update hands the bf16 parameters of a plain ``torch.optim.AdamW`` or ``Adam``
(no amsgrad, capturable, differentiable or fused; bf16 gradients) to
``core/fused_adamw.py``: gradient, weight and state are read once and written once, with
the stochastic rounding inside, in place of fp32 copies stepped by the optimizer and
rounded back. The state stays torch's (``step``, ``exp_avg``, ``exp_avg_sq``, keyed by the
parameter), so checkpoints move between the two paths and plain torch. CPU parameters
(FSDP2's ``CPUOffloadPolicy`` included) step in the C kernel (``core/native.py``), or
without a C compiler in the eager reference; CUDA (and other Triton device) parameters in
one ``torch.compile`` kernel per tensor (``core/compiled_update.py``) where Triton is
installed: the same numbers on every path. ``AMPKIT_FUSED=0`` turns the fused path off
(every parameter goes through the optimizer's own step), ``AMPKIT_COMPILED_UPDATE=0`` the
compiled one (accelerator parameters then take the optimizer's step).
"""
import os

import torch

from ..core import compiled_update, native
from ..core.fused_adamw import Hyper, step_
from .shards import global_index, like, local

KINDS = (torch.optim.AdamW, torch.optim.Adam)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def enabled() -> bool:
    return os.environ.get("AMPKIT_FUSED", "1") != "0"


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor, state_dtype) -> bool:
    """Whether ``p`` of ``group`` steps here: a bf16 parameter on CPU or where the compiled
    kernel runs (``compiled_update.available``: CUDA with Triton), with a dense bf16 gradient, of
    an exact AdamW / Adam whose group asks for nothing this kernel does not do, and state (if
    any) as this path keeps it. (Elsewhere torch's own AdamW kernels stay: the eager
    reference off CPU is no faster than them.)"""
    if type(optimizer) not in KINDS or p.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16 or grad.is_sparse:
        return False
    device = local(p).device
    if device.type != "cpu" and not compiled_update.available(device):
        return False
    if group.get("amsgrad") or group.get("capturable") or group.get("differentiable") or group.get("fused"):
        return False
    state = optimizer.state.get(p)
    if not state:
        return True
    dtype = state_dtype if state_dtype == torch.bfloat16 else torch.float32
    return (tuple(state) == STATE_KEYS and all(state[k].dtype == dtype and state[k].shape == p.shape for k in STATE_KEYS[1:])
            and not (torch.is_tensor(state["step"]) and state["step"].device.type != "cpu"))


def step(optimizer, params, grads: dict, state_dtype, rounder, ids: dict) -> None:
    """One AdamW / Adam step of each ``(group, p)`` of ``params`` (all :func:`eligible`)."""
    dtype = state_dtype if state_dtype == torch.bfloat16 else torch.float32
    for group, p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for k in STATE_KEYS[1:]:
                state[k] = like(torch.zeros_like(local(p), dtype=dtype, memory_format=torch.preserve_format), p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = Hyper(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                      group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW),
                      bool(group.get("maximize", False)), state["step"].item())
        args = (local(p), local(grads[p]), local(state["exp_avg"]), local(state["exp_avg_sq"]), hyper,
                rounder.seed, rounder.step, ids[p], global_index(p))
        with torch.no_grad():
            if compiled_update.available(args[0].device):
                compiled_update.step_(*args)
            else:
                step_(*args, native.library() if args[0].device.type == "cpu" else None)
