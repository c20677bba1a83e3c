"""LR schedulers that hold when ampkit skipped the optimizer step (an overflow).

Frameworks step the scheduler after every optimizer step whether or not ampkit skipped it
(Lightning #18828); a held scheduler's ``step()`` does nothing after a skipped step, so the
schedule follows the updates actually made, as with ``if not ampkit.step_was_skipped(opt)``
in a hand-written loop.
"""
from .._loop.state import step_was_skipped
from .mixins import with_mixin

__all__ = ["hold_on_skipped_steps"]


class _Held:
    """Mixin placed in front of the scheduler's class by `hold_on_skipped_steps`."""

    def step(self, *args, **kwargs):
        optimizer = getattr(self, "optimizer", None)
        if getattr(optimizer, "_ampkit", None) is not None and step_was_skipped(optimizer):
            return None
        return super().step(*args, **kwargs)


def hold_on_skipped_steps(scheduler):
    """Make ``scheduler.step()`` a no-op right after its optimizer's step was skipped; returns it.

    The scheduler's class is swapped for a cached subclass of the same name (its ``__dict__``,
    hence ``state_dict()``, is untouched); a scheduler already held is left as it is.
    """
    return with_mixin(scheduler, _Held)
