"""``UpdateKind.MASTERS``: the optimizer steps on fp32 master copies of the half parameters.

The masters themselves (made, registered, copied into the model after the step) are the
optimizer state's (``_optim/optimizer_state.py``); this is the step: masters of a plain
AdamW / Adam (``fused_update.step_masters``) or SGD (``fused_sgd_update.step_masters``) take one
fused pass each, as do its fp32 parameters (norms kept in fp32), the optimizer's own step the rest.
"""
from . import fused_sgd_update, fused_update
from .base import OptimizerUpdate


class MastersUpdate(OptimizerUpdate):
    """The masters' step (FSDP2's fp32 shards, which ampkit does not master, take the optimizer's own)."""

    def step(self) -> tuple:
        """Fused masters write their model parameters too (returned); the optimizer's own step
        skips parameters without gradients, so the fused ones' are set aside for it (and it is
        not called when no gradient is left: the kernels stepped every parameter)."""
        opt, state = self.optimizer, self.opt_state
        kind = fused_sgd_update if fused_sgd_update.is_sgd(opt) else fused_update
        fused = kind.masters_to_step(opt, state.owner) if state.masters else []
        if not fused:
            return self.own_step(), ()
        held = len(opt.state)
        kind.step_masters(opt, fused)
        grads = [(m, m.grad) for _, m, _ in fused]
        for m, _ in grads:
            m.grad = None
        try:
            result = self.own_step() if _any_grad(opt) else None
        finally:
            for m, g in grads:
                m.grad = g
        if len(opt.state) != held:  # new state: in the order torch's own step makes it
            fused_update.order_state(opt, {m: i for i, m in enumerate(state.step_params())})
        return result, {p for _, _, p in fused if p is not None}


def _any_grad(optimizer) -> bool:
    """Whether a parameter of ``optimizer`` has a gradient (its own step has something to do)."""
    return any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
