"""``ampkit.fp16_utils`` is ``ampkit.api.fp16_utils`` (``import ampkit.fp16_utils`` is public API)."""
import sys

from .api import fp16_utils

sys.modules[__name__] = fp16_utils
