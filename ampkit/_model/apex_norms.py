"""Apex's ``apex.normalization`` classes on PyTorch's own ``F.layer_norm`` / ``F.rms_norm``."""
import contextlib
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .._common.errors import NoEffectWarning
from .layer_norm import autocast_dtype


class _FusedNorm(nn.Module):
    """Apex's constructor and dtype rules; subclasses name their parameters and normalize.

    Plain variants compute in the autocast dtype under autocast, else in the input's
    dtype (parameters are cast to it). Mixed variants compute in float32 and return the
    input's dtype, so float32 parameters take half input.
    """

    param_names = ("weight", "bias")
    mixed = False

    @property
    def keeps_float32_params(self) -> bool:
        """Mixed variants are left float32 when ``initialize`` casts a model to half."""
        return self.mixed

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, memory_efficient: bool = False):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = torch.Size(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if memory_efficient:
            warnings.warn(
                f"{type(self).__name__}(memory_efficient=True) has no effect: PyTorch's kernel decides what it saves for backward.",
                NoEffectWarning,
                stacklevel=2,
            )
        for name in self.param_names:
            init = torch.ones if name == "weight" else torch.zeros
            self.register_parameter(name, nn.Parameter(init(self.normalized_shape)) if elementwise_affine else None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        auto = autocast_dtype(device)
        dtype = torch.float32 if self.mixed else auto or input.dtype
        params = [None if p is None else p.to(dtype) for p in (getattr(self, n) for n in self.param_names)]
        with torch.autocast(device, enabled=False) if auto else contextlib.nullcontext():
            out = self._normalize(input.to(dtype), *params)
        return out.to(input.dtype) if self.mixed else out

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedLayerNorm(_FusedNorm):
    """``apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, memory_efficient=False)``."""

    def _normalize(self, x, weight, bias):
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class FusedRMSNorm(_FusedNorm):
    """``apex.normalization.FusedRMSNorm``: ``x * rsqrt(mean(x**2) + eps) * weight``; no bias.

    Args: ``normalized_shape`` (trailing shape normalized over), ``eps``,
    ``elementwise_affine`` (learn ``weight``), ``memory_efficient`` (accepted, as in Apex).
    """

    param_names = ("weight",)

    def _normalize(self, x, weight):
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def _mixed_kwargs(cls_name: str, kwargs: dict) -> None:
    """Apex's Mixed* accept ``elementwise_affine`` only to refuse False; anything else is a TypeError."""
    if "elementwise_affine" in kwargs:
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`")
        warnings.warn(f"{cls_name} does not support `elementwise_affine` argument; it is always affine.", NoEffectWarning, stacklevel=3)
    if kwargs:
        raise TypeError(f"{cls_name}() got unexpected keyword argument(s) {sorted(kwargs)}.")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Always-affine `FusedLayerNorm` that computes in float32 and returns the input dtype.

    Args: ``normalized_shape``, ``eps``, ``memory_efficient`` as `FusedLayerNorm`.
    """

    mixed = True

    def __init__(self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs):
        _mixed_kwargs(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """Always-affine `FusedRMSNorm` that computes in float32 and returns the input dtype.

    Args: ``normalized_shape``, ``eps``, ``memory_efficient`` as `FusedRMSNorm`.
    """

    mixed = True

    def __init__(self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs):
        _mixed_kwargs(type(self).__name__, kwargs)
        super().__init__(normalized_shape, eps, True, memory_efficient)
