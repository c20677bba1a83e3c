"""Apex O1's float32 list on top of ``torch.autocast``, for those who need Apex's numerics.

O1/O4 follow torch's autocast op lists, which differ per device from what Apex O1 patched
(on CPU, for example, softmax, sum and pow run in the autocast dtype when given it).
`use_apex_fp32_list` makes the functions on Apex O1's float32 list (softmax,
log_softmax, sum, pow, exp, log, norms, losses, ...) run in float32 inside the regions
where ampkit autocasts: an initialized model's forward and ``ampkit.autocast()`` blocks.
It works through a ``TorchFunctionMode`` entered only in those regions; torch itself is
never patched. In-place variants (``x **= 2``) are left alone: a half tensor cannot be
computed on in float32 in place.
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._config.levels import HALF_DTYPES
from .autocast_devices import active_device

__all__ = ["use_apex_fp32_list", "apex_fp32_list_enabled", "APEX_FP32_FUNCTIONAL", "APEX_FP32_TORCH", "apex_fp32_region",
           "in_apex_fp32_region"]

# Apex O1's float32 list (apex/amp/lists at its last release), by name.
APEX_FP32_FUNCTIONAL = (
    "interpolate", "softplus", "softmin", "log_softmax", "softmax", "layer_norm", "group_norm",
    "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
)
APEX_FP32_TORCH = (  # torch.X and, where it exists, Tensor.X
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm",
)
_APEX_FP32_TENSOR = ("__pow__", "__rpow__", "cpu")
# torch's own spellings of the functional softmaxes, so nn.Softmax, torch.softmax and x.softmax agree
_SAME_AS_FUNCTIONAL = ("softmax", "log_softmax")


def _functions():
    out = {getattr(F, n) for n in APEX_FP32_FUNCTIONAL}
    for name in APEX_FP32_TORCH + _SAME_AS_FUNCTIONAL:
        for owner in (torch, torch.Tensor):
            fn = getattr(owner, name, None)
            if fn is not None:
                out.add(fn)
    out.update(getattr(torch.Tensor, n) for n in _APEX_FP32_TENSOR)
    return frozenset(out)


_FP32 = _functions()
_enabled = False


def use_apex_fp32_list(enabled: bool = True) -> bool:
    """Turn Apex O1's float32 list on (or off) for ampkit's autocast regions; the previous setting.

    Process-wide; it takes effect at the next model forward or ``ampkit.autocast()`` block.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"use_apex_fp32_list(enabled={enabled!r}): expected True or False.")
    previous, _enabled = _enabled, enabled
    return previous


def apex_fp32_list_enabled() -> bool:
    return _enabled


def _float32(obj):
    if torch.is_tensor(obj):
        return obj.float() if obj.is_floating_point() and obj.dtype in HALF_DTYPES else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_float32(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _float32(v) for k, v in obj.items()}
    return obj


class _ApexFp32Mode(TorchFunctionMode):
    """Run the functions of Apex's float32 list in float32 while autocast is on for their inputs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FP32:
            device = active_device(args, kwargs)
            if device is not None:
                with torch.autocast(device, enabled=False):
                    return func(*_float32(args), **_float32(kwargs))
        return func(*args, **kwargs)


def in_apex_fp32_region(fn, args, kwargs):
    """``fn(*args, **kwargs)``, inside the float32-list mode when switched on (the model's forward).

    A call, not a second context manager beside the model's autocast: torch.compile does not
    trace a nullcontext nested in the autocast block of the same ``with``.
    """
    if not _enabled:
        return fn(*args, **kwargs)
    with _ApexFp32Mode():
        return fn(*args, **kwargs)


def apex_fp32_region():
    """The context ampkit's autocast regions enter: the float32-list mode when switched on."""
    return _ApexFp32Mode() if _enabled else contextlib.nullcontext()
