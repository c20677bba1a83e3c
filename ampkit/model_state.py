"""What ``initialize`` attaches to a model: casting forward, float32 checkpoints, master sync.

The model's class is swapped for a subclass (same name, cached per class) whose
``forward`` casts inputs, optionally runs under ``torch.autocast``, and casts outputs.
Unlike a closure assigned to ``model.forward`` this survives ``copy.deepcopy``,
pickling, ``torch.compile`` and DataParallel replication, and ``isinstance`` checks
against the original class still hold. ``model._ampkit`` is a :class:`ModelState`.
"""
from typing import Dict, Optional

import torch
from torch import nn

from .casting import cast_tree
from .opt_levels import HALF_DTYPES


class ModelState:
    """How an initialized model casts, and which of its parameters have fp32 masters."""

    def __init__(
        self,
        model: nn.Module,
        input_dtype: Optional[torch.dtype],
        output_dtype: Optional[torch.dtype],
        autocast_device: Optional[str],
        autocast_dtype: Optional[torch.dtype],
    ):
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.autocast_device = autocast_device
        self.autocast_dtype = autocast_dtype
        self.masters: Dict[torch.Tensor, torch.Tensor] = {}
        self._param_ids = {id(p) for p in model.parameters()}
        self.counting_keys = False

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._param_ids


class _Float32StateDict:
    """State-dict hook: half tensors are saved as float32; mastered params as their master."""

    def __init__(self, state: ModelState):
        self.state = state

    def __call__(self, module, state_dict, prefix, local_metadata):
        if self.state.counting_keys:
            return
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or key not in state_dict or isinstance(state_dict[key], nn.Parameter):
                continue
            master = self.state.masters.get(p)
            if master is not None:
                state_dict[key] = master.detach()
            elif p.dtype in HALF_DTYPES:
                state_dict[key] = state_dict[key].float()
        for name, b in module._buffers.items():
            key = prefix + name
            if b is not None and key in state_dict and b.dtype in HALF_DTYPES:
                state_dict[key] = state_dict[key].float()


class _MasterLoadSync:
    """Load hooks: a loaded value goes into the fp32 master exactly, not via the half copy."""

    def __init__(self, state: ModelState):
        self.state = state
        self.incoming = []

    def before(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, p in module._parameters.items():
            master = self.state.masters.get(p)
            value = state_dict.get(prefix + name)
            if master is not None and torch.is_tensor(value) and value.shape == master.shape:
                self.incoming.append((master, value))

    def after(self, module, incompatible_keys):
        with torch.no_grad():
            for master, value in self.incoming:
                master.copy_(value)
        self.incoming.clear()


class AmpModule:
    """Mixin placed in front of the model's class by :func:`attach`."""

    def forward(self, *args, **kwargs):
        st: ModelState = self._ampkit
        if st.input_dtype is not None:
            args = cast_tree(args, st.input_dtype)
            kwargs = cast_tree(kwargs, st.input_dtype)
        if st.autocast_dtype is not None:
            with torch.autocast(st.autocast_device, dtype=st.autocast_dtype):
                out = super().forward(*args, **kwargs)
        else:
            out = super().forward(*args, **kwargs)
        if st.output_dtype is not None:
            out = cast_tree(out, st.output_dtype)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, but a strict load with wrong keys or shapes changes nothing."""
        if strict:
            _check_loadable(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def __reduce_ex__(self, protocol):
        return (_rebuild, (type(self).__mro__[2],), self.__dict__.copy())


def _check_loadable(model: nn.Module, state_dict) -> None:
    st: ModelState = model._ampkit
    st.counting_keys = True
    try:
        own = model.state_dict(keep_vars=True)
    finally:
        st.counting_keys = False
    errors = []
    unexpected = [k for k in state_dict if k not in own]
    missing = [k for k in own if k not in state_dict and not k.endswith("num_batches_tracked")]
    if unexpected:
        errors.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    for key, value in state_dict.items():
        mine = own.get(key)
        if torch.is_tensor(value) and torch.is_tensor(mine) and value.shape != mine.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                f"the shape in current model is {mine.shape}."
            )
    if errors:
        raise RuntimeError(
            "Error(s) in loading state_dict for {}:\n\t{}".format(type(model).__name__, "\n\t".join(errors))
        )


_CLASSES: Dict[type, type] = {}


def amp_class(base: type) -> type:
    """The cached ``AmpModule`` subclass of ``base``, carrying ``base``'s name."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (AmpModule, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _CLASSES[base] = cls
    return cls


def _rebuild(base: type):
    return object.__new__(amp_class(base))


def attach(model: nn.Module, state: ModelState) -> None:
    """Install ``state`` on ``model``: class swap, state-dict and load hooks."""
    model._ampkit = state
    model.__class__ = amp_class(type(model))
    dump = _Float32StateDict(state)
    for module in model.modules():
        module.register_state_dict_post_hook(dump)
        sync = _MasterLoadSync(state)
        module.register_load_state_dict_pre_hook(sync.before)
        module.register_load_state_dict_post_hook(sync.after)
