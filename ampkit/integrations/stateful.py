"""ampkit's run state (loss scalers, the rounder's seed and step) as an object with ``state_dict`` /
``load_state_dict``: what frameworks checkpoint beside the model and the optimizer."""
from .._loop.state import load_state_dict, state_dict
from .._optim.optimizer_wrappers import unwrap

__all__ = ["AmpkitState"]


class AmpkitState:
    """The state of the run ``optimizer`` (or a framework's wrapper of it) belongs to.

    For accelerate's ``register_for_checkpointing`` and Fabric's ``fabric.save(path, {..., "amp": AmpkitState(opt)})``
    (the ``ampkit`` module itself also works there while one training run is alive).
    """

    def __init__(self, optimizer):
        self.optimizer = unwrap(optimizer)

    def state_dict(self) -> dict:
        return state_dict(optimizer=self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        load_state_dict(state, optimizer=self.optimizer)
