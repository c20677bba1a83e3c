"""Op-level casting for O1/O4: ``torch.autocast`` regions and user-registered casts.

ampkit never patches torch globally. The model's forward runs under ``torch.autocast``
(see ``model_state``); `autocast` opens the same region for code outside the
model, `disable_casts` closes it locally, and the ``register_*_function`` /
decorator API adds user functions to the half, float or promote lists.
"""
import contextlib
import functools
from typing import Callable

import torch

from .._run import registry
from .apex_lists import apex_fp32_region
from .autocast_devices import active_device, autocast_devices
from .casting import cast_tree


@contextlib.contextmanager
def autocast(enabled: bool = True):
    """Run the block under the autocast of the current run (O1/O4): the latest ``initialize``
    with optimizers, so a teacher or EMA model initialized later never takes over.

    At levels without op-level casting this is a no-op, so code written for O1 runs
    unchanged at O2. Raises RuntimeError before ``ampkit.initialize``.

    Args:
        enabled: ``False`` makes the block a no-op (for a flag that switches mixed
            precision off without restructuring the code).
    """
    run = registry.current("ampkit.autocast()", collect=False)  # entered every step: no collection each time
    props = run.properties
    if not (enabled and run.enabled and props.patch_torch_functions):
        yield
        return
    with torch.autocast(run.device_type, dtype=props.half_dtype), apex_fp32_region():
        yield


@contextlib.contextmanager
def disable_casts():
    """Turn op-level autocasting off inside the block; a no-op where none is active."""
    with contextlib.ExitStack() as stack:
        for device in autocast_devices():
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _floating_dtypes(obj, out):
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            out.add(obj.dtype)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _floating_dtypes(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _floating_dtypes(v, out)
    return out


def _cast_around(fn: Callable, kind: str, dtype_for: Callable) -> Callable:
    """Wrap ``fn``: under autocast, run it with autocast off on floating arguments cast to
    ``dtype_for(device, args, kwargs)``; when that is None, or outside autocast, call ``fn`` as is."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = active_device(args, kwargs)
        dtype = None if device is None else dtype_for(device, args, kwargs)
        if dtype is None:
            return fn(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))

    wrapper.__ampkit_cast__ = kind
    return wrapper


def _widest(device, args, kwargs):
    dtypes = _floating_dtypes(kwargs, _floating_dtypes(args, set()))
    return functools.reduce(torch.promote_types, dtypes) if len(dtypes) > 1 else None


def half_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` on floating arguments cast to the autocast dtype."""
    return _cast_around(fn, "half", lambda device, args, kwargs: torch.get_autocast_dtype(device))


def float_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` on float32 arguments with autocasting disabled inside."""
    return _cast_around(fn, "float", lambda device, args, kwargs: torch.float32)


def promote_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` on floating arguments promoted to the widest floating dtype among them."""
    return _cast_around(fn, "promote", _widest)


def _register(decorator, module, name: str) -> None:
    if not isinstance(name, str) or not hasattr(module, name):
        raise ValueError(f"No function named {name!r} in module {getattr(module, '__name__', module)!r}.")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{getattr(module, '__name__', module)}.{name} is not callable.")
    if getattr(fn, "__ampkit_cast__", None) is not None:
        fn = fn.__wrapped__
    setattr(module, name, decorator(fn))


def register_half_function(module, name: str) -> None:
    """Make ``module.name`` a half function (see `half_function`)."""
    _register(half_function, module, name)


def register_float_function(module, name: str) -> None:
    """Make ``module.name`` a float function (see `float_function`)."""
    _register(float_function, module, name)


def register_promote_function(module, name: str) -> None:
    """Make ``module.name`` a promote function (see `promote_function`)."""
    _register(promote_function, module, name)
