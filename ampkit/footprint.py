"""Persistent bytes per parameter of models and optimizers: weights, masters, optimizer state, side tables."""
from ._loop.footprint import bytes_per_param, persistent_bytes

__all__ = ["persistent_bytes", "bytes_per_param"]
