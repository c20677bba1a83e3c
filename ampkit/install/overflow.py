"""One overflow decision: the found-inf flags of an unscale, reduced to one host sync."""
import logging
from typing import Optional

import torch

from ..core.scaler import LossScaler
from . import health


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
        self.before = self.after = None  # the scaler's state around its update

    @property
    def loss_id(self) -> int:
        return self.run.scalers.index(self.scaler) if self.scaler is not None else -1

    def rollback(self) -> None:
        """The batch was dropped (``zero_grad`` with no ``step``): undo the scaler update,
        unless a later check has moved the scaler since."""
        if not self.consumed and self.after is not None and self.scaler.snapshot() == self.after:
            self.scaler.restore(self.before)
        self.consumed = True

    def resolve(self) -> bool:
        """Decide (once): update the scaler, record the outcome on every state; True on overflow."""
        if self.done:
            return False
        self.done = True
        overflow = bool(_all_ranks_max(self._flag()).item())
        pinned = self.scaler is not None and self.scaler.at_floor
        if self.scaler is not None:
            self.before = self.scaler.snapshot()
            self.scaler.update(overflow)
            self.after = self.scaler.snapshot()
            health.after_update(self.run, self.loss_id, self.scaler)
        for st in self.states:
            st.record(self, overflow)
        if overflow:
            self._report(pinned)
        return overflow

    def _flag(self) -> torch.Tensor:
        flags = list(self.found_inf.values())
        if not flags:
            return torch.zeros(1, device=self.run.device_type)
        return flags[0] if len(flags) == 1 else sum(f.to(flags[0].device) for f in flags)

    def _report(self, pinned: bool) -> None:
        run, i = self.run, self.loss_id
        if self.scaler is None:
            run.log("Gradient overflow in gradients computed outside scale_loss. Skipping step.")
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


def _all_ranks_max(flag: torch.Tensor) -> torch.Tensor:
    """MAX-reduce ``flag`` over the default process group, so every rank skips together."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag
