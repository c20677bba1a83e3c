"""O7's fused AdamW: ``torch.optim.AdamW`` / ``Adam`` steps on bf16 weights in one pass each.

At ``update_rounding="stochastic"`` (O7, with float32 or bfloat16 optimizer state) the
transient update hands the bf16 parameters of a plain ``torch.optim.AdamW`` or ``Adam``
(no amsgrad, capturable, differentiable or fused; bf16 gradients) to
``core/fused_adamw.py``: gradient, weight and state are read once and written once, with
the stochastic rounding inside, in place of fp32 copies stepped by the optimizer and
rounded back. The state stays torch's (``step``, ``exp_avg``, ``exp_avg_sq``, keyed by the
parameter), so checkpoints move between the two paths and plain torch. It runs on CPU
parameters (FSDP2's ``CPUOffloadPolicy`` included): the C kernel (``core/native.py``), or
without a C compiler the eager reference, with the same numbers. ``AMPKIT_FUSED=0`` turns the fused path off (every parameter goes
through the optimizer's own step).
"""
import os

import torch

from ..core import native
from ..core.fused_adamw import Hyper, step_
from .shards import global_index, like, local

KINDS = (torch.optim.AdamW, torch.optim.Adam)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def enabled() -> bool:
    return os.environ.get("AMPKIT_FUSED", "1") != "0"


def eligible(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor, state_dtype) -> bool:
    """Whether ``p`` of ``group`` steps here: a bf16 CPU parameter with a dense bf16 gradient of
    an exact AdamW / Adam whose group asks for nothing this kernel does not do, and state (if
    any) as this path keeps it. (On CUDA torch's own AdamW kernels stay: no fused kernel is
    written for CUDA yet, and the eager reference there is no faster than them.)"""
    if not plain(optimizer, group, p, grad):
        return False
    state = optimizer.state.get(p)
    if not state:
        return True
    dtype = state_dtype if state_dtype == torch.bfloat16 else torch.float32
    return (tuple(state) == STATE_KEYS and all(state[k].dtype == dtype and state[k].shape == p.shape for k in STATE_KEYS[1:])
            and not (torch.is_tensor(state["step"]) and state["step"].device.type != "cpu"))


def plain(optimizer, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``p`` is a bf16 CPU parameter with a dense bf16 gradient of an exact AdamW /
    Adam whose group asks for nothing the fused kernels do not do (whatever its state)."""
    if (type(optimizer) not in KINDS or p.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16 or grad.is_sparse
            or local(p).device.type != "cpu"):
        return False
    return not (group.get("amsgrad") or group.get("capturable") or group.get("differentiable") or group.get("fused"))


def step(optimizer, params, grads: dict, state_dtype, rounder, ids: dict) -> None:
    """One AdamW / Adam step of each ``(group, p)`` of ``params`` (all :func:`eligible`)."""
    lib = native.library()
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
        with torch.no_grad():
            step_(local(p), local(grads[p]), local(state["exp_avg"]), local(state["exp_avg_sq"]), hyper,
                  rounder.seed, rounder.step, ids[p], global_index(p), lib)
