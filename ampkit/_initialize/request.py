"""Step 1, parse: ``initialize``'s arguments as a frozen record."""
import dataclasses
import types
from typing import Any, List, Mapping

import torch
from torch import nn

from .._config.levels import OPT_LEVELS
from .._optim.optimizer_wrappers import OptimizerLike, unwrap

OPTIMIZER_KINDS = (torch.optim.Optimizer, OptimizerLike)


@dataclasses.dataclass(frozen=True)
class Request:
    """What the caller asked for: models and optimizers as lists, and every option."""

    models: List[nn.Module]
    optimizers: List[Any]
    single_model: bool
    given_models: Any  # the models argument as passed, returned unchanged (without ddp=True)
    returns_optimizers: bool  # optimizers were passed (so they are returned)
    given_optimizers: Any  # the optimizers argument as passed, returned unchanged
    enabled: bool
    opt_level: Any
    options: Mapping[str, Any]

    def returned(self, models) -> Any:
        """``initialize``'s return value: the structure it was given."""
        return (models, self.given_optimizers) if self.returns_optimizers else models


def as_list(obj, label: str, allowed: tuple, expected: str):
    """``obj`` (one object or a list/tuple of them) as a list, and whether it was one object."""
    if isinstance(obj, allowed):
        return [obj], True
    if isinstance(obj, (list, tuple)) and all(isinstance(o, allowed) for o in obj):
        return list(obj), False
    raise TypeError(f"{label}: expected {expected}, got {type(obj).__name__}.")


def parse(arguments: Mapping[str, Any]) -> Request:
    """``initialize``'s arguments (name -> value) as a request; the objects' kinds checked."""
    values = dict(arguments)
    enabled = values.pop("enabled")
    if not isinstance(enabled, bool):
        hint = (f" (the third positional argument is `enabled`; pass the level as opt_level={enabled!r})"
                if isinstance(enabled, str) and (enabled in OPT_LEVELS or enabled == "auto") else "")
        raise TypeError(f"initialize(enabled={enabled!r}): expected True or False{hint}.")
    models, optimizers = values.pop("models"), values.pop("optimizers")
    model_list, single = as_list([] if models is None else models, "initialize(models=...)", (nn.Module,),
                                 "an nn.Module or a list of them")
    opt_list, _ = as_list([] if optimizers is None else optimizers, "initialize(optimizers=...)", OPTIMIZER_KINDS,
                          "a torch.optim.Optimizer (or a wrapper exposing its param_groups and state, such as LARC) "
                          "or a list of them")
    opt_list = [unwrap(o) for o in opt_list]  # a framework's wrapper: the optimizer behind it
    if not model_list:
        raise ValueError("initialize(models=...): expected at least one model.")
    return Request(model_list, opt_list, single, models, optimizers is not None, optimizers, enabled,
                   values.pop("opt_level"), types.MappingProxyType(values))
