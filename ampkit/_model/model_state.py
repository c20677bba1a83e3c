"""What ``initialize`` attaches to a model: casting forward, float32 checkpoints, master sync.

The model's class is swapped for a subclass (same name, cached per class) whose
``forward`` casts inputs, optionally runs under ``torch.autocast``, and casts outputs.
Unlike a closure assigned to ``model.forward`` this survives ``copy.deepcopy``,
pickling, ``torch.compile`` and DataParallel replication, and ``isinstance`` checks
against the original class still hold. ``model._ampkit`` is a `ModelState`.
"""
import inspect
import itertools
import weakref
from collections.abc import Mapping
from typing import Dict, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._config.levels import HALF_DTYPES
from .._kernels.remainder import master as combined_master
from .._kernels.remainder import split_
from .._parallel.ddp_windows import watch_active
from .._update.shards import like, local
from .apex_lists import in_apex_fp32_region
from .casting import cast_tree
from .copies import make_standalone, sync, sync_one


class ModelState:
    """How an initialized model casts, and which of its parameters have fp32 masters."""

    dtype_error: Optional[str] = None  # set when the model was cast after initialize (AmpModule._apply)
    ddp_window = None  # the accumulation window of the DDP module running this model (ddp_windows.py)
    fsdp_root = None  # weakref to the model, when FSDP2 shards it (scale_loss asks whether it holds gradients back)

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
        # master_weights="remainder": bf16 param -> int16 remainder (of a sharded parameter: its local shard's)
        self.remainders: Dict[torch.Tensor, torch.Tensor] = {}
        self._param_ids = {id(p) for p in model.parameters()}
        self.synced = None  # on copies only: see copies.py
        # FSDP2 already manages it (the user's fully_shard before initialize), or
        # initialize(fsdp=True) will: set there.
        self.sharded = bool(model.__dict__.get("_is_fsdp_managed_module"))
        if self.sharded:
            self.fsdp_root = weakref.ref(model)

    def __getstate__(self):
        """Pickled and copied without the links to this process's DDP and FSDP objects."""
        return {k: v for k, v in self.__dict__.items() if k not in ("ddp_window", "fsdp_root")}

    def holds_gradients_back(self) -> bool:
        """Whether FSDP2 keeps this model's gradients unreduced (``set_requires_gradient_sync(False)``)."""
        from .._parallel.fsdp import gradient_sync_off

        model = self.fsdp_root() if self.fsdp_root is not None else None
        return model is not None and gradient_sync_off(model)

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._param_ids

    def replace_param(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Module surgery put ``new`` in the model where ``old`` was."""
        self.masters.pop(old, None)
        rem = self.remainders.pop(old, None)
        if rem is not None and new.dtype == torch.bfloat16 and new.shape == rem.shape:
            self.remainders[new] = rem if torch.equal(new.detach(), old.detach()) else torch.zeros_like(rem)
        if id(old) in self._param_ids:
            self._param_ids.discard(id(old))
            self._param_ids.add(id(new))


def _hooked(module: nn.Module) -> bool:
    """True when ``attach`` installed ampkit's hooks on ``module``."""
    return any(isinstance(h, _Float32StateDict) for h in module._state_dict_hooks.values())


def _own_tree(module: nn.Module, prefix: str):
    """``(module, prefix)`` for ``module`` and the descendants no hooked module below it covers.

    Modules inserted after ``initialize`` (module surgery) carry no hooks of their own; the
    nearest hooked ancestor handles their parameters and buffers. Each parameter is thus
    handled exactly once per ``state_dict``/``load_state_dict`` call, in O(model) total.
    """
    yield module, prefix
    stack = [(c, prefix + n + ".") for n, c in module._modules.items() if c is not None]
    while stack:
        m, p = stack.pop()
        if _hooked(m):
            continue
        yield m, p
        stack.extend((c, p + n + ".") for n, c in m._modules.items() if c is not None)


class _Float32StateDict:
    """State-dict hook: half tensors are saved as float32; mastered params as their master.

    With ``keep_vars=True`` the entries are the parameters and buffers themselves and are
    left alone.
    """

    def __init__(self, state: ModelState):
        self.state = state

    def __call__(self, module, state_dict, prefix, local_metadata):
        masters = self.state.masters
        remainders = getattr(self.state, "remainders", {})  # absent from states pickled before 0.3
        copied = self.state.synced is not None
        for mod, pre in _own_tree(module, prefix):
            for tensors in (mod._parameters, mod._buffers):
                for name, t in tensors.items():
                    key = pre + name
                    if t is None or key not in state_dict or state_dict[key] is t:
                        continue
                    master = masters.get(t)
                    if master is not None:
                        if copied:
                            sync_one(self.state, t, master)
                        state_dict[key] = master.detach()
                    elif t in remainders:
                        state_dict[key] = like(combined_master(local(t.detach()), remainders[t]), t)
                    elif state_dict[key].dtype in HALF_DTYPES:
                        state_dict[key] = state_dict[key].float()


class _MasterLoadSync:
    """Load hooks: a loaded value goes into the fp32 master exactly, not via the half copy.

    ``before`` (ahead of the module's own load) records (tensor, master, loaded value) for
    the parameters it covers; ``after`` (once the module and its children are loaded)
    copies them, so master and half parameter change together or not at all. On a copy
    (copies.py) the pair is then marked in sync, so that the next in-place update of the half
    tensor (``AveragedModel.update_parameters``) is not mistaken for a stale one.
    """

    def __init__(self, state: ModelState):
        self.state = state
        self.incoming = []

    def before(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        self.incoming = []
        masters, remainders = self.state.masters, getattr(self.state, "remainders", {})
        if not (masters or remainders):
            return
        for mod, pre in _own_tree(module, prefix):
            for name, p in itertools.chain(mod._parameters.items(), mod._buffers.items()):  # buffers: copies
                target = None if p is None else masters.get(p, p if p in remainders else None)
                value = state_dict.get(pre + name)
                if target is None or not torch.is_tensor(value):
                    continue
                if target.dim() == 0 and value.shape == (1,):  # torch loads these too (old checkpoints)
                    value = value[0]
                if value.shape == target.shape:
                    self.incoming.append((p, target, value))

    def after(self, module, incompatible_keys):
        incoming, self.incoming = self.incoming, []
        remainders = getattr(self.state, "remainders", {})
        with torch.no_grad():
            for p, target, value in incoming:
                if target in remainders:  # the loaded value is the fp32 master: weight and remainder
                    split_([local(target)], [remainders[target]], [local(value.detach().float())])
                else:
                    target.copy_(value)
                    if self.state.synced is not None:
                        sync_one(self.state, p, target)


class AmpModule:
    """Mixin placed in front of the model's class by `attach`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__mro__[1] is not AmpModule:  # a class swapped in front after initialize (fully_shard)
            from .._parallel.fsdp import check_calls

            check_calls(cls)

    def forward(self, *args, **kwargs):
        st: ModelState = self._ampkit
        if st.dtype_error is not None:
            raise RuntimeError(st.dtype_error)
        if st.synced is not None:
            sync(st)
        if not st.sharded and (type(self).__mro__[1] is not AmpModule or "_is_fsdp_managed_module" in self.__dict__):
            from .._parallel.fsdp import check_not_resharded

            check_not_resharded(self)
        if not st.sharded and not torch.compiler.is_compiling():
            watch_active(st)
        if st.input_dtype is not None:
            args = cast_tree(args, st.input_dtype)
            kwargs = cast_tree(kwargs, st.input_dtype)
        if st.autocast_dtype is not None:
            with torch.autocast(st.autocast_device, dtype=st.autocast_dtype):
                out = in_apex_fp32_region(super().forward, args, kwargs)
        else:
            out = super().forward(*args, **kwargs)
        if st.output_dtype is not None:
            out = cast_tree(out, st.output_dtype)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, but a strict load with wrong keys or shapes changes nothing.

        Float32 or half values are accepted and cast to the model's dtypes; parameters with
        fp32 masters get the loaded values in the master exactly (see ``_MasterLoadSync``).
        """
        if assign:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict(assign=True): not supported on a model passed through "
                f"ampkit.initialize; assigning would replace the parameters its optimizer (and their fp32 "
                f"master weights) hold and undo the model's casting. Use assign=False (the default): values "
                f"are copied into the existing parameters and cast to their dtypes."
            )
        if strict and isinstance(state_dict, Mapping):
            _check_loadable(self, state_dict)
        if isinstance(state_dict, Mapping):
            _check_finite(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn, recurse=True):
        """``model.half()``, ``.float()``, ``.to(dtype)``... after ``initialize``: the next forward
        and ``optimizer.step()`` raise (device moves are fine)."""
        before = _dtypes(self)
        result = super()._apply(fn, recurse)
        changed = [(k, before[k], d) for k, d in _dtypes(self).items() if k in before and before[k] != d]
        if changed:
            name, old, new = changed[0]
            self._ampkit.dtype_error = (
                f"{type(self).__name__} was cast after ampkit.initialize ({len(changed)} tensor(s) changed dtype, "
                f"e.g. {name}: {old} -> {new}) by model.half()/.float()/.bfloat16()/.to(dtype): the model no "
                f"longer matches its opt level nor its optimizer's fp32 master weights. ampkit casts the model "
                f"itself; to train at another level, build a fresh fp32 model and optimizer and initialize them."
            )
        return result

    def __setstate__(self, state):
        """A copy (``copy.deepcopy``, unpickling) gets float32 weights of its own: copies.py."""
        super().__setstate__(state)
        if "_ampkit" in self.__dict__:
            make_standalone(self)

    def __copy__(self):
        """``copy.copy``: a second handle on the same parameters and state, as for any module."""
        new = _rebuild(type(self).__mro__[2])
        nn.Module.__setstate__(new, self.__dict__.copy())
        return new

    def __reduce_ex__(self, protocol):
        return (_rebuild, (type(self).__mro__[2],), self.__getstate__())  # the class's own state (RNNs drop weakrefs)


def _dtypes(model: nn.Module) -> Dict[str, torch.dtype]:
    return {k: t.dtype for k, t in itertools.chain(model.named_parameters(), model.named_buffers())}


_STANDARD_LOADERS = (nn.Module._load_from_state_dict, _BatchNorm._load_from_state_dict)


def _predictable(module: nn.Module) -> bool:
    """Whether ``_check_loadable`` can tell in advance what torch's load of ``module`` will report."""
    if type(module)._load_from_state_dict not in _STANDARD_LOADERS:
        return False
    hooks = list(module._load_state_dict_pre_hooks.values()) + list(module._load_state_dict_post_hooks.values())
    return all(isinstance(getattr(getattr(h, "hook", h), "__self__", None), _MasterLoadSync) for h in hooks)


def _load_errors(model: nn.Module, state_dict: Mapping) -> list:
    """The errors a strict ``nn.Module.load_state_dict`` would report, in its order and words."""
    metadata = getattr(state_dict, "_metadata", None)
    missing, unexpected, errors = [], [], []

    def visit(module, prefix, keys):
        local = {k: v for k, v in module._parameters.items() if v is not None}
        local.update(
            (k, v) for k, v in module._buffers.items() if v is not None and k not in module._non_persistent_buffers_set
        )
        filled = set()
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            version = None if metadata is None else metadata.get(prefix[:-1], {}).get("version")
            if version is None or version < 2:  # torch fills in num_batches_tracked for old checkpoints
                filled.add(prefix + "num_batches_tracked")
        for name, mine in local.items():
            key = prefix + name
            if key not in state_dict:
                if key not in filled:
                    missing.append(key)
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                errors.append(
                    f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                    f"from checkpoint but received {type(value)}"
                )
                continue
            if nn.parameter.is_lazy(mine):
                continue
            shape = value.shape
            if len(mine.shape) == 0 and len(shape) == 1:
                shape = value[0].shape
            if shape != mine.shape:
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                    f"the shape in current model is {mine.shape}."
                )
        extra = prefix + "_extra_state"
        if type(module).get_extra_state is not nn.Module.get_extra_state and extra not in state_dict:
            missing.append(extra)
        for key in keys:
            if key.startswith(prefix) and key != extra:
                name = key[len(prefix):].split(".", 1)
                if len(name) > 1:
                    if name[0] not in module._modules:
                        unexpected.append(key)
                elif name[0] not in local:
                    unexpected.append(key)
        for name, child in module._modules.items():
            if child is not None:
                child_prefix = prefix + name + "."
                visit(child, child_prefix, [k for k in keys if k.startswith(child_prefix)])

    visit(model, "", list(state_dict.keys()))
    if unexpected:
        errors.insert(0, "Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        errors.insert(0, "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    return errors


def _check_finite(model: nn.Module, state_dict: Mapping) -> None:
    """Refuse parameters holding inf/NaN, as ``initialize`` does, before anything is copied."""
    for name, _ in model.named_parameters():
        value = state_dict.get(name)
        if torch.is_tensor(value) and value.is_floating_point() and value.numel() and not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"{type(model).__name__}.load_state_dict: {name} holds inf/NaN values; ampkit.initialize refuses such "
                f"weights (training would only spread them), and so does loading them into an initialized model. "
                f"Nothing was loaded; check the checkpoint."
            )


def _check_loadable(model: nn.Module, state_dict: Mapping) -> None:
    """Raise PyTorch's own error for a strict load that would fail, before anything is copied.

    Skipped (torch then reports as usual) when a module loads in a way that cannot be
    predicted: a custom ``_load_from_state_dict``, or load hooks other than ampkit's.
    """
    if not all(_predictable(m) for m in model.modules()):
        return
    errors = _load_errors(model, state_dict)
    if errors:
        raise RuntimeError(
            "Error(s) in loading state_dict for {}:\n\t{}".format(type(model).__name__, "\n\t".join(errors))
        )


_CLASSES: Dict[type, type] = {}


def amp_class(base: type) -> type:
    """The cached ``AmpModule`` subclass of ``base``, carrying ``base``'s name."""
    cls = _CLASSES.get(base)
    if cls is None:
        namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "forward": _forward_of(base)}
        cls = type(base.__name__, (AmpModule, base), namespace)
        _CLASSES[base] = cls
    return cls


def _forward_of(base: type):
    """``AmpModule.forward`` under ``base.forward``'s signature and docstring: code that reads the
    signature (transformers' ``Trainer`` keeps only the batch columns ``forward`` names) sees the
    model's own."""

    def forward(self, *args, **kwargs):
        return AmpModule.forward(self, *args, **kwargs)

    forward.__doc__ = base.forward.__doc__
    try:
        forward.__signature__ = inspect.signature(base.forward)
    except (TypeError, ValueError):  # a forward without a readable signature keeps (*args, **kwargs)
        pass
    return forward


def _rebuild(base: type):
    return object.__new__(amp_class(base))


# What a pickled model names: its public path, stable across layouts (``ampkit/model_state.py``).
for _pickled in (ModelState, _Float32StateDict, _MasterLoadSync, _rebuild):
    _pickled.__module__ = "ampkit.model_state"


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
