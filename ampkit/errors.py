"""ampkit's warning classes (warning filters name ``ampkit.errors.NoEffectWarning``)."""
from ._common.errors import NoEffectWarning

__all__ = ["NoEffectWarning"]
