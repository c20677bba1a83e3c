"""One overflow decision: the found-inf flags of an unscale, reduced to one host sync."""
import logging
from typing import List, Optional

import torch

from . import health, registry
from .scaler import LossScaler


class OverflowCheck:
    """Decides, once, whether the gradients an unscale checked hold inf/NaN; updates the
    scaler and tells each optimizer state the outcome (see ``OptimizerState.record``)."""

    def __init__(self, run, scaler: Optional[LossScaler], states):
        self.run = run
        self.scaler = scaler
        self.states = states
        self.found_inf = {}  # device -> found-inf flag tensor
        self.done = False
        self.consumed = False  # an optimizer stepped after this check
        self.before = self.after = None  # the state of ``moved`` around its update
        self.moved: Optional[LossScaler] = None  # the scaler this check updated (or counted a skip on)

    @property
    def loss_id(self) -> int:
        return self.run.scalers.index(self.scaler) if self.scaler is not None else -1

    def rollback(self) -> None:
        """The batch was dropped (``zero_grad`` with no ``step``): undo the scaler update,
        unless a later check has moved the scaler since."""
        if not self.consumed and self.moved is not None and self.moved.snapshot() == self.after:
            self.moved.restore(self.before)
        self.consumed = True

    def resolve(self) -> bool:
        """Decide (once): update the scaler, record the outcome on every state; True on overflow."""
        if self.done:
            return False
        self.done = True
        overflow = bool(all_ranks_max(self._flag()).item())
        names = nonfinite_names(self.run, self.states) if overflow else []  # looked for only on an overflow
        self.run.nonfinite = names
        pinned = self.scaler is not None and self.scaler.at_floor
        if self.scaler is not None:
            self._move(self.scaler, lambda: self.scaler.update(overflow))
            health.after_update(self.run, self.loss_id, self.scaler, names)
        elif overflow and self.run.scalers:  # gradients no scale_loss checked: counted on loss 0, scale kept
            self._move(self.run.scalers[0], self.run.scalers[0].count_skip)
        for st in self.states:
            st.record(self, overflow, names)
        if overflow:
            self._report(pinned)
        return overflow

    def _move(self, scaler: LossScaler, update) -> None:
        self.moved, self.before = scaler, scaler.snapshot()
        update()
        self.after = scaler.snapshot()

    def _flag(self) -> torch.Tensor:
        flags = list(self.found_inf.values())
        if not flags:
            return torch.zeros(1, device=self.run.device_type)
        return flags[0] if len(flags) == 1 else sum(f.to(flags[0].device) for f in flags)

    def _report(self, pinned: bool) -> None:
        run, i = self.run, self.loss_id
        if self.scaler is None:
            run.log("Gradient overflow in gradients computed outside scale_loss. Skipping step (counted in loss "
                    "scaler 0's skipped_steps; no loss scale changes: these gradients carried none).")
        elif self.scaler.dynamic:
            run.log("Gradient overflow. Skipping step, loss scaler %d reducing loss scale to %s", i, self.scaler.loss_scale())
            if pinned and i not in run.floor_warned:
                run.floor_warned.add(i)
                run.log("Loss scaler %d is pinned at min_loss_scale=%s and gradients still overflow: "
                        "training is not progressing. Look for inf/NaN in the forward pass.",
                        i, self.scaler.min_loss_scale, level=logging.WARNING)
        else:
            run.log("Gradient overflow. Skipping step, loss scaler %d keeps its static loss scale %s "
                    "(non-finite gradients are never applied)", i, self.scaler.loss_scale())


def nonfinite_names(run, states) -> List[str]:
    """The parameters (as ``model.named_parameters()`` names them) whose gradients hold inf/NaN;
    with several models, ``models[i].name``; unnamed ones as ``param_groups[g][i]``."""
    name_of = parameter_names(run)
    found = []
    for st in states:
        for g, group in enumerate(st.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and not _finite(p.grad):
                    found.append(name_of.get(st.owner.get(p, p), f"param_groups[{g}][{i}]"))
    return list(dict.fromkeys(found))


def parameter_names(run) -> dict:
    """Each model parameter -> its name in ``model.named_parameters()`` (``models[i].name``
    with several models)."""
    models = registry.models_of(run)
    name_of = {}
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            name_of.setdefault(p, name if len(models) == 1 else f"models[{i}].{name}")
    return name_of


def _finite(grad: torch.Tensor) -> bool:
    grad = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor shard: this rank's part
    values = grad.coalesce()._values() if grad.is_sparse else grad
    return bool(torch.isfinite(values).all())


def all_ranks_max(flag: torch.Tensor) -> torch.Tensor:
    """MAX-reduce ``flag`` over the default process group, so every rank skips together, on
    `collective_device` (one element to the accelerator and back for the CPU gradient
    shards of FSDP2's ``CPUOffloadPolicy`` under NCCL alone)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(collective_device(flag.device), copy=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def collective_device(device: torch.device, group=None) -> torch.device:
    """Where a collective over ``group`` (None: the default group) runs for a tensor on
    ``device``: see `device_for`, with the group's backend config and the current
    accelerator."""
    backends = torch.distributed.get_backend_config(group)
    return device_for(device, backends, torch.accelerator.current_accelerator(check_available=True))


def device_for(device: torch.device, backends: str, accelerator: Optional[torch.device]) -> torch.device:
    """``device`` when a group whose backend config is ``backends`` reduces tensors there, else
    ``accelerator`` (the current one; None when there is none, and then ``device``, whose
    collective fails with torch's own error)."""
    return device if has_backend(device.type, backends) or accelerator is None else accelerator


def has_backend(device_type: str, backends: str) -> bool:
    """Whether a process group whose ``dist.get_backend_config()`` is ``backends`` (``"cuda:nccl"``,
    ``"cpu:gloo,cuda:nccl"``) reduces tensors on ``device_type``."""
    return device_type in {b.split(":")[0] for b in backends.split(",")}
