"""The run's health: one-time warnings when loss scaling stops working, and weights that
are not finite to begin with.

Warnings go to ``logging.getLogger("ampkit")`` at WARNING level, once per loss scaler and
kind, whatever the ``verbosity`` (which only silences the INFO reports):

* ``CONSECUTIVE_SKIPS`` (20) overflowing steps in a row: training is not progressing
  (a healthy dynamic scale recovers within a handful of steps; 17 halvings already take
  the default 2**16 below 1). Not repeated for a scale pinned at ``min_loss_scale``, which
  has a warning of its own.
* A dynamic scale below ``underflow_scale(half_dtype)``: gradients that float16 itself
  could hold (down to 2**-24) now flush to zero in the half dtype. That is a scale below
  1.0 for float16 and below 2**-109 for bfloat16.
"""
import logging

import torch

logger = logging.getLogger("ampkit")

CONSECUTIVE_SKIPS = 20
_SMALLEST_FP16 = 2.0**-24  # float16's smallest subnormal: what an unscaled float16 gradient can hold


def underflow_scale(half_dtype: torch.dtype) -> float:
    """The dynamic scale below which gradients >= 2**-24 flush to zero in ``half_dtype``."""
    info = torch.finfo(half_dtype)
    smallest = info.smallest_normal * info.eps  # the smallest subnormal
    return smallest / _SMALLEST_FP16


def after_update(run, loss_id: int, scaler, nonfinite=()) -> None:
    """Warn once per scaler when its run stops being healthy (see the module docstring);
    ``nonfinite``: the parameters whose gradients overflowed in this step."""
    warned = scaler.warned
    pinned = scaler.at_floor  # then the min_loss_scale warning (overflow.py) has said it already
    if scaler.consecutive_overflows >= CONSECUTIVE_SKIPS and not pinned and "skips" not in warned:
        warned.add("skips")
        logger.warning(
            "ampkit: loss scaler %d has skipped %d steps in a row (loss scale now %s): every gradient "
            "holds inf/NaN and the weights are not being updated. Look for inf/NaN in the forward pass or "
            "the loss (a bad batch, a too-high learning rate that already made the weights overflow). %s",
            loss_id, scaler.consecutive_overflows, scaler.loss_scale(), _culprits(nonfinite))
    half = getattr(run.properties, "half_dtype", None)
    if ("underflow" not in warned and scaler.dynamic and half is not None
            and scaler.loss_scale() < underflow_scale(half)):
        warned.add("underflow")
        logger.warning(
            "ampkit: loss scaler %d's dynamic loss scale has fallen to %s (below %s): %s gradients "
            "smaller than %.3g now flush to zero. The overflows that drove it down come from inf/NaN in "
            "the forward pass or the loss, not from large gradients; set min_loss_scale to stop the descent.",
            loss_id, scaler.loss_scale(), underflow_scale(half), str(half).replace("torch.", ""),
            underflow_scale(half) * _SMALLEST_FP16 / scaler.loss_scale())


def check_finite_weights(models) -> None:
    """Refuse models whose parameters already hold inf/NaN (nothing would train them back)."""
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            if p.device.type != "meta" and p.numel() and not bool(torch.isfinite(p.detach()).all()):
                where = name if len(models) == 1 else f"models[{i}].{name}"
                raise ValueError(
                    f"initialize(models=...): parameter {where} already holds inf/NaN values; training would "
                    f"only spread them. Check the initialization or the checkpoint it was loaded from."
                )


def _culprits(names) -> str:
    """Where to look: the first parameters whose gradients overflowed, and the tool that measures."""
    names = list(names)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    first = f"Non-finite gradients in this step: {shown} (ampkit.nonfinite_gradients()). " if names else ""
    return first + "ampkit.precision_report(model, loss_fn, batches) measures every layer against each level's range."
