"""Optimizer wrappers: objects that are not ``torch.optim.Optimizer`` but stand for one.

Apex's LARC and similar wrappers from other libraries hold an inner optimizer and expose
its ``param_groups`` and ``state`` with their own ``step`` and ``zero_grad``. ampkit takes
them wherever it takes an optimizer: masters go into the shared ``param_groups``, and the
wrapper's own ``step`` is what a skipped step skips.

Training frameworks wrap the optimizer once more (Lightning's ``LightningOptimizer``,
Fabric's ``_FabricOptimizer``, accelerate's ``AcceleratedOptimizer``): the real one is their
``_optimizer`` or ``optimizer`` and their ``param_groups`` are its. `unwrap` finds it;
every ampkit call that takes an optimizer goes through it.
"""
import types

import torch
from torch import nn

__all__ = ["OptimizerLike", "is_optimizer_like", "unwrap"]

_ROUTED = ("zero_grad", "add_param_group")  # the methods ampkit replaces on the optimizer it initializes


def unwrap(obj):
    """The optimizer ``obj`` stands for: ``obj`` itself, or the one behind framework wrappers.

    A wrapper that subclasses its optimizer's class (Lightning's and Fabric's do) would run
    the class's ``zero_grad``/``add_param_group`` on the shared ``param_groups`` and miss
    ampkit's (model gradients, masters, a dropped batch's scaled gradients); those two methods
    of the wrapper are routed to the inner optimizer's from here on.
    """
    inner = _inner(obj)
    while inner is not None:
        if isinstance(obj, type(inner)):
            for name in _ROUTED:
                if vars(obj).get(name) is None:
                    setattr(obj, name, types.MethodType(_routed(name), obj))
        obj, inner = inner, _inner(inner)
    return obj


def _inner(obj):
    """The optimizer a framework wrapper holds as ``_optimizer``/``optimizer``, else None."""
    if getattr(type(obj), "manages_loss_scaling", False) or not hasattr(obj, "__dict__"):
        return None  # FP16_Optimizer holds one too, but manages scaling itself: refused, not unwrapped
    for name in ("_optimizer", "optimizer"):
        inner = vars(obj).get(name)
        if inner is not None and inner is not obj and is_optimizer_like(inner):
            if getattr(obj, "param_groups", None) is inner.param_groups:
                return inner
    return None


def _routed(name: str):
    def method(wrapper, *args, **kwargs):
        return getattr(unwrap(wrapper), name)(*args, **kwargs)

    method.__name__ = name
    return method


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
    """``isinstance(obj, OptimizerLike)`` is `is_optimizer_like`; never instantiated."""
