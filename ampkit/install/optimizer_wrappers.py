"""Optimizer wrappers: objects that are not ``torch.optim.Optimizer`` but stand for one.

Apex's LARC and similar wrappers from other libraries hold an inner optimizer and expose
its ``param_groups`` and ``state`` with their own ``step`` and ``zero_grad``. ampkit takes
them wherever it takes an optimizer: masters go into the shared ``param_groups``, and the
wrapper's own ``step`` is what a skipped step skips.
"""
import torch
from torch import nn

__all__ = ["OptimizerLike", "is_optimizer_like"]


def is_optimizer_like(obj) -> bool:
    """True for a ``torch.optim.Optimizer``, or an object exposing a list of parameter-group
    dicts as ``param_groups``, a ``state`` mapping, and callable ``step``, ``zero_grad``
    and ``add_param_group``.

    ``fp16_utils.FP16_Optimizer`` is refused: it already manages masters and loss scaling
    (as Apex refused it in ``amp.initialize``).
    """
    if isinstance(obj, torch.optim.Optimizer):
        return True
    if isinstance(obj, (nn.Module, type)):
        return False
    if getattr(type(obj), "manages_loss_scaling", False):  # FP16_Optimizer
        return False
    try:
        groups, state = obj.param_groups, obj.state
    except AttributeError:
        return False
    return (
        isinstance(groups, list) and all(isinstance(g, dict) and "params" in g for g in groups)
        and hasattr(state, "__getitem__") and callable(getattr(obj, "step", None))
        and callable(getattr(obj, "zero_grad", None)) and callable(getattr(obj, "add_param_group", None))
    )


class _Meta(type):
    def __instancecheck__(cls, obj):
        return is_optimizer_like(obj)


class OptimizerLike(metaclass=_Meta):
    """``isinstance(obj, OptimizerLike)`` is :func:`is_optimizer_like`; never instantiated."""
