"""``apex.optimizers`` in the stand-in: Apex's fused optimizers as the torch.optim optimizers
that compute the same update.

``FusedAdam`` is ``torch.optim.Adam`` (``adam_w_mode=True``, Apex's default: decoupled weight
decay, i.e. ``torch.optim.AdamW``), ``FusedSGD`` is ``torch.optim.SGD`` and ``FusedAdagrad`` is
``torch.optim.Adagrad``, each with torch's fused kernels where every parameter's device has
them (else foreach), and Apex's arguments translated. An argument value torch cannot honour
raises a ValueError that names it and what to use. ``FusedLAMB``, ``FusedNovoGrad`` and
``FusedMixedPrecisionLamb`` have no torch equivalent: creating one says so.
"""
import torch
from torch.optim.optimizer import required
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad", "FusedMixedPrecisionLamb"]


def _prepared(params):
    """``params`` as a list (it may be a generator, read once) and the kernel keyword for
    torch: ``fused=True`` when torch has fused kernels for every parameter, else ``foreach=True``."""
    groups = [dict(g, params=_listed(g["params"])) if isinstance(g, dict) and "params" in g else g for g in params]
    tensors = [t for g in groups for t in (g.get("params", []) if isinstance(g, dict) else [g])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]  # named parameters
    devices = _get_fused_kernels_supported_devices()
    fused = bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type in devices
                                  for t in tensors)
    return groups, ({"fused": True} if fused else {"foreach": True})


def _listed(params):
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _refuse(call: str, arg: str, value, why: str) -> ValueError:
    return ValueError(f"apex.optimizers.{call}({arg}={value!r}) has no torch.optim equivalent in ampkit's Apex "
                      f"stand-in: {why}.")


class _ApexZeroGrad:
    """``zero_grad()`` as Apex's fused optimizers had it: ``set_grad_none`` chooses None or zeros."""

    set_grad_none = True

    def zero_grad(self, set_to_none=None):
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)


class FusedAdam(_ApexZeroGrad, torch.optim.Adam):
    """Apex's ``FusedAdam`` as ``torch.optim.Adam``; ``adam_w_mode=True`` (the default) is
    ``torch.optim.AdamW``'s decoupled weight decay, ``False`` Adam's L2 penalty."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if not bias_correction:
            raise _refuse("FusedAdam", "bias_correction", bias_correction, "torch.optim.Adam and AdamW always "
                          "correct the moments' bias; drop the argument to get torch.optim.AdamW (or Adam with "
                          "adam_w_mode=False)")
        if master_weights:
            raise _refuse("FusedAdam", "master_weights", master_weights, "keep fp32 master weights with "
                          "amp.initialize(model, optimizer, opt_level='O2') and a plain FusedAdam "
                          "(torch.optim.AdamW steps on the masters)")
        groups, kernel = _prepared(params)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         capturable=capturable, decoupled_weight_decay=bool(adam_w_mode), **kernel)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none


class FusedSGD(_ApexZeroGrad, torch.optim.SGD):
    """Apex's ``FusedSGD`` as ``torch.optim.SGD`` (weight decay before momentum, as both apply it
    by default). ``lr`` is required as in Apex, by the optimizer or by every parameter group
    (a group added later without one raises). ``materialize_master_grads`` changes nothing:
    ampkit's masters always get their own fp32 gradients."""

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
        groups, kernel = _prepared(params)
        lacking = [i for i, g in enumerate(groups) if not (isinstance(g, dict) and "lr" in g)]
        if lr is required and lacking:
            raise ValueError(f"apex.optimizers.FusedSGD: no lr given and parameter group {lacking[0]} has none; pass "
                             f"lr=... or an 'lr' in every parameter group.")
        super().__init__(groups, lr=0.0 if lr is required else lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, **kernel)
        if lr is required:  # torch's add_param_group then asks a new group for its own lr
            self.defaults["lr"] = required
        if wd_after_momentum and any(g["weight_decay"] for g in self.param_groups):
            raise _refuse("FusedSGD", "wd_after_momentum", wd_after_momentum, "torch.optim.SGD adds weight decay "
                          "to the gradient before momentum; use wd_after_momentum=False (torch.optim.SGD)")
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none


class FusedAdagrad(_ApexZeroGrad, torch.optim.Adagrad):
    """Apex's ``FusedAdagrad`` as ``torch.optim.Adagrad`` (L2 weight decay, Apex's default mode)."""

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False):
        groups, kernel = _prepared(params)
        super().__init__(groups, lr=lr, eps=eps, weight_decay=weight_decay, **kernel)
        if adagrad_w_mode and any(g["weight_decay"] for g in self.param_groups):
            raise _refuse("FusedAdagrad", "adagrad_w_mode", adagrad_w_mode, "torch.optim.Adagrad adds weight "
                          "decay to the gradient (L2); use adagrad_w_mode=False (torch.optim.Adagrad)")
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0
        self.set_grad_none = set_grad_none


class _NoTorchEquivalent:
    """An Apex optimizer torch.optim has no counterpart for: creating one says what to use."""

    instead = ""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"apex.optimizers.{type(self).__name__} is not provided by ampkit's Apex "
                                  f"stand-in: {self.instead}.")


_NO_LAMB = ("torch.optim has no LAMB (Adam with a per-layer trust ratio); the nearest torch optimizer is "
            "torch.optim.AdamW, a different algorithm (expect different hyperparameters)")


class FusedLAMB(_NoTorchEquivalent):
    instead = _NO_LAMB


class FusedMixedPrecisionLamb(_NoTorchEquivalent):
    instead = _NO_LAMB


class FusedNovoGrad(_NoTorchEquivalent):
    instead = ("torch.optim has no NovoGrad (per-layer second moments); the nearest torch optimizer is "
               "torch.optim.AdamW, a different algorithm (expect different hyperparameters)")
