"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) under CPU autocast: run in float32.

CPU autocast hands ``nn.LSTM`` to oneDNN in the autocast dtype, and oneDNN has no float16
LSTM (nor a bfloat16 one on CPUs without AVX512-BF16): the forward fails with "could not
create a primitive descriptor for the LSTM forward propagation primitive". At O1/O4,
``initialize`` gives every ``nn.RNNBase`` layer of the model a pair of forward hooks: while
CPU autocast is on and the input is on the CPU, the layer runs with autocast off on
float32 inputs (its weights are float32 at these levels) and returns float32; the ops after
it cast as autocast decides. On CUDA (cuDNN RNNs in float16) and outside autocast the
layer is untouched. The cells (``nn.LSTMCell`` ...) are made of ops autocast handles and
are left alone.
"""
import torch
from torch import nn

from .._config.levels import HALF_DTYPES

__all__ = ["float32_recurrent_layers"]


def _to_float32(obj):
    if torch.is_tensor(obj):
        return obj.float() if obj.dtype in HALF_DTYPES else obj
    if isinstance(obj, nn.utils.rnn.PackedSequence):
        return obj._replace(data=_to_float32(obj.data))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_float32(v) for v in obj)
    return obj


def _first_tensor(obj):
    if torch.is_tensor(obj):
        return obj
    if isinstance(obj, (list, tuple)):
        for v in obj:
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class _Float32OnCpuAutocast:
    """The hook pair: ``before`` leaves autocast for the layer's forward, ``after`` returns to it."""

    def __init__(self):
        self.open = []  # one entry per call in flight: the autocast-off context, or None

    def before(self, module, args, kwargs):
        x = _first_tensor(args) if args else _first_tensor(list(kwargs.values()))
        if x is None or x.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            self.open.append(None)
            return None
        ctx = torch.autocast("cpu", enabled=False)
        ctx.__enter__()
        self.open.append(ctx)
        return _to_float32(args), {k: _to_float32(v) for k, v in kwargs.items()}

    def after(self, module, args, kwargs, output):
        ctx = self.open.pop() if self.open else None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        return None


def float32_recurrent_layers(model: nn.Module, device_type: str) -> bool:
    """Hook every ``nn.RNNBase`` layer of ``model`` (see the module docstring).

    Returns whether the model's forward should still open an autocast region: not when the
    model *is* one recurrent layer on the CPU (the region would only be undone again, and
    the hooks, which run around the forward, could not undo it from inside).
    """
    for module in model.modules():
        if isinstance(module, nn.RNNBase):
            hooks = _Float32OnCpuAutocast()
            module.register_forward_pre_hook(hooks.before, with_kwargs=True)
            module.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)
    return not (isinstance(model, nn.RNNBase) and device_type == "cpu")
