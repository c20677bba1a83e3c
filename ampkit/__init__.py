"""ampkit: Apex-style mixed-precision training (opt levels O0-O8) on modern PyTorch.

Names are imported on first use, so ``ampkit --version`` and ``ampkit --help`` start
without importing torch.
"""
import importlib

__version__ = "0.2.0"

# public name -> the module that defines it ("" for a public submodule or subpackage itself)
_EXPORTS = {
    "initialize": "pipeline.initialize",
    "scale_loss": "api.training", "master_params": "api.training",
    "state_dict": "api.state", "load_state_dict": "api.state",
    "loss_scalers": "api.state", "step_was_skipped": "api.state", "nonfinite_gradients": "api.state",
    "autocast": "install.autocasting", "disable_casts": "install.autocasting",
    "half_function": "install.autocasting", "float_function": "install.autocasting",
    "promote_function": "install.autocasting", "register_half_function": "install.autocasting",
    "register_float_function": "install.autocasting", "register_promote_function": "install.autocasting",
    "enable_console_logging": "core.logs",
    "NoEffectWarning": "core.errors",
    "OPT_LEVELS": "core.levels", "Properties": "core.levels",
    "LossScaler": "core.scaler",
    "capabilities": "install.hardware", "Capabilities": "install.hardware",
    "checkpoint": "", "normalization": "", "parallel": "", "surgery": "", "fp16_utils": "",
    "float8": "", "footprint": "", "stochastic_rounding": "",
    "precision_report": "api.precision", "PrecisionReport": "api.precision",
    "_amp_state": "api.apex_state",  # Apex's amp._amp_state, read-only
}

__all__ = ["__version__", *(name for name in _EXPORTS if not name.startswith("_"))]


def __getattr__(name):
    if name not in _EXPORTS:
        if name.startswith("__"):
            raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
        from .api.apex_state import removed_attribute  # Apex names (amp.init, ...) get a migration hint

        raise removed_attribute("ampkit", name)
    module = _EXPORTS[name]
    value = importlib.import_module(f".{module or name}", __name__)
    if module:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
