"""Module surgery: swap submodules by class, in place, keeping optimizers pointed at the model."""
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._optim.optimizer_wrappers import is_optimizer_like

Policy = Callable[[nn.Module, str], Optional[nn.Module]]


def _optimizer_list(optimizers) -> List[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    if is_optimizer_like(optimizers):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)) and all(is_optimizer_like(o) for o in optimizers):
        return list(optimizers)
    raise TypeError(f"replace_module_classes(optimizers=...): expected an optimizer or a list of them, got {type(optimizers).__name__}.")


def _plan(module: nn.Module, prefix: str, policies, memo: dict, plan: list) -> None:
    """Collect ``(parent, attribute, old, new, qualified name)``; children of a replaced module are not visited."""
    for attr, child in module.named_children():
        name = prefix + attr
        if id(child) not in memo:
            policy = policies.get(type(child))
            new = None if policy is None else policy(child, name)
            if new is not None and not isinstance(new, nn.Module):
                raise TypeError(
                    f"replace_module_classes: the policy for {type(child).__name__} returned "
                    f"{type(new).__name__} for {name!r}; a policy must return an nn.Module or None."
                )
            memo[id(child)] = new
            if new is None:
                _plan(child, name + ".", policies, memo, plan)
        if memo[id(child)] is not None:
            plan.append((module, attr, child, memo[id(child)], name))


def _held(optimizers) -> set:
    """ids of the model parameters the optimizers train (for ampkit ones: those with masters too)."""
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    for opt in optimizers:
        if getattr(opt, "_ampkit", None) is not None:
            held.update(id(p) for p in opt._ampkit.masters)
    return held


def _pairs(old: nn.Module, new: nn.Module, name: str, held: set) -> List[Tuple[nn.Parameter, nn.Parameter]]:
    """(old, new) Parameter pairs matched by name, for held parameters the replacement does not reuse."""
    kept = {id(p) for p in new.parameters()}
    fresh = dict(new.named_parameters())
    pairs = []
    for pname, p in old.named_parameters():
        if id(p) in kept or id(p) not in held:
            continue
        q = fresh.get(pname)
        if q is None or q.shape != p.shape:
            raise ValueError(
                f"replace_module_classes: an optimizer holds {name}.{pname} {tuple(p.shape)}, but the "
                f"{type(new).__name__} replacing {type(old).__name__} has no parameter {pname!r} of that shape; "
                f"reuse the Parameter or keep its name and shape."
            )
        pairs.append((p, q))
    return pairs


def _rebind(opt: torch.optim.Optimizer, old: nn.Parameter, new: nn.Parameter) -> None:
    if getattr(opt, "_ampkit", None) is not None:
        opt._ampkit.rebind(old, new)
        return
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
                if old in opt.state:
                    opt.state[new] = opt.state.pop(old)


def replace_module_classes(model: nn.Module, policies: Dict[type, Policy], optimizers=None) -> Dict[type, int]:
    """Replace submodules of ``model`` in place; return how many were replaced, per class.

    ``policies`` maps a module class (matched exactly, not subclasses) to
    ``fn(module, qualified_name)`` returning the replacement or None to keep the module
    (whose children are then searched). Replacements are not searched; a module shared
    by several parents is replaced once, everywhere. The root itself is never replaced.

    Parameters of a replaced module that ``optimizers`` (one or a list) hold stay held:
    a replacement that reuses the Parameter objects needs nothing; otherwise the
    parameter of the same name and shape takes its place in the param groups and
    inherits its ``optimizer.state`` (for an ampkit-initialized optimizer, through
    ``optimizer._ampkit.rebind``, which keeps the fp32 master). Parameters only the
    replacement has are not added to any optimizer. Every policy runs and every check
    passes before anything is modified.
    """
    if not isinstance(policies, dict) or not all(isinstance(cls, type) and issubclass(cls, nn.Module) and callable(fn) for cls, fn in policies.items()):
        raise TypeError("replace_module_classes(policies=...): expected a dict mapping nn.Module classes to callables.")
    opts = _optimizer_list(optimizers)
    plan = []
    _plan(model, "", policies, {}, plan)
    held = _held(opts)
    replaced = {}
    for _, _, old, new, name in plan:
        replaced.setdefault(id(old), (old, new, name))
    pairs = [pair for old, new, name in replaced.values() for pair in _pairs(old, new, name, held)]

    for parent, attr, _, new, _ in plan:
        setattr(parent, attr, new)
    for opt in opts:
        for old, new in pairs:
            _rebind(opt, old, new)
    counts: Dict[type, int] = {}
    for old, _, _ in replaced.values():
        counts[type(old)] = counts.get(type(old), 0) + 1
    return counts
