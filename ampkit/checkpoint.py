"""Checkpoints of a whole training state: models, optimizers, loss scalers and the run, in one file."""
from ._loop.checkpoint import CheckpointError, load, save

__all__ = ["CheckpointError", "save", "load"]
