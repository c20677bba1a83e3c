"""Gradient accumulation under DDP: each step reduces its whole window's sum, once.

Torch's DDP reduces what ``.grad`` holds when a synchronizing backward runs: after
micro-batches under ``no_sync()`` it expects their sum to be there. ``scale_loss`` keeps
earlier micro-batches out of ``.grad`` (clean ones set aside while a scaled backward runs,
half ones summed into fp32 master gradients), so the reducer would see the last
micro-batch alone and each rank would step on its own sum. Instead, a synchronizing
forward that starts while the model already holds gradients runs without the reducer (as
under ``no_sync``), and ampkit reduces the window's sum once the backward's gradients are
unscaled (at the end of ``scale_loss``, or before ``step()``): one reduction per step, in
fp32 where master gradients hold the sum. A step of one micro-batch keeps the reducer
and its overlap with backward.
"""
import weakref
from typing import List

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class Window:
    """The accumulation window of one DDP module (``ddp._ampkit_window``)."""

    def __init__(self, ddp: torch.nn.Module):
        self.ddp = weakref.ref(ddp)
        self.model_states: List = []  # the ampkit models inside ddp.module
        self.muted = False  # the last forward ran without the reducer: ampkit reduces its backwards
        self.stale = False  # a backward wrote local gradients since the last reduce()

    def before_forward(self, ddp, args) -> None:
        """A synchronizing forward while earlier micro-batches' gradients are held: mute the reducer."""
        self.muted = self.stale = (torch.is_grad_enabled() and ddp.require_backward_grad_sync
                                   and self._holds_gradients(ddp))
        if self.muted:
            ddp.require_backward_grad_sync = False

    def after_forward(self, ddp, args, output) -> None:
        """The forward ``before_forward`` muted is over: DDP synchronizes again, as it was asked to."""
        if self.muted:
            ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True

    def _holds_gradients(self, ddp) -> bool:
        return (any(p.grad is not None for p in ddp.module.parameters())
                or any(m.grad is not None for ms in self.model_states for m in ms.masters.values()))

    def reduce(self, stepped: set) -> None:
        """Average over the ranks the gradients of the parameters in ``stepped`` (the optimizers'
        whose backward ended: fp32 masters where they exist): every rank calls the same collectives."""
        self.stale = False
        ddp = self.ddp()
        if ddp is None:
            return
        masters = {p: m for ms in self.model_states for p, m in ms.masters.items()}
        params = [masters.get(p, p) for p in ddp.module.parameters() if p.requires_grad and masters.get(p, p) in stepped]
        if ddp.find_unused_parameters:  # a parameter another rank used gets the average; one no rank used stays None
            used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
            torch.distributed.all_reduce(used, op=torch.distributed.ReduceOp.MAX, group=ddp.process_group)
            params = [p for p, u in zip(params, used.tolist()) if u]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        reduction = getattr(ddp, "_ampkit_reduction", None) or _Average(ddp.process_group)
        groups = {}
        for p in params:
            groups.setdefault((p.grad.device, p.grad.dtype, p.grad.is_sparse), []).append(p.grad)
        for (_, _, sparse), group in groups.items():
            if sparse:
                for g in group:
                    g.copy_(reduction.reduce(g.coalesce()).wait())
                continue
            flat = _flatten_dense_tensors(group)
            reduction.reduce(flat).wait()
            for g, reduced in zip(group, _unflatten_dense_tensors(flat, group)):
                g.copy_(reduced)


class _Average:
    """Torch DDP's own arithmetic for a DDP ampkit did not build: divide by the world size, sum."""

    def __init__(self, group):
        self.group = group

    def reduce(self, t: torch.Tensor):
        dist = torch.distributed
        t.div_(dist.get_world_size(self.group))
        return dist.all_reduce(t, group=self.group, async_op=True).get_future().then(lambda _: t)


def watch(ddp: torch.nn.Module, model_state) -> None:
    """Follow ``ddp``'s accumulation windows for the ampkit model ``model_state`` belongs to."""
    window = ddp.__dict__.get("_ampkit_window")
    if window is None:
        window = Window(ddp)
        ddp.__dict__["_ampkit_window"] = window
        ddp.register_forward_pre_hook(window.before_forward)
        ddp.register_forward_hook(window.after_forward, always_call=True)
    if model_state not in window.model_states:
        window.model_states.append(model_state)
        model_state.ddp_window = window


def watch_active(model_state) -> None:
    """Inside a model's forward: follow the DDP module running it, if one is (torch's own
    ``DistributedDataParallel`` around an initialized model, as ``accelerator.prepare`` builds)."""
    ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
    window = model_state.ddp_window
    if ddp is not None and (window is None or window.ddp() is not ddp):
        watch(ddp, model_state)


def mark_windows(states) -> None:
    """A backward begins (``scale_loss``): after a muted forward, its gradients are ampkit's to reduce."""
    for w in _windows(states):
        w.stale = w.muted


def reduce_windows(states) -> None:
    """Reduce the gradients of ``states``' optimizers that a muted forward's backward wrote (see the
    module docstring)."""
    stepped = {p for st in states for p in st.step_params()}
    for w in _windows(states):
        if w.stale:
            w.reduce(stepped)


def _windows(states):
    return list({id(w): w for st in states for ms in st.model_states
                 for w in [getattr(ms, "ddp_window", None)] if w is not None}.values())
