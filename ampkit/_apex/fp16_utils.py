"""Apex's pre-amp ``fp16_utils``: model conversion helpers and the manual ``FP16_Optimizer``.

Same names and calling conventions as ``apex.fp16_utils``. ``FP16_Optimizer`` is a thin
front over ampkit's own machinery: the fp32 master weights are an `OptimizerState`
attached to the wrapped optimizer (as ``initialize`` would attach it), and the loss scale
is an `ampkit.LossScaler`. Deliberate differences from Apex: any device
works (Apex required CUDA); every step whose gradients hold inf/NaN is skipped, also with
a static scale (Apex applied them); ``step(closure)`` is not supported.
"""
import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from .._kernels.unscale import copy_unscale_and_check_, unscale_and_check_
from .._optim.optimizer_state import OptimizerState, _make_master, check_devices
from .._run import scaler as _scaler
from .._run.overflow import OverflowCheck
from .._run.run import Run

__all__ = [
    "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
    "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
    "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


def to_python_float(t) -> float:
    """``t.item()`` for a tensor (or anything with ``item``), else ``t[0]``."""
    return t.item() if hasattr(t, "item") else t[0]


class tofp16(nn.Module):
    """A module that casts its input to float16."""

    def forward(self, input):
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Put every affine BatchNorm layer of ``module`` back in float32 (in place); return ``module``."""
    if isinstance(module, _BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in float16 with affine BatchNorm in float32, behind a `tofp16` input cast."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating parameters (and their gradients) and buffers to ``dtype``."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` except affine BatchNorm layers; return ``network``."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to float16 (affine BatchNorm kept float32); inputs are cast to float16."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs):
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: the trainable parameters of ``model`` and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 parameter (with a zero gradient).
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if not flat_master:
        return model_params, [_make_master(p) for p in model_params]
    try:
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
    except BaseException as e:
        raise TypeError(
            "prep_param_lists(flat_master=True): the model's parameters could not be flattened into one "
            f"tensor ({e}); they must share one dtype and device. Use flat_master=False."
        ) from e
    master = nn.Parameter(flat)
    master.grad = torch.zeros_like(master)
    return model_params, [master]


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' fp32 gradients (``None`` stays ``None``).

    ``model_params``: the model's half parameters; ``master_params``: their fp32 masters, in
    the same order, or with ``flat_master=True`` one flat fp32 tensor holding them all (as
    `prep_param_lists` returns them).
    """
    if flat_master:
        master_params[0].grad.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    dst, src = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        dst.append(master.grad)
        src.append(model.grad)
    copy_unscale_and_check_(dst, src, 1.0, {})


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the values of ``master_params`` into ``model_params`` (``flat_master``: the masters are
    one flat tensor, as `prep_param_lists` made them)."""
    if flat_master:
        masters = _unflatten_dense_tensors(master_params[0].detach(), model_params)
    else:
        masters = [m.detach() for m in master_params]
    with torch.no_grad():
        for model, master in zip(model_params, masters):
            model.copy_(master)


def _check_scale(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{label}: expected a positive finite number, got {value!r}.")


class LossScaler:
    """Apex's static loss scaler: ``loss_scale`` is ``scale`` for good."""

    def __init__(self, scale: float = 1.0):
        _check_scale("LossScaler(scale=...)", scale)
        self._scaler = _scaler.LossScaler(float(scale))

    @property
    def cur_scale(self) -> float:
        return self._scaler.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scaler.scale = float(value)

    @property
    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    def has_overflow(self, params) -> bool:
        """True when a gradient of ``params`` holds inf or NaN (checked for a static scale too)."""
        found = {}
        unscale_and_check_([p.grad for p in params if p.grad is not None], 1.0, found)
        return any(bool(f.item()) for f in found.values())

    def update_scale(self, overflow: bool) -> None:
        self._scaler.update(overflow)

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph: bool = False) -> None:
        (loss * self.loss_scale).backward(retain_graph=retain_graph)

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "unskipped": self._scaler.unskipped}

    def load_state_dict(self, state) -> None:
        """From `state_dict` output or an Apex scaler object (anything with ``cur_scale``)."""
        if not isinstance(state, dict):
            # An Apex scaler unpickled from an Apex-era checkpoint (through the apex stand-in it
            # becomes one of these classes, with Apex's attributes in its __dict__).
            attrs = getattr(state, "__dict__", {})
            if "cur_scale" not in attrs:
                raise TypeError(f"load_state_dict(loss_scaler): expected a dict or an Apex loss scaler, got {type(state).__name__}.")
            state = {"cur_scale": attrs["cur_scale"]}
        self._scaler.load_state_dict({"loss_scale": state["cur_scale"], "unskipped": state.get("unskipped", 0)})


class DynamicLossScaler(LossScaler):
    """Apex's dynamic loss scaler: starting at ``init_scale``, divide by ``scale_factor`` on
    overflow (never below 1), multiply by it after ``scale_window`` clean steps."""

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0, scale_window: int = 1000):
        _check_scale("DynamicLossScaler(init_scale=...)", init_scale)
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float)) or not 1 < scale_factor < float("inf"):
            raise ValueError(f"DynamicLossScaler(scale_factor={scale_factor!r}): expected a finite number > 1.")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"DynamicLossScaler(scale_window={scale_window!r}): expected an integer >= 1.")
        self._scaler = _scaler.LossScaler(
            "dynamic", init_scale=init_scale, growth_factor=scale_factor, backoff_factor=1.0 / scale_factor,
            growth_interval=scale_window, min_loss_scale=1.0, max_loss_scale=torch.finfo(torch.float32).max,
        )

    @property
    def scale_factor(self) -> float:
        return self._scaler.growth_factor

    @property
    def scale_window(self) -> int:
        return self._scaler.growth_interval


class FP16_Optimizer:
    """Apex's manual mixed-precision optimizer wrapper.

    ``init_optimizer`` holds the model's float16 parameters; from here on it steps on fp32
    masters of them. The loop is::

        optimizer.zero_grad()
        loss = criterion(model(x), y)
        optimizer.backward(loss)         # scaled backward, grads into the fp32 masters
        optimizer.clip_master_grads(1.0)  # optional
        optimizer.step()                 # skipped after an overflow; masters copied into the model

    ``static_loss_scale``: the fixed scale when ``dynamic_loss_scale`` is False;
    ``dynamic_loss_scale``: scale dynamically (`DynamicLossScaler`), built from
    ``dynamic_loss_args`` (its keyword arguments, e.g. ``{"init_scale": 2**16}``) when given;
    ``verbose``: log overflow-skipped steps at INFO (Apex printed them).
    """

    manages_loss_scaling = True  # refused by initialize (optimizer_wrappers.is_optimizer_like)

    def __init__(self, init_optimizer, static_loss_scale: float = 1.0, dynamic_loss_scale: bool = False,
                 dynamic_loss_args=None, verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer(init_optimizer=...): expected a torch.optim.Optimizer, got {type(init_optimizer).__name__}.")
        if getattr(init_optimizer, "_ampkit", None) is not None:
            raise RuntimeError("FP16_Optimizer(init_optimizer=...): this optimizer already has ampkit master weights "
                               "(it went through ampkit.initialize or another FP16_Optimizer); wrap a bare optimizer.")
        if not isinstance(dynamic_loss_scale, bool):
            raise TypeError(f"FP16_Optimizer(dynamic_loss_scale={dynamic_loss_scale!r}): expected True or False.")
        if dynamic_loss_args is not None and not dynamic_loss_scale:
            raise ValueError("FP16_Optimizer(dynamic_loss_args=...): only valid with dynamic_loss_scale=True.")
        if dynamic_loss_scale:
            self.loss_scaler = DynamicLossScaler(**(dynamic_loss_args or {}))
        else:
            self.loss_scaler = LossScaler(static_loss_scale)
        self.dynamic_loss_scale = dynamic_loss_scale
        self.optimizer = init_optimizer
        params = [p for g in init_optimizer.param_groups for p in g["params"]]
        device = params[0].device.type if params else "cpu"
        check_devices(params, True)
        self._run = Run(True, None, [self.loss_scaler._scaler], verbosity=1 if verbose else 0, device_type=device)
        self._state = OptimizerState(init_optimizer, self._run, True, [])
        self._state.attach()
        self.overflow = False
        self.first_closure_call_this_step = True

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    # -- the loop ------------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Clear the model's and the masters' gradients (to zero, or to None)."""
        self.optimizer.zero_grad(set_to_none=set_grads_to_None)

    def backward(self, loss, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss * loss_scale).backward()``; then, unless told not to, `update_master_grads`.

        Several ``backward(..., update_master_grads=False)`` calls accumulate scaled gradients
        in the model; one `update_master_grads` then moves their sum into the masters.
        """
        st = self._state
        OptimizerState.begin_backward([st], self.loss_scaler._scaler, "FP16_Optimizer.backward")
        OptimizerState.hold_scaled([st], self.loss_scaler._scaler)
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model's gradients into the fp32 masters and check them for inf/NaN.

        An overflow sets `overflow`, backs off a dynamic scale and makes the next
        `step` a no-op.
        """
        st = self._state
        if st.scaled_by is None:
            return
        check = OverflowCheck(self._run, st.scaled_by, [st])
        st.unscale(check, 1.0 / st.scaled_by.loss_scale())
        self.overflow = check.resolve()

    def clip_master_grads(self, max_norm: float, norm_type: float = 2):
        """Clip the masters' gradients; the total norm, or -1 when this step overflowed."""
        if self.overflow:
            return -1
        return self.clip_grad_norm([p for g in self.optimizer.param_groups for p in g["params"]], max_norm, norm_type)

    clip_grad_norm = staticmethod(clip_grad_norm)

    def step(self, closure=None):
        """One step of the wrapped optimizer on the masters (a no-op after an overflow)."""
        if closure is not None:
            raise NotImplementedError(
                "FP16_Optimizer.step(closure): closures are not supported by ampkit; call "
                "optimizer.backward(loss) and then optimizer.step()."
            )
        self.update_master_grads()
        return self.optimizer.step()

    def inspect_master_grad_data(self):
        """The masters' gradients per parameter group (None where a master has none)."""
        if self.overflow:
            return None
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    # -- Apex's attributes -----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def fp32_from_fp16_groups(self):
        return [[p for p in g["params"] if p in self._state.owner] for g in self.optimizer.param_groups]

    @property
    def fp16_groups(self):
        return [[self._state.owner.get(p, p) for p in g["params"]] for g in self.optimizer.param_groups]

    @property
    def fp32_from_fp32_groups(self):
        return [[p for p in g["params"] if p not in self._state.owner] for g in self.optimizer.param_groups]

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Loss scaler, overflow flag, the wrapped optimizer's state and the fp32 masters."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[p.detach().clone() for p in group] for group in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore `state_dict` output; the masters (and the model) get the saved fp32 values."""
        keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                "optimizer_state_dict", "fp32_from_fp16")
        missing = [k for k in keys if not isinstance(state_dict, dict) or k not in state_dict]
        if missing:
            raise ValueError(f"FP16_Optimizer.load_state_dict(state_dict): expected the dict FP16_Optimizer.state_dict() "
                             f"returns, with the keys {list(keys)}; missing {missing}.")
        mine = self.fp32_from_fp16_groups
        saved = state_dict["fp32_from_fp16"]
        if [len(g) for g in saved] != [len(g) for g in mine] or any(
            s.shape != m.shape for gs, gm in zip(saved, mine) for s, m in zip(gs, gm)
        ):
            raise ValueError("FP16_Optimizer.load_state_dict: the saved fp32 masters do not match this optimizer's "
                             "float16 parameters (a different model or parameter groups).")
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for gs, gm in zip(saved, mine):
                for s, m in zip(gs, gm):
                    m.copy_(s)
        self._state.copy_masters_to_model()
