"""``ampkit.float8`` is ``ampkit.install.float8`` (``import ampkit.float8`` is public API)."""
import sys

from .install import float8

sys.modules[__name__] = float8
