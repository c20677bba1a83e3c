"""Loss scaling for one loss: the scale, and the rules that move it.

A `LossScaler` is a small state machine over Python numbers (no tensors): the
decision whether gradients overflowed is made elsewhere, in one fused check with one
host synchronisation, and handed to `LossScaler.update`.
"""
import ctypes
import math
import sys
from typing import Optional

import torch

from .._config.levels import FLOAT32_RANGE, FLT_MAX, FLT_TINY, positive_finite
from .._kernels import native

__all__ = ["LossScaler", "copy_unscale_and_check_", "unscale_and_check_"]


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


CACHE_BLOCK = 2**18  # elements per CPU block: 1 MiB of fp32 and 512 KiB of half, read back from L2


def _flag(found_inf: dict, device: torch.device) -> torch.Tensor:
    flag = found_inf.get(device)
    if flag is None:
        flag = found_inf[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return flag


def _checkable(grad: torch.Tensor) -> torch.Tensor:
    """The dense real tensor that holds ``grad``'s numbers (sparse: its values, complex: a real view)."""
    if grad.is_sparse:
        grad = grad._values()
    return torch.view_as_real(grad) if grad.is_complex() else grad


def _local_shards(tensors) -> list:
    """Each DTensor (an FSDP2 gradient) as this rank's shard; other tensors as they are. The
    found-inf flags are agreed across ranks afterwards."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: there are no DTensors
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return tensors
    with torch.no_grad():
        return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def unscale_and_check_(grads, inv_scale: float, found_inf: dict) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and flag non-finite values.

    ``found_inf`` maps a device to a one-element float tensor that is set to 1 when any
    gradient on that device holds an inf or NaN. One fused foreach kernel runs per
    (device, dtype) group; nothing synchronises with the host.
    """
    groups = {}
    for g in map(_checkable, _local_shards(grads)):
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        if inv_scale == 1.0 and device.type == "cpu":
            group = _check_without_unscaling(group, _flag(found_inf, device))
        if group:
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, _flag(found_inf, device), inv)


EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}  # all ones: inf or NaN


def _check_without_unscaling(group: list, flag: torch.Tensor) -> list:
    """Flag the non-finite values of the large contiguous CPU tensors of ``group`` with one
    read each (the C kernel: unscaling by 1 would write them back unchanged); returns the
    tensors left to the unscaling kernel (all of them without the C kernels)."""
    lib = native.library()
    if lib is None or group[0].dtype not in EXPONENT:
        return group

    def fits(g):
        return g.is_contiguous() and g.numel() >= native.MIN_PER_THREAD

    exp, size = ctypes.c_uint32(EXPONENT[group[0].dtype]), ctypes.c_int(group[0].element_size())
    if any(lib.any_nonfinite(native.ptr(g), ctypes.c_int64(g.numel()), size, exp, native.threads(g.numel()))
           for g in group if fits(g)):  # reads only: it may stop at the first non-finite tensor
        flag.fill_(1.0)
    return [g for g in group if not fits(g)]


def _widen_and_unscale(dst: list, src: list, inv_scale: float, flag: torch.Tensor):
    """``dst[i] = src[i] * inv_scale`` for the large contiguous half ``src`` into float32 ``dst``,
    each in one pass of the C kernel that flags the non-finite results; returns the pairs
    left to torch's copy-and-unscale kernels (all of them without the C kernels)."""
    lib = native.library()

    def fits(d, s):
        return (s.dtype in (torch.bfloat16, torch.float16) and d.dtype == torch.float32 and d.is_contiguous()
                and s.is_contiguous() and d.numel() == s.numel() >= native.MIN_PER_THREAD)

    if lib is None:
        return dst, src
    found = [lib.widen_scaled(native.ptr(s), native.ptr(d), ctypes.c_int64(s.numel()), s.dtype == torch.float16,
                              ctypes.c_float(inv_scale), native.threads(s.numel()))
             for d, s in zip(dst, src) if fits(d, s)]  # every pair written, whatever the first ones hold
    if any(found):
        flag.fill_(1.0)
    left = [(d, s) for d, s in zip(dst, src) if not fits(d, s)]
    return [d for d, _ in left], [s for _, s in left]


def copy_unscale_and_check_(dst, src, inv_scale: float, found_inf: dict) -> None:
    """``dst[i] = src[i] * inv_scale`` (half gradients into fp32 buffers), flagging
    non-finite values in ``found_inf`` as `unscale_and_check_` does.

    A fused copy then a fused unscale-and-check, per device. On CPU they alternate block
    by block (about ``CACHE_BLOCK`` elements each), so the check reads what the copy has
    just written from cache instead of memory.
    """
    groups = {}
    for d, s in zip(dst, src):
        pair = groups.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for device, (ds, ss) in groups.items():
        flag = _flag(found_inf, device)
        if device.type == "cpu":
            ds, ss = _widen_and_unscale(ds, ss, inv_scale, flag)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        for block_d, block_s in (_cache_blocks(ds, ss) if device.type == "cpu" else [(ds, ss)]):
            torch._foreach_copy_(block_d, block_s)
            torch._amp_foreach_non_finite_check_and_unscale_(block_d, flag, inv)


def _cache_blocks(dst, src):
    """The ``(dst, src)`` pairs regrouped into lists of about ``CACHE_BLOCK`` elements;
    contiguous pairs larger than a block are split into flat views."""
    block_d, block_s, n = [], [], 0
    for d, s in zip(dst, src):
        if d.numel() > CACHE_BLOCK and d.is_contiguous() and s.is_contiguous():
            pieces = zip(torch.split(d.view(-1), CACHE_BLOCK), torch.split(s.view(-1), CACHE_BLOCK))
        else:
            pieces = ((d, s),)
        for pd, ps in pieces:
            block_d.append(pd)
            block_s.append(ps)
            n += pd.numel()
            if n >= CACHE_BLOCK:
                yield block_d, block_s
                block_d, block_s, n = [], [], 0
    if block_d:
        yield block_d, block_s
