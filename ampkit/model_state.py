"""``ampkit.model_state`` is ``ampkit.install.model_state`` (pickled models name ``ampkit.model_state._rebuild``)."""
import sys

from .install import model_state

sys.modules[__name__] = model_state
