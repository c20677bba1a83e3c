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
        self.pending = False  # the last synchronizing forward ran without the reducer: reduce()
        self._muted = False

    def before_forward(self, ddp, args) -> None:
        """A synchronizing forward while earlier micro-batches' gradients are held: mute the reducer."""
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync and self._holds_gradients(ddp):
            ddp.require_backward_grad_sync = False
            self._muted = self.pending = True

    def after_forward(self, ddp, args, output) -> None:
        if self._muted:
            self._muted = False
            ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True

    def _holds_gradients(self, ddp) -> bool:
        return (any(p.grad is not None for p in ddp.module.parameters())
                or any(m.grad is not None for ms in self.model_states for m in ms.masters.values()))

    def reduce(self) -> None:
        """Average the window's gradients (fp32 masters' where they exist) over the ranks."""
        self.pending = False
        ddp = self.ddp()
        if ddp is None:
            return
        masters = {p: m for ms in self.model_states for p, m in ms.masters.items()}
        grads = [masters.get(p, p).grad for p in ddp.module.parameters() if p.requires_grad]
        reduction = getattr(ddp, "_ampkit_reduction", None) or _Average(ddp.process_group)
        groups = {}
        for g in grads:
            if g is not None:
                groups.setdefault((g.device, g.dtype, g.is_sparse), []).append(g)
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


def reduce_windows(states) -> None:
    """Reduce the windows whose synchronizing backward ampkit took over (see the module docstring)."""
    windows = {id(w): w for st in states for ms in st.model_states
               for w in [getattr(ms, "ddp_window", None)] if w is not None and w.pending}
    for w in windows.values():
        w.reduce()
