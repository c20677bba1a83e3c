"""Dtype casts of nested inputs/outputs and of a model's parameters and buffers."""
import copy
import functools
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def cast_tree(obj, dtype: torch.dtype):
    """Return ``obj`` with every floating tensor inside it cast to ``dtype``.

    Walks tuples (named tuples too), lists and dicts; objects that are not tensors but
    define ``.to(dtype)`` (custom batch types) are converted with it. Integer and bool
    tensors, strings, None, numbers and anything else come back unchanged, and the
    container structure is preserved.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if obj is None or isinstance(obj, (str, bytes, int, float, complex, bool)):
        return obj
    if type(obj) is dict:  # the common case, and one torch.compile traces without a break
        return {key: cast_tree(value, dtype) for key, value in obj.items()}
    if isinstance(obj, dict):  # a dict subclass keeps its type and attributes
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = cast_tree(value, dtype)
        return out
    if isinstance(obj, Mapping):
        return {key: cast_tree(value, dtype) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_tree(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_tree(v, dtype) for v in obj)
    if not isinstance(obj, nn.Module) and callable(getattr(obj, "to", None)):
        return obj.to(dtype)
    return obj


def is_batchnorm(module: nn.Module) -> bool:
    """Any BatchNorm layer (``_BatchNorm``: 1d/2d/3d, SyncBatchNorm, lazy ones), affine or not."""
    return isinstance(module, _BatchNorm)


def cast_module_(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> int:
    """Cast floating parameters and buffers of ``model`` to ``dtype`` in place.

    Parameter objects keep their identity (``param.data`` is replaced), so optimizers
    that hold them stay valid. With ``keep_batchnorm_fp32`` every BatchNorm layer is
    left in float32, and so is any module whose ``keeps_float32_params`` is true (the
    Mixed* norms). Returns the number of tensors cast.
    """
    count = 0
    for module in model.modules():
        keep = (keep_batchnorm_fp32 and is_batchnorm(module)) or getattr(module, "keeps_float32_params", False)
        target = torch.float32 if keep else dtype
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
                if param.grad is not None:
                    param.grad = param.grad.to(target)
                count += 1
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != target:
                module._buffers[name] = buf.to(target)
                count += 1
    return count


def check_sparse_embeddings(models, dtype) -> None:
    """Refuse embeddings with sparse gradients that a cast to ``dtype`` would make untrainable:
    PyTorch cannot add sparse ``dtype`` gradients on their device (float16 on CPU), and autograd
    adds them whenever the embedding is used twice in one forward."""
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and weight is not None):
                continue
            if weight.is_floating_point() and not _sparse_add_works(dtype, weight.device):
                where = (name or type(module).__name__) if len(models) == 1 else f"models[{i}].{name}"
                raise ValueError(
                    f"initialize(models=...): {where}.weight has sparse gradients (sparse=True), and PyTorch cannot "
                    f"add sparse {dtype} gradients on {weight.device.type}, which this opt level would cast it to. "
                    f"Use an opt level that keeps the weights float32 (O0, O1, O4), bfloat16 (O5), or sparse=False."
                )


@functools.lru_cache(maxsize=None)
def _sparse_add_works(dtype, device) -> bool:
    one = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=dtype), (1,),
                                  device=device, check_invariants=True)
    try:
        one + one
    except (NotImplementedError, RuntimeError):
        return False
    return True
