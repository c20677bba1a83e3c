"""Low-precision LayerNorm: keep LayerNorm in the autocast dtype instead of float32."""
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .._common.errors import NoEffectWarning
from .surgery import replace_module_classes

_AMP = ("amp_fp16", "amp_bf16", torch.float16, torch.bfloat16)
# Known precisions without fp16/bf16 autocast (Composer's fp32, amp_fp8; full-precision dtypes):
# accepted, but LPLayerNorm would change nothing there.
_NO_EFFECT = ("fp32", "amp_fp8", torch.float32, torch.float64)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype of ``device_type`` if autocast is on there, else None."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class LPLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that, under autocast, runs in the autocast dtype (not float32).

    Input, weight and bias are cast to the autocast dtype of the input's device type
    and ``layer_norm`` runs with autocast off; outside autocast this is ``nn.LayerNorm``.
    Constructor arguments (``normalized_shape``, ``eps``, ``elementwise_affine``, ...) are
    ``nn.LayerNorm``'s.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(input.device.type)
        if dtype is None:
            return super().forward(input)
        weight = None if self.weight is None else self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(input.device.type, enabled=False):
            return F.layer_norm(input.to(dtype), self.normalized_shape, weight, bias, self.eps)


def _to_lp(module: nn.LayerNorm, name: str) -> LPLayerNorm:
    """An LPLayerNorm holding ``module``'s own Parameter objects (optimizers stay valid)."""
    new = LPLayerNorm(
        module.normalized_shape, module.eps, module.elementwise_affine, bias=module.bias is not None, device="meta"
    )
    new.weight = module.weight
    new.bias = module.bias
    return new.train(module.training)


def _accepted() -> str:
    return ", ".join(repr(p) for p in _AMP + _NO_EFFECT)


def apply_low_precision_layernorm(model: nn.Module, precision, optimizers=None) -> nn.Module:
    """Replace every ``nn.LayerNorm`` (exact class) in ``model`` with an `LPLayerNorm`, in place.

    ``precision`` is ``"amp_fp16"``, ``"amp_bf16"``, ``torch.float16`` or ``torch.bfloat16``.
    ``"fp32"``, ``"amp_fp8"``, ``torch.float32`` and ``torch.float64`` are accepted but change
    nothing (NoEffectWarning), as does a model without LayerNorm. Parameters are reused, so
    optimizers and fp32 master weights stay valid; ``optimizers`` is passed on to
    `ampkit.surgery.replace_module_classes`.
    """
    if not (isinstance(precision, (str, torch.dtype)) and precision in _AMP + _NO_EFFECT):
        raise ValueError(f"apply_low_precision_layernorm(precision={precision!r}): unknown precision; accepted values are {_accepted()}.")
    if precision in _NO_EFFECT:
        warnings.warn(
            f"apply_low_precision_layernorm(precision={precision!r}) has no effect: low-precision LayerNorm "
            f"only applies to 'amp_fp16' and 'amp_bf16' (torch.float16, torch.bfloat16).",
            NoEffectWarning,
            stacklevel=2,
        )
        return model
    counts = replace_module_classes(model, {nn.LayerNorm: _to_lp}, optimizers)
    if not counts:
        warnings.warn("apply_low_precision_layernorm: the model has no torch.nn.LayerNorm submodule; nothing replaced.", NoEffectWarning, stacklevel=2)
    return model
