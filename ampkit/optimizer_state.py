"""What ``initialize`` attaches to an optimizer: fp32 master weights and gradient bookkeeping.

The optimizer keeps its identity and class; ``step``, ``zero_grad`` and
``add_param_group`` are wrapped on the instance (as LR schedulers do), and everything
ampkit needs lives in ``optimizer._ampkit``, an :class:`OptimizerState`.
"""
import types
from typing import Dict, List, Optional

import torch

from .opt_levels import HALF_DTYPES
from .scaler import unscale_and_check_


def _by_device(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups.values()


def _copy_(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, one fused kernel per device."""
    groups = {}
    for d, s in zip(dst, src):
        pair = groups.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    with torch.no_grad():
        for d, s in groups.values():
            torch._foreach_copy_(d, s)


def _make_master(param: torch.Tensor) -> torch.Tensor:
    master = param.detach().clone().float()
    master.requires_grad_(param.requires_grad)
    return master


def _state_to_fp32(state: dict) -> dict:
    return {
        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
        for k, v in state.items()
    }


class OptimizerState:
    """ampkit's record on one optimizer.

    * ``masters`` maps each half model parameter the optimizer holds to its fp32 master
      (the tensor that sits in ``param_groups``); ``owner`` maps back.
    * Gradients are *clean* (unscaled, or absent) or *scaled*: ``scaled_by`` is the
      scaler whose scale they still carry after a ``delay_unscale=True`` backward.
    * ``stash`` holds clean gradients set aside while a new backward writes scaled ones
      (gradient accumulation without ``delay_unscale``).
    * ``pending`` lists overflow checks not yet resolved (``delay_overflow_check``);
      ``skip`` is the id of the loss whose overflow cancels the next ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, session, use_masters: bool, model_states):
        self.optimizer = optimizer
        self.session = session
        self.use_masters = use_masters
        self.model_states = model_states
        self.masters: Dict[torch.Tensor, torch.Tensor] = {}
        self.owner: Dict[torch.Tensor, torch.Tensor] = {}
        self.scaled_by = None
        self.stash: Dict[torch.Tensor, torch.Tensor] = {}
        self.pending: List = []
        self.skip: Optional[int] = None
        self._step = optimizer.step
        self._zero_grad = optimizer.zero_grad
        self._add_param_group = optimizer.add_param_group

    # -- setup -------------------------------------------------------------------------
    def attach(self) -> None:
        """Create masters for the half parameters and wrap the optimizer's methods."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = self._with_masters(group["params"])
        opt._ampkit = self
        opt.step = types.MethodType(_step, opt)
        opt.zero_grad = types.MethodType(_zero_grad, opt)
        opt.add_param_group = types.MethodType(_add_param_group, opt)

    def _with_masters(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        if not self.use_masters:
            return list(params)
        out = []
        for p in params:
            if p.is_floating_point() and p.dtype in HALF_DTYPES:
                master = _make_master(p)
                if p in self.optimizer.state:
                    self.optimizer.state[master] = _state_to_fp32(self.optimizer.state.pop(p))
                self._register(p, master)
                out.append(master)
            else:
                out.append(p)
        return out

    def _register(self, param, master) -> None:
        self.masters[param] = master
        self.owner[master] = param
        for ms in self.model_states:
            if ms.owns(param):
                ms.masters[param] = master

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Module surgery replaced model parameter ``old`` with ``new``: follow it."""
        master = self.masters.pop(old, None)
        if master is not None:
            del self.owner[master]
            for ms in self.model_states:
                ms.masters.pop(old, None)
            with torch.no_grad():
                master.copy_(new.detach())
            self._register(new, master)
            return
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p is old:
                    group["params"][i] = new
                    if old in self.optimizer.state:
                        self.optimizer.state[new] = self.optimizer.state.pop(old)

    # -- the gradient life cycle ------------------------------------------------------
    def step_params(self) -> List[torch.Tensor]:
        """Parameters the optimizer steps on (masters where they exist)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def before_backward(self) -> None:
        """Set clean gradients aside so the coming backward writes only scaled ones."""
        if self.scaled_by is not None:
            return
        for p in self.step_params():
            if p.grad is not None and p not in self.owner:
                self.stash[p] = p.grad
                p.grad = None
        for p in self.masters:
            p.grad = None

    def unscale(self, inv_scale: float, found_inf: dict) -> None:
        """Turn the scaled gradients of the last backward into clean ones."""
        self.scaled_by = None
        fresh, targets = [], []
        for p, m in self.masters.items():
            if p.grad is not None:
                fresh.append(p.grad.float())
                targets.append(m)
                p.grad = None
        plain = [p for p in self.step_params() if p not in self.owner and p.grad is not None]
        unscale_and_check_(fresh + [p.grad for p in plain], inv_scale, found_inf)
        self._accumulate(targets, fresh)
        restored, add_to, add_from = [], [], []
        for p, g in self.stash.items():
            if p.grad is None:
                restored.append((p, g))
            else:
                add_to.append(p.grad)
                add_from.append(g)
        for p, g in restored:
            p.grad = g
        if add_to:
            for dst, src in zip(_by_device(add_to), _by_device(add_from)):
                torch._foreach_add_(dst, src)
        self.stash.clear()

    @staticmethod
    def _accumulate(targets, grads) -> None:
        add_to, add_from = [], []
        for m, g in zip(targets, grads):
            if m.grad is None:
                m.grad = g
            else:
                add_to.append(m.grad)
                add_from.append(g)
        if add_to:
            torch._foreach_add_(add_to, add_from)

    def adopt_raw_grads(self, found_inf: dict) -> None:
        """Move half gradients produced outside ``scale_loss`` into the masters, unscaled."""
        raw = [(p, m) for p, m in self.masters.items() if p.grad is not None]
        if raw:
            fresh = [p.grad.float() for p, _ in raw]
            unscale_and_check_(fresh, 1.0, found_inf)
            self._accumulate([m for _, m in raw], fresh)
            for p, _ in raw:
                p.grad = None

    def clear_grads(self, set_to_none: bool = True) -> None:
        self._zero_grad(set_to_none=set_to_none)
        for p in self.masters:
            p.grad = None
        self.stash.clear()
        self.scaled_by = None

    def copy_masters_to_model(self) -> None:
        if self.masters:
            _copy_(list(self.masters), list(self.masters.values()))


def _step(optimizer, closure=None):
    """``optimizer.step()``: skipped after an overflow; masters copied into the model after."""
    state: OptimizerState = optimizer._ampkit
    if closure is not None:
        raise RuntimeError(
            "optimizer.step(closure): closures are not supported by ampkit; compute the loss, "
            "run it through ampkit.scale_loss, then call optimizer.step()."
        )
    state.session.finish_backward(state)
    if state.skip is not None:
        state.skip = None
        state.clear_grads()
        return None
    result = state._step()
    state.copy_masters_to_model()
    for m in state.owner:
        m.grad = None
    return result


def _zero_grad(optimizer, set_to_none: bool = True):
    """``optimizer.zero_grad()``: clears model and master gradients alike."""
    state: OptimizerState = optimizer._ampkit
    state._zero_grad(set_to_none=set_to_none)
    for p in state.masters:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
    state.stash.clear()
    state.scaled_by = None


def _add_param_group(optimizer, param_group: dict):
    """``optimizer.add_param_group()``: half parameters of the new group get masters too."""
    state: OptimizerState = optimizer._ampkit
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "add_param_group(params=set): parameters need an ordered collection (a list); "
            "the order of a set changes between runs."
        )
    state.session.check_devices(list(params), state.use_masters)
    param_group = dict(param_group, params=state._with_masters(list(params)))
    return state._add_param_group(param_group)
