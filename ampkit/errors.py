"""``ampkit.errors`` is ``ampkit.core.errors`` (warning filters name ``ampkit.errors.NoEffectWarning``)."""
import sys

from .core import errors

sys.modules[__name__] = errors
