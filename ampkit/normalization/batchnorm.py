"""The pickle path of the eval-mode BatchNorm fix's hooks (``ampkit.normalization.batchnorm``)."""
from .._model.batchnorm import CastInputToFloat, CastOutputBack, convert_batchnorm, enable_mixed_input_batchnorm

__all__ = ["convert_batchnorm", "enable_mixed_input_batchnorm", "CastInputToFloat", "CastOutputBack"]
