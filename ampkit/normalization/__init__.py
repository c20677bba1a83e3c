"""Normalization layers and transforms for mixed precision."""
from .._model.apex_norms import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from .._model.batchnorm import convert_batchnorm, enable_mixed_input_batchnorm
from .._model.layer_norm import LPLayerNorm, apply_low_precision_layernorm

__all__ = [
    "LPLayerNorm", "apply_low_precision_layernorm",
    "FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm", "MixedFusedRMSNorm",
    "convert_batchnorm", "enable_mixed_input_batchnorm",
]
