"""torch's optimizer step hooks, run once around ampkit's whole step.

torch runs ``register_step_pre_hook`` / ``register_step_post_hook`` hooks inside the class's
``step``. ampkit's step does more than that call: it copies fp32 masters into the model
(O2/O5/O6) or steps a large O7 model chunk by chunk. So it calls the class's step without
its hooks and runs the hooks itself: pre-hooks once before the update, post-hooks once after
the model holds the new weights, as they would see it in plain PyTorch. While the update runs
the optimizer's own hooks are set aside, so a subclass whose ``step`` calls ``super().step()``
(itself hooked) does not fire them again for every chunk.
"""
import collections
import contextlib
from itertools import chain
from typing import Callable, Optional

import torch
from torch.optim import optimizer as _torch_optim


def unhooked_step(optimizer) -> Optional[Callable]:
    """The optimizer's own ``step`` without torch's hooks, bound; None when its ``step`` is not
    torch's hooked class method (a wrapper's, or one replaced on the instance)."""
    own = vars(optimizer).get("step")
    if own is not None and not getattr(own, "_wrapped_by_lr_sched", False):
        return None
    step = type(optimizer).step
    if not (isinstance(optimizer, torch.optim.Optimizer) and getattr(step, "hooked", False)
            and hasattr(step, "__wrapped__") and hasattr(_torch_optim, "_global_optimizer_pre_hooks")):
        return None
    return step.__wrapped__.__get__(optimizer)


def run_pre_hooks(optimizer) -> None:
    for hook in chain(_torch_optim._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()):
        result = hook(optimizer, (optimizer,), {})
        if result is not None and result != ((optimizer,), {}):
            raise RuntimeError(
                f"optimizer step pre-hook {hook!r} returned new arguments {result!r}; ampkit's step() takes "
                f"none (closures are not supported), so a pre-hook may only return None."
            )


def run_post_hooks(optimizer) -> None:
    optimizer._optimizer_step_code()
    for hook in chain(optimizer._optimizer_step_post_hooks.values(), _torch_optim._global_optimizer_post_hooks.values()):
        hook(optimizer, (optimizer,), {})


@contextlib.contextmanager
def hooks_set_aside(optimizer):
    """The optimizer's own step hooks removed for the duration of the block."""
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    optimizer._optimizer_step_pre_hooks = collections.OrderedDict()
    optimizer._optimizer_step_post_hooks = collections.OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = pre, post
