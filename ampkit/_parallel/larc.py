"""Apex's LARC: layer-wise adaptive learning rates around any optimizer."""
import torch

__all__ = ["LARC"]


class LARC:
    """Scale each parameter's gradient by its local learning rate, then step ``optimizer``.

    The local rate is ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``;
    with ``clip=True`` the gradient is scaled by ``min(local / lr, 1)`` (LARC clipping),
    else by the local rate itself (LARS scaling). Weight decay is folded into the gradient
    before scaling and is off for the inner step. Parameters whose weight or gradient norm
    is 0 are left as they are. Nothing synchronises with the host.

    ``param_groups``, ``state``, ``state_dict``, ``load_state_dict``, ``zero_grad`` and
    ``add_param_group`` are the wrapped optimizer's.
    """

    def __init__(self, optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8):
        from .._optim.optimizer_wrappers import is_optimizer_like

        if not is_optimizer_like(optimizer):
            raise TypeError(f"LARC(optimizer=...): expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if isinstance(trust_coefficient, bool) or not isinstance(trust_coefficient, (int, float)) or not trust_coefficient > 0:
            raise ValueError(f"LARC(trust_coefficient={trust_coefficient!r}): expected a positive number.")
        if not isinstance(clip, bool):
            raise TypeError(f"LARC(clip={clip!r}): expected True or False.")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"LARC(eps={eps!r}): expected a number >= 0.")
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = clip
        self.eps = float(eps)

    def __repr__(self):
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps})"

    @property
    def state(self):
        return self.optim.state

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        decays = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0)
            decays.append(wd)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                p_norm = torch.linalg.vector_norm(p)
                g_norm = torch.linalg.vector_norm(p.grad)
                local = self.trust_coefficient * p_norm / (g_norm + p_norm * wd + self.eps)
                if self.clip:
                    local = torch.clamp(local / group["lr"], max=1.0)
                active = (p_norm != 0) & (g_norm != 0)
                if wd:
                    p.grad.add_(torch.where(active, p * wd, 0.0).to(p.grad.dtype))
                p.grad.mul_(torch.where(active, local, 1.0).to(p.grad.dtype))
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, decays):
                group["weight_decay"] = wd
