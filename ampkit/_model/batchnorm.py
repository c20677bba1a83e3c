"""BatchNorm under mixed precision: float32 BatchNorm taking half input, and half BatchNorm."""
import warnings

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._common.errors import NoEffectWarning

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Device types whose batch_norm kernels take half input with float32 weights and running
# statistics in train and eval mode (output in the input dtype). Elsewhere the input is
# cast to float32 around the call.
NATIVE_MIXED_DEVICES = frozenset({"cpu", "cuda"})
_TAG = "_ampkit_input_dtype"


def _float_tensors(module: nn.Module):
    return [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)) if t.dtype.is_floating_point]


def _needs_cast(module: nn.Module, args) -> bool:
    x = args[0] if args else None
    return (
        isinstance(x, torch.Tensor)
        and x.dtype in HALF_DTYPES
        and x.device.type not in NATIVE_MIXED_DEVICES
        and any(t.dtype == torch.float32 for t in _float_tensors(module))
    )


class CastInputToFloat:
    """Forward pre-hook: half input of a float32 BatchNorm becomes float32, tagged with its dtype."""

    def __call__(self, module, args):
        if not _needs_cast(module, args):
            return None
        x = args[0]
        x32 = x.float()
        setattr(x32, _TAG, x.dtype)
        return (x32,) + tuple(args[1:])


class CastOutputBack:
    """Forward hook: the output of a call whose input `CastInputToFloat` cast goes back to that dtype."""

    def __call__(self, module, args, output):
        dtype = getattr(args[0], _TAG, None) if args else None
        return None if dtype is None else output.to(dtype)


CastInputToFloat.__module__ = CastOutputBack.__module__ = "ampkit.normalization.batchnorm"  # the pickle path


def enable_mixed_input_batchnorm(module: nn.Module) -> int:
    """Let every float32 BatchNorm in ``module`` take float16/bfloat16 input, in train and eval.

    Output dtype equals input dtype; running statistics stay float32 and are updated only
    in train mode; memory format is preserved. CPU and CUDA run this natively; on other
    device types the input is cast to float32 around the call. Idempotent. Returns the
    number of BatchNorm layers (1d/2d/3d, SyncBatchNorm, ...) whose floating parameters
    and buffers are all float32, all of which now accept half input.
    """
    count = 0
    for m in module.modules():
        if not isinstance(m, _BatchNorm) or any(t.dtype != torch.float32 for t in _float_tensors(m)):
            continue
        if not any(isinstance(h, CastInputToFloat) for h in m._forward_pre_hooks.values()):
            m.register_forward_pre_hook(CastInputToFloat())
            m.register_forward_hook(CastOutputBack())
        count += 1
    return count


def convert_batchnorm(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every BatchNorm's floating parameters and buffers to ``dtype``, in place.

    Parameter objects are kept (optimizers stay valid); ``num_batches_tracked`` stays an
    integer. Returns ``model`` (as ``convert_syncbn_model`` does); a model without
    BatchNorm is returned unchanged with a `ampkit.NoEffectWarning`.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"convert_batchnorm(dtype={dtype!r}): expected a floating torch.dtype.")
    count = 0
    for m in model.modules():
        if not isinstance(m, _BatchNorm):
            continue
        for p in m.parameters(recurse=False):
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
        for name, b in m.named_buffers(recurse=False):
            if b.dtype.is_floating_point:
                setattr(m, name, b.to(dtype))
        count += 1
    if count == 0:
        warnings.warn("convert_batchnorm: the model has no BatchNorm layer; nothing converted.", NoEffectWarning, stacklevel=2)
    return model
