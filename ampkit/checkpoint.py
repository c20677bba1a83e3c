"""``ampkit.checkpoint`` is ``ampkit.api.checkpoint`` (``import ampkit.checkpoint`` is public API)."""
import sys

from .api import checkpoint

sys.modules[__name__] = checkpoint
