"""Zero-edit migration: make ``import apex`` resolve to ampkit in this process.

``python -m ampkit.apex_compat train.py ARGS...`` (or ``install()`` in a notebook, before
the first ``import apex``) puts a finder on ``sys.meta_path`` that answers ``apex``,
``apex.amp``, ``apex.parallel`` (with ``apex.parallel.LARC``), ``apex.normalization`` and
``apex.fp16_utils`` with modules that forward to ampkit's, and ``apex.optimizers``,
``apex.multi_tensor_apply`` and ``amp_C`` with their torch counterparts. The same finder
gives ``importlib.metadata`` an ``apex`` distribution record. Nothing outside this process
changes; nothing is written to disk. A real installed Apex is never shadowed silently:
``install`` refuses unless told to (``shadow_installed_apex=True``, the runner's
``--shadow-apex``, or ``AMPKIT_APEX=ampkit`` in the environment).
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

from .. import __version__
from .._common import switches
from . import metadata

__all__ = ["install", "uninstall", "installed", "ApexInstalledError", "ENV"]

ENV = "AMPKIT_APEX"  # "ampkit": stand in even over an installed Apex; "apex": use the installed Apex

_ALIASES = {  # apex module -> the module it forwards to (None: the top-level package)
    "apex": None,
    "apex.amp": "ampkit",
    "apex.amp._amp_state": "ampkit._apex.apex_state",
    "apex.parallel": "ampkit.parallel",
    "apex.parallel.LARC": "ampkit._parallel.larc",
    "apex.parallel.distributed": "ampkit._parallel.distributed",
    "apex.parallel.sync_batchnorm": "ampkit._parallel.sync_batchnorm",
    "apex.parallel.optimized_sync_batchnorm": "ampkit._parallel.sync_batchnorm",
    "apex.normalization": "ampkit.normalization",
    "apex.normalization.fused_layer_norm": "ampkit._model.apex_norms",
    "apex.fp16_utils": "ampkit.fp16_utils",
    "apex.fp16_utils.fp16util": "ampkit.fp16_utils",
    "apex.fp16_utils.fp16_optimizer": "ampkit.fp16_utils",
    "apex.fp16_utils.loss_scaler": "ampkit.fp16_utils",
    "apex.optimizers": "ampkit.apex_compat.optimizers",
    **{f"apex.optimizers.{m}": "ampkit.apex_compat.optimizers" for m in (
        "fused_adam", "fused_sgd", "fused_adagrad", "fused_lamb", "fused_novograd", "fused_mixed_precision_lamb")},
    "apex.multi_tensor_apply": "ampkit.apex_compat.multi_tensor",
    "apex.multi_tensor_apply.multi_tensor_apply": "ampkit.apex_compat.multi_tensor",
    "amp_C": "ampkit.apex_compat.amp_ops",
}
_PACKAGES = {"apex", "apex.amp", "apex.parallel", "apex.normalization", "apex.fp16_utils", "apex.optimizers",
             "apex.multi_tensor_apply"}
_SERVED = "apex.amp, apex.parallel, apex.normalization, apex.fp16_utils, apex.optimizers and apex.multi_tensor_apply"
_NOT_PROVIDED = {  # what to use instead, for Apex packages ampkit does not stand in for
    "apex.contrib": "apex.contrib has no ampkit counterpart",
    "apex.transformer": "apex.transformer has no ampkit counterpart",
    "apex.mlp": "use torch.nn.Linear layers",
    "apex.RNN": "use torch.nn.LSTM / GRU / RNN",
    "apex.optimizers.fp16_optimizer": "use amp.initialize(model, optimizer, opt_level='O2') (fp32 master weights) "
                                      "or apex.fp16_utils.FP16_Optimizer",
    "apex.parallel.multiproc": "launch with torchrun --nproc-per-node N -m ampkit.apex_compat SCRIPT",
}
_MISSING_NAMES = {  # names inside a stood-in module that ampkit does not have, and what to use
    "apex.parallel": {"Reducer": "call torch.distributed.all_reduce on the gradients yourself, or wrap the "
                                 "model in apex.parallel.DistributedDataParallel (ampkit's)"},
}


class ApexInstalledError(RuntimeError):
    """A real Apex is installed (or imported) and shadowing it was not asked for."""


def _announce() -> None:
    if not _Finder.announced:
        _Finder.announced = True
        print(f"ampkit {__version__} is standing in for NVIDIA Apex in this process "
              f"(apex.amp, apex.parallel, apex.normalization, apex.fp16_utils -> ampkit; "
              f"apex.optimizers, amp_C -> torch).", file=sys.stderr, flush=True)


def _public(target: types.ModuleType) -> dict:
    """The public attributes of ``target`` (its ``__all__``, else its names without a leading
    underscore), resolved; submodules stay out, to be imported on first use as in any package."""
    names = getattr(target, "__all__", None) or dir(target)
    is_package = hasattr(target, "__path__")
    found = {}
    for attr in (n for n in names if not n.startswith("_")):
        if is_package and attr not in vars(target) and importlib.util.find_spec(f"{target.__name__}.{attr}"):
            continue
        value = getattr(target, attr)
        if not isinstance(value, types.ModuleType):
            found[attr] = value
    return found


def _renamed(error: AttributeError, target_name: str, name: str) -> AttributeError:
    """``error`` from ``target_name`` as the user met it: through the apex module ``name``."""
    message = str(error).replace(f"module {target_name!r}", f"module {name!r}", 1)
    if message.startswith(f"{target_name}."):
        message = name + message[len(target_name):]
    return AttributeError(message)


def _forwarding_module(name: str) -> types.ModuleType:
    """A real module named ``name`` holding the public attributes of the module it stands for
    (``'state_dict' in amp.__dict__`` holds); other names are read from that module on use."""
    module = types.ModuleType(name, f"ampkit standing in for {name}.")
    target_name = _ALIASES[name]

    def __getattr__(attr):
        if target_name is None:  # the apex package: its subpackages, imported on first use
            if f"apex.{attr}" in _ALIASES or f"apex.{attr}" in _NOT_PROVIDED:
                return importlib.import_module(f"apex.{attr}")
            raise AttributeError(f"module 'apex' has no attribute {attr!r} (ampkit stands in for {_SERVED})")
        if attr == "ReduceOp" and name == "apex.parallel":
            import torch.distributed

            return torch.distributed.ReduceOp  # what Apex's was too
        hint = _MISSING_NAMES.get(name, {}).get(attr)
        if hint is not None:
            raise AttributeError(f"{name}.{attr} is not provided by ampkit's Apex stand-in: {hint}.")
        target = importlib.import_module(target_name)  # its __name__ may differ (a path shim)
        try:
            return getattr(target, attr)
        except AttributeError as e:
            raise _renamed(e, target.__name__, name) from None

    def __dir__():
        if target_name is None:
            return sorted(set(vars(module)) | {n.split(".")[1] for n in _ALIASES if n.count(".") == 1})
        return sorted(set(vars(module)) | set(dir(importlib.import_module(target_name))))

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
    if target_name is not None:
        target = importlib.import_module(target_name)
        vars(module).update(_public(target))
        if hasattr(target, "__all__"):
            module.__all__ = list(target.__all__)
    return module


class _Finder(importlib.metadata.DistributionFinder, importlib.abc.Loader):
    """Finds ``apex``, its submodules and ``amp_C`` as forwarding modules, and the stand-in's
    ``apex`` distribution record for ``importlib.metadata``."""

    announced = False

    def find_spec(self, fullname, path, target=None):
        if fullname in _ALIASES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _PACKAGES)
        if not fullname.startswith("apex."):
            return None
        parts = fullname.split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts), 1, -1))
        hint = next((_NOT_PROVIDED[p] for p in prefixes if p in _NOT_PROVIDED), f"ampkit stands in for {_SERVED} only")
        raise ModuleNotFoundError(f"No module named {fullname!r} under ampkit's Apex stand-in: {hint}.", name=fullname)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        return metadata.find_distributions(context)

    def create_module(self, spec):
        _announce()
        module = _forwarding_module(spec.name)
        if spec.name in _PACKAGES:
            module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_finder = _Finder()


def installed() -> bool:
    """True while the stand-in finder is on ``sys.meta_path``."""
    return _finder in sys.meta_path


def _real_apex():
    """The spec of an Apex that Python would import without the stand-in, or None."""
    if installed():
        return None
    try:
        return importlib.util.find_spec("apex")
    except (ImportError, ValueError):
        return None


def install(shadow_installed_apex=None) -> bool:
    """Make ``import apex`` (and its parts named in the module docstring, and ``amp_C``)
    resolve to ampkit's stand-in in this process, and ``importlib.metadata`` find an ``apex``
    distribution; True when the stand-in is active.

    ``shadow_installed_apex``: what to do when a real Apex is installed. None (the default)
    reads ``AMPKIT_APEX`` from the environment: ``"ampkit"`` stands in anyway, ``"apex"``
    keeps the real Apex (and returns False); unset, an `ApexInstalledError` says so
    and names both choices. Call it before anything imports ``apex``, and before importing
    a library that decides at import time whether Apex is there (transformers does).
    """
    if installed():
        return True
    if shadow_installed_apex is None:
        choice = switches.get(ENV).strip().lower()
        if choice not in ("", "ampkit", "apex"):
            raise ValueError(f"{ENV}={choice!r}: expected 'ampkit' (stand in for an installed Apex) or 'apex' (use it).")
        if choice == "apex":
            return False
        shadow_installed_apex = choice == "ampkit"
    elif not isinstance(shadow_installed_apex, bool):
        raise TypeError(f"install(shadow_installed_apex={shadow_installed_apex!r}): expected True, False or None.")
    loaded = sys.modules.get("apex")
    if loaded is not None:
        raise ApexInstalledError(
            f"apex is already imported in this process (from {getattr(loaded, '__file__', None) or loaded!r}); "
            f"call ampkit.apex_compat.install() before the first `import apex`, or restart the process."
        )
    real = _real_apex()
    if real is not None and not shadow_installed_apex:
        where = real.origin or (list(real.submodule_search_locations or []) or ["?"])[0]
        raise ApexInstalledError(
            f"a real NVIDIA Apex is installed ({where}); ampkit will not shadow it silently. To run on ampkit "
            f"instead, pass --shadow-apex to `python -m ampkit.apex_compat`, call install(shadow_installed_apex=True), "
            f"or set {ENV}=ampkit; to use the installed Apex, run the script with plain `python` (or set {ENV}=apex)."
        )
    sys.meta_path.insert(0, _finder)
    return True


def uninstall() -> None:
    """Remove the stand-in (and with it the ``apex`` distribution record) and forget the
    ``apex`` and ``amp_C`` modules it created."""
    if installed():
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n in _ALIASES or n.startswith("apex.")]:
        if getattr(sys.modules[name].__spec__, "loader", None) is _finder:
            del sys.modules[name]
