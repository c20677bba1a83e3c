"""ampkit: Apex-style mixed-precision training (opt levels O0-O5) on modern PyTorch.

Names are imported on first use, so ``ampkit --version`` and ``ampkit --help`` start
without importing torch.
"""
import importlib

__version__ = "0.2.0"

# public name -> the submodule that defines it ("" for a subpackage/submodule itself)
_EXPORTS = {
    "initialize": "frontend", "scale_loss": "frontend", "master_params": "frontend",
    "state_dict": "frontend", "load_state_dict": "frontend",
    "autocast": "autocasting", "disable_casts": "autocasting",
    "half_function": "autocasting", "float_function": "autocasting", "promote_function": "autocasting",
    "register_half_function": "autocasting", "register_float_function": "autocasting",
    "register_promote_function": "autocasting",
    "enable_console_logging": "logs",
    "NoEffectWarning": "errors",
    "OPT_LEVELS": "opt_levels", "Properties": "opt_levels",
    "LossScaler": "scaler",
    "capabilities": "hardware", "Capabilities": "hardware",
    "loss_scalers": "health", "step_was_skipped": "health",
    "checkpoint": "", "normalization": "", "parallel": "", "surgery": "", "fp16_utils": "",
    "float8": "", "footprint": "", "stochastic_rounding": "",
    "_amp_state": "apex_state",  # Apex's amp._amp_state, read-only
}

__all__ = ["__version__", *(name for name in _EXPORTS if not name.startswith("_"))]


def __getattr__(name):
    if name not in _EXPORTS:
        if name.startswith("__"):
            raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
        from .apex_state import removed_attribute  # Apex names (amp.init, ...) get a migration hint

        raise removed_attribute("ampkit", name)
    module = _EXPORTS[name]
    value = importlib.import_module(f".{module or name}", __name__)
    if module:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
