"""Models pickled by a 0.3.0 development build name ``ampkit.install.model_state``."""
from .._model.model_state import ModelState, _Float32StateDict, _MasterLoadSync, _rebuild  # noqa: F401

__all__ = ["ModelState"]
