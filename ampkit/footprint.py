"""``ampkit.footprint`` is ``ampkit.api.footprint`` (``import ampkit.footprint`` is public API)."""
import sys

from .api import footprint

sys.modules[__name__] = footprint
