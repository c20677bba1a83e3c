"""ampkit: Apex-style mixed-precision training (opt levels O0-O5) on modern PyTorch."""
from .autocasting import (
    autocast,
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from . import checkpoint, float8, footprint, normalization, parallel, stochastic_rounding, surgery
from .errors import NoEffectWarning
from .frontend import initialize, load_state_dict, master_params, scale_loss, state_dict
from .opt_levels import OPT_LEVELS, Properties
from .scaler import LossScaler

__version__ = "0.1.0"

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "autocast", "disable_casts", "half_function", "float_function", "promote_function",
    "register_half_function", "register_float_function", "register_promote_function",
    "NoEffectWarning", "OPT_LEVELS", "Properties", "LossScaler",
]
