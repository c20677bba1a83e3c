"""Give a framework object ampkit's behaviour by swapping its class for a cached subclass.

The subclass keeps the class's name, module and qualified name and adds nothing to the object's
``__dict__``, so ``state_dict()``, pickling by name and the frameworks' ``isinstance`` checks see
the object as before.
"""
from typing import Dict, Tuple

__all__ = ["with_mixin"]

_CLASSES: Dict[Tuple[type, type], type] = {}  # (mixin, class) -> the subclass


def with_mixin(obj, mixin: type):
    """Put ``mixin`` in front of ``type(obj)`` (once: an object that has it is left alone); returns ``obj``."""
    if isinstance(obj, mixin):
        return obj
    base = type(obj)
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        cls = _CLASSES[mixin, base] = type(base.__name__, (mixin, base), {"__module__": base.__module__,
                                                                        "__qualname__": base.__qualname__})
    obj.__class__ = cls
    return obj
