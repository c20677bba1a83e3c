"""ampkit under accelerate: ``ampkit.initialize`` before ``accelerator.prepare``.

``AmpkitAccelerator`` is an ``accelerate.Accelerator`` (``mixed_precision="no"``: ampkit does the
mixed precision) whose ``prepare`` also registers ampkit's loss scalers for ``save_state`` and
marks prepared optimizers so that ``optimizer_step_was_skipped`` (and the prepared schedulers,
which then hold) see ampkit's skipped steps; ``clip_grad_norm_`` / ``clip_grad_value_`` of the
model's parameters clip the fp32 masters the optimizer steps on; ``backward(loss)`` runs inside
``ampkit.scale_loss`` unless it is already in one. `attach` makes an existing
``Accelerator`` one (the transformers ``Trainer`` builds its own).
"""
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from .._loop.state import step_was_skipped
from .._loop.training import scale_loss
from .._optim.optimizer_state import Stage
from .._optim.optimizer_wrappers import unwrap
from .mixins import with_mixin
from .stateful import AmpkitState

__all__ = ["AmpkitAccelerator", "attach"]


def _initialized(optimizers) -> list:
    """The optimizers behind ``optimizers`` that went through ``ampkit.initialize``."""
    inner = [unwrap(o) for o in optimizers]
    return [o for o in inner if getattr(o, "_ampkit", None) is not None]


class _Ampkit:
    """What ampkit changes in an Accelerator (mixin in front of its class)."""

    def prepare(self, *args, **kwargs):
        if self.mixed_precision != "no":
            raise ValueError(
                f"{type(self).__name__}(mixed_precision={self.mixed_precision!r}): ampkit does the mixed precision; "
                f"use mixed_precision='no' and pass the level to ampkit.initialize.")
        prepared = super().prepare(*args, **kwargs)
        self._adopt_optimizers()
        return prepared

    def _adopt_optimizers(self) -> None:
        """Mark the prepared optimizers skip-aware; register each ampkit run's state for ``save_state``."""
        registered = {id(s.optimizer._ampkit.run) for s in self._custom_objects if isinstance(s, AmpkitState)}
        for opt in self._optimizers:
            if isinstance(opt, AcceleratedOptimizer):
                with_mixin(opt, _SkipAware)
            for inner in _initialized([opt]):
                if id(inner._ampkit.run) not in registered:
                    registered.add(id(inner._ampkit.run))
                    self.register_for_checkpointing(AmpkitState(inner))

    def backward(self, loss, **kwargs):
        optimizers = _initialized(self._optimizers)
        if not optimizers or any(o._ampkit.stage is Stage.IN_BLOCK for o in optimizers):
            return super().backward(loss, **kwargs)  # the caller's own `with ampkit.scale_loss(...)`
        with scale_loss(loss, optimizers) as scaled:
            super().backward(scaled, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return super().clip_grad_norm_(self._stepped(parameters), max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        return super().clip_grad_value_(self._stepped(parameters), clip_value)

    def _stepped(self, parameters) -> list:
        """``parameters`` with each model parameter that has an fp32 master replaced by the master."""
        masters = {}
        for opt in _initialized(self._optimizers):
            masters.update(opt._ampkit.masters)
        return [masters.get(p, p) for p in parameters]


class _SkipAware:
    """An AcceleratedOptimizer whose ``step_was_skipped`` includes ampkit's skipped steps
    (``_ampkit_adopted``: ``scale_loss`` says when an AcceleratedOptimizer lacks it)."""

    _ampkit_adopted = True

    @property
    def step_was_skipped(self) -> bool:
        inner = _initialized([self])
        return bool(self._is_overflow) or any(step_was_skipped(o) for o in inner)


class AmpkitAccelerator(_Ampkit, Accelerator):
    """``accelerate.Accelerator`` for models and optimizers prepared by ``ampkit.initialize``."""


def attach(accelerator: Accelerator) -> Accelerator:
    """Make ``accelerator`` behave as an `AmpkitAccelerator` (its class is swapped for a subclass
    of the same name); optimizers it already prepared are marked and registered too. Returns it."""
    with_mixin(accelerator, _Ampkit)
    accelerator._adopt_optimizers()
    return accelerator
