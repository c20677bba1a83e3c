"""Module surgery: swap submodules by class, in place, keeping optimizers pointed at the model."""
from ._model.surgery import replace_module_classes

__all__ = ["replace_module_classes"]
