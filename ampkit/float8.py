"""float8 training through torchao (``opt_level="O6"`` or ``float8=...``): whether it is available here,
which layers it would convert, and the conversion itself."""
from ._model.float8 import EXTRA, available, check_exclude, convert_, eligible, has_fp8_matmul, require

__all__ = ["EXTRA", "available", "require", "check_exclude", "eligible", "has_fp8_matmul", "convert_"]
