"""The pickle path of initialized models: a pickled model names ``ampkit.model_state._rebuild`` and its hooks."""
from ._model.model_state import ModelState, _Float32StateDict, _MasterLoadSync, _rebuild  # noqa: F401

__all__ = ["ModelState"]
