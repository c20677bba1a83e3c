"""ampkit: Apex-style mixed-precision training (opt levels O0-O8) on modern PyTorch.

Names are imported on first use, so ``ampkit --version`` and ``ampkit --help`` start
without importing torch.
"""
import importlib

from ._version import __version__

# public name -> the module that defines it ("" for a public submodule or subpackage itself)
_EXPORTS = {
    "initialize": "_initialize.initialize",
    "scale_loss": "_loop.training", "master_params": "_loop.training",
    "state_dict": "_loop.state", "load_state_dict": "_loop.state",
    "loss_scalers": "_loop.state", "step_was_skipped": "_loop.state", "nonfinite_gradients": "_loop.state",
    "autocast": "_model.autocasting", "disable_casts": "_model.autocasting",
    "half_function": "_model.autocasting", "float_function": "_model.autocasting",
    "promote_function": "_model.autocasting", "register_half_function": "_model.autocasting",
    "register_float_function": "_model.autocasting", "register_promote_function": "_model.autocasting",
    "enable_console_logging": "_common.logs",
    "NoEffectWarning": "_common.errors",
    "OPT_LEVELS": "_config.levels", "Properties": "_config.levels",
    "LossScaler": "_run.scaler",
    "capabilities": "_hardware", "Capabilities": "_hardware",
    "checkpoint": "", "normalization": "", "parallel": "", "surgery": "", "fp16_utils": "",
    "float8": "", "footprint": "", "stochastic_rounding": "",
    "precision_report": "_precision", "PrecisionReport": "_precision",
    "_amp_state": "_apex.apex_state",  # Apex's amp._amp_state, read-only
}

__all__ = ["__version__", *(name for name in _EXPORTS if not name.startswith("_"))]


def __getattr__(name):
    if name not in _EXPORTS:
        if name.startswith("__"):
            raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
        from ._apex.apex_state import removed_attribute  # Apex names (amp.init, ...) get a migration hint

        raise removed_attribute("ampkit", name)
    module = _EXPORTS[name]
    value = importlib.import_module(f".{module or name}", __name__)
    if module:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
