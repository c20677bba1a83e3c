"""FP8 matmuls in eligible ``nn.Linear`` layers through torchao's ``Float8Linear`` (``fp8``, O6).

A layer is eligible when it is exactly an ``nn.Linear`` (a subclass may have a forward of
its own), both its feature counts are multiples of 16 (what fp8 matmul kernels accept), it
is not the output head (the model's last ``nn.Linear`` in module order, whose logits are
the most sensitive to fp8 error) and the user did not exclude it with ``fp8_exclude``:
module names as in ``named_modules()`` (a name covers its descendants), or a callable
``(name, module) -> bool`` that returns True for modules to keep out of fp8.

Conversion keeps the layers' parameter objects, so optimizers stay valid and state dicts
keep their keys (and, with master weights, their float32 values). ``fp8=True`` uses the
device's fp8 matmul (``torch._scaled_mm``) where it has one and emulates it elsewhere;
``fp8="emulate"`` always emulates. torchao is the optional extra ``ampkit[fp8]``.
"""
import importlib.util
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

__all__ = ["EXTRA", "available", "require", "check_exclude", "eligible", "has_fp8_matmul", "convert_"]

EXTRA = "ampkit[fp8]"
"""The optional extra that installs torchao, pinned in `pyproject.toml` (`pip install -e ".[fp8]"` from a checkout)."""
MULTIPLE = 16
Exclude = Union[None, Sequence[str], Callable[[str, nn.Module], bool]]
_matmul: Dict[str, bool] = {}


def require():
    """``torchao.float8``, or an ImportError that names the extra to install."""
    try:
        import torchao.float8 as float8
        float8.Float8LinearConfig, float8.convert_to_float8_training
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"initialize(fp8=...): fp8 training needs torchao's Float8Linear, an optional extra: "
            f"pip install '{EXTRA}' (or from a checkout: pip install -e \".[fp8]\"). Importing it failed: {e}"
        ) from e
    return float8


def available() -> bool:
    """Whether torchao is installed (without importing it)."""
    return importlib.util.find_spec("torchao") is not None


def check_exclude(models: List[nn.Module], exclude: Exclude):
    """``exclude`` (``initialize``'s ``fp8_exclude``) as a tuple of names or a callable.

    ``models``: the models being initialized; every name in ``exclude`` must name a module of
    one of them (as in ``named_modules()``), else a ValueError lists the unknown names.
    """
    if exclude is None:
        return ()
    if callable(exclude):
        return exclude
    if isinstance(exclude, str) or not isinstance(exclude, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in exclude):
        raise TypeError(
            f"initialize(fp8_exclude={exclude!r}): expected a list of module names (as in named_modules()) "
            f"or a callable (name, module) -> bool that returns True for modules to keep out of fp8."
        )
    known = {name for m in models for name, _ in m.named_modules()}
    unknown = sorted(n for n in exclude if n not in known)
    if unknown:
        raise ValueError(f"initialize(fp8_exclude=...): {unknown} name(s) no module of the model(s); names are as in model.named_modules().")
    return tuple(exclude)


def _excluded(name: str, module: nn.Module, exclude) -> bool:
    if callable(exclude):
        return bool(exclude(name, module))
    return any(name == n or name.startswith(n + ".") for n in exclude if n)


def eligible(model: nn.Module, exclude=()) -> List[str]:
    """Names of the layers of ``model`` that ``fp8`` converts (see the module docstring).

    ``exclude``: names to keep out (as in ``named_modules()``), or a callable ``(name, module)
    -> bool`` returning True for modules to keep out.
    """
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = linears[-1][0] if linears else None
    return [
        n for n, m in linears
        if type(m) is nn.Linear and n != head and m.in_features % MULTIPLE == 0
        and m.out_features % MULTIPLE == 0 and not _excluded(n, m, exclude)
    ]


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (probed once per device type)."""
    key = torch.device(device).type
    if key not in _matmul:
        try:
            a = torch.ones(MULTIPLE, MULTIPLE, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            _matmul[key] = True
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            _matmul[key] = False
    return _matmul[key]


def convert_(model: nn.Module, mode: Union[bool, str], exclude=(), log: Optional[Callable] = None) -> List[str]:
    """Swap the eligible layers of ``model`` for ``Float8Linear`` in place; return their names.

    ``mode``: ``True`` (``torch._scaled_mm`` where the device has it, else emulated) or
    ``"emulate"``; ``exclude``: as in `eligible`; ``log``: a ``logging``-style callable
    told which layers were converted and how (nothing is logged when it is ``None``).
    """
    float8 = require()
    names = set(eligible(model, exclude))
    if not names:
        return []
    device = next(model.parameters()).device
    emulate = mode == "emulate" or not has_fp8_matmul(device)
    config = float8.Float8LinearConfig(emulate=emulate)
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names, config=config)
    if log is not None:
        log("fp8: %d nn.Linear layer(s) run fp8 matmuls (%s on %s): %s", len(names),
            "emulated" if emulate else "torch._scaled_mm", device.type, ", ".join(sorted(names)))
    return sorted(names)
