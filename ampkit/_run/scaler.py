"""Loss scaling for one loss: the scale, and the rules that move it.

A `LossScaler` is a small state machine over Python numbers (no tensors): the
decision whether gradients overflowed is made elsewhere, in one fused check with one
host synchronisation (``_kernels/unscale.py``), and handed to `LossScaler.update`.
"""
import math
from typing import Optional

import torch

from .._config.levels import FLOAT32_RANGE, FLT_MAX, FLT_TINY, positive_finite

__all__ = ["LossScaler"]


class LossScaler:
    """The loss scale of one loss, static or dynamic.

    State:

    * ``scale``: the number the loss is multiplied by before ``backward``.
    * ``unskipped``: clean (finite) steps since the scale last changed; a dynamic scaler
      multiplies the scale by ``growth_factor`` when it reaches ``growth_interval``.
    * ``consecutive_overflows``: overflowing steps in a row; a dynamic scaler multiplies
      the scale by ``backoff_factor`` once it reaches ``hysteresis`` (1: every overflow).

    Every overflowing step is skipped, static or dynamic; only a dynamic scaler moves the
    scale. The scale is always kept within ``[min_loss_scale, max_loss_scale]``.

    Args:
        loss_scale: ``"dynamic"`` or a static positive scale.
        init_scale: the first scale of a dynamic scaler.
        growth_factor: a dynamic scale is multiplied by it after ``growth_interval`` clean steps in a row.
        backoff_factor: a dynamic scale is multiplied by it on overflow.
        growth_interval: clean steps in a row before a dynamic scale grows.
        min_loss_scale: lower bound of the dynamic scale.
        max_loss_scale: upper bound of the dynamic scale.
        hysteresis: consecutive overflows needed before the scale backs off.
    """

    def __init__(
        self,
        loss_scale="dynamic",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
        hysteresis: int = 1,
    ):
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic:
            positive_finite("loss_scale", loss_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = float(max_loss_scale)
        self.hysteresis = int(hysteresis)
        self.scale = self._clamp(init_scale) if self.dynamic else float(loss_scale)
        self.unskipped = 0
        self.consecutive_overflows = 0
        self.skipped_steps = 0
        self.warned = set()  # one-time health warnings already given (health.py)

    def _clamp(self, scale: float) -> float:
        scale = min(self.max_loss_scale, scale)
        if self.min_loss_scale is not None:
            scale = max(self.min_loss_scale, scale)
        # A scale that underflowed to 0 (or overflowed to inf) would end training silently.
        return min(max(scale, torch.finfo(torch.float32).tiny), torch.finfo(torch.float32).max)

    def loss_scale(self) -> float:
        return self.scale

    def update(self, overflow: bool) -> bool:
        """Record one step's outcome; return True when that step must be skipped."""
        if overflow:
            self.skipped_steps += 1
            self.unskipped = 0
            self.consecutive_overflows += 1
            if self.dynamic and self.consecutive_overflows >= self.hysteresis:
                self.scale = self._clamp(self.scale * self.backoff_factor)
            return True
        self.consecutive_overflows = 0
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.growth_interval:
            self.scale = self._clamp(self.scale * self.growth_factor)
            self.unskipped = 0
        return False

    def count_skip(self) -> None:
        """Count a step skipped for gradients that no ``scale_loss`` scaled (a backward outside
        it): they never carried this scale, so the scale and its streaks stay as they are."""
        self.skipped_steps += 1

    def snapshot(self) -> tuple:
        """Everything `update` changes, for `restore`."""
        return (self.scale, self.unskipped, self.consecutive_overflows, self.skipped_steps)

    def restore(self, snapshot: tuple) -> None:
        self.scale, self.unskipped, self.consecutive_overflows, self.skipped_steps = snapshot

    @property
    def at_floor(self) -> bool:
        """True when a dynamic scale can back off no further."""
        return self.dynamic and self.min_loss_scale is not None and self.scale <= self.min_loss_scale

    def state_dict(self) -> dict:
        """Apex's per-scaler format, plus the overflow streak when hysteresis is on."""
        out = {"loss_scale": self.scale, "unskipped": self.unskipped}
        if self.hysteresis > 1:
            out["consecutive_overflows"] = self.consecutive_overflows
        return out

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict` output; a dynamic scale outside ``[min_loss_scale,
        max_loss_scale]`` is clamped into it (the bounds of this run win)."""
        self.scale = self._clamp(float(state["loss_scale"])) if self.dynamic else float(state["loss_scale"])
        self.unskipped = int(state["unskipped"])
        self.consecutive_overflows = int(state.get("consecutive_overflows", 0))

    @staticmethod
    def check_state(name: str, state) -> None:
        """Raise a ValueError if ``state`` is not a valid per-scaler state dict."""
        if not isinstance(state, dict) or "loss_scale" not in state or "unskipped" not in state:
            raise ValueError(f"{name}: expected a dict with 'loss_scale' and 'unskipped', got {state!r}.")
        scale, unskipped = state["loss_scale"], state["unskipped"]
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                or not FLT_TINY <= scale <= FLT_MAX):
            raise ValueError(f"{name}['loss_scale']={scale!r}: expected a positive finite number {FLOAT32_RANGE}.")
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(f"{name}['unskipped']={unskipped!r}: expected a non-negative integer.")
        streak = state.get("consecutive_overflows", 0)
        if isinstance(streak, bool) or not isinstance(streak, int) or streak < 0:
            raise ValueError(f"{name}['consecutive_overflows']={streak!r}: expected a non-negative integer.")
