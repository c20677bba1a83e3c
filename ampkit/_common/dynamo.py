"""ampkit's bookkeeping inside a ``torch.compile``d training step: run eagerly, never traced."""
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_under_compile(fn: F) -> F:
    """``fn``, which Dynamo skips whole: a call to it inside a compiled function is one graph
    break and nothing it calls is traced (loss-scale bookkeeping, gradient checks and ctypes
    calls have no graph to give, and tracing them costs a compile per frame). ``torch._dynamo``
    loads at the first call, not at import: torch's own lazy wrapper, the one on
    ``torch.optim.Optimizer.zero_grad``; ``fn`` as it is where a torch has none."""
    wrap = getattr(torch, "_disable_dynamo", None)
    return fn if wrap is None else wrap(fn)
