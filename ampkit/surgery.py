"""``ampkit.surgery`` is ``ampkit.install.surgery`` (``import ampkit.surgery`` is public API)."""
import sys

from .install import surgery

sys.modules[__name__] = surgery
