"""Step 2, plan (pure): the level with its overrides, the loss-scaling and parallel options,
fp8 and master weights; every option is checked here, nothing is modified."""
import dataclasses
import itertools
import warnings
from typing import Any, Optional

import torch
from torch import nn

from .. import _hardware as hardware
from .._common.errors import NoEffectWarning
from .._config import levels
from .._config.options import LEVEL_OPTIONS
from .._model import float8
from .._parallel import fsdp
from .request import Request


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``apply`` will do, decided before anything changes."""

    request: Request
    defaults: levels.Properties  # the level's row
    props: levels.Properties  # the row after overrides
    applied: dict  # the overrides that were applied
    notes: tuple  # NoEffectWarning texts
    infos: tuple  # INFO lines (auto level, FSDP policy)
    sharding: Optional[fsdp.Plan]
    fp8_exclude: Any
    use_masters: bool
    device_type: str
    min_scale: Optional[float]
    max_scale: float


def device_type(model: nn.Module) -> str:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return "cpu" if first is None else first.device.type


def make_plan(request: Request) -> Plan:
    """Resolve the level (``"auto"`` too) and check every option against it."""
    opts, models = request.options, request.models
    level, infos = request.opt_level, []
    if level == "auto":
        level, note = hardware.auto_level(hardware.model_device(models[0]) or "cpu")
        infos.append(note)
    defaults, props, applied, notes = levels.resolve(level, **{k: opts[k] for k in LEVEL_OPTIONS})
    min_scale, max_scale = _check_run_options(opts)
    sharding = fsdp.plan(models, request.optimizers, props, opts["fsdp"], opts["fsdp_kwargs"], opts["ddp"],
                         opts["cast_model_outputs"])
    exclude = _fp8_exclude(models, props, opts["fp8_exclude"])
    use_masters = props.update is levels.UpdateKind.MASTERS and sharding is None  # FSDP2's fp32 shards are its masters
    if sharding is not None:
        infos += sharding.notes
    return Plan(request, defaults, props, applied, tuple(notes), tuple(infos), sharding, exclude, use_masters,
                device_type(models[0]), min_scale, max_scale)


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"initialize({name}={value!r}): expected an integer >= {low}.")


def _check_run_options(opts):
    """Check the options that configure the run rather than the level; the scale bounds."""
    outputs = opts["cast_model_outputs"]
    if outputs is not None and not (isinstance(outputs, torch.dtype) and outputs in levels.FLOAT_DTYPES):
        raise TypeError(f"initialize(cast_model_outputs={outputs!r}): expected a floating dtype or None.")
    _check_int("num_losses", opts["num_losses"], 1)
    if opts["verbosity"] not in (0, 1, 2):
        raise ValueError(f"initialize(verbosity={opts['verbosity']!r}): expected 0, 1 or 2.")
    max_scale = levels.positive_finite("max_loss_scale", opts["max_loss_scale"])
    low = opts["min_loss_scale"]
    min_scale = None if low is None else levels.positive_finite("min_loss_scale", low)
    if min_scale is not None and min_scale > max_scale:
        raise ValueError(f"initialize(min_loss_scale={low!r}): must not exceed max_loss_scale={opts['max_loss_scale']!r}.")
    _check_int("loss_scale_hysteresis", opts["loss_scale_hysteresis"], 1)
    if not isinstance(opts["ddp"], bool):
        raise TypeError(f"initialize(ddp={opts['ddp']!r}): expected True or False.")
    if opts["ddp_kwargs"] is not None and not isinstance(opts["ddp_kwargs"], dict):
        raise TypeError(f"initialize(ddp_kwargs={opts['ddp_kwargs']!r}): expected a dict or None.")
    if opts["ddp"] and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            "initialize(ddp=True): the default process group is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment)."
        )
    return min_scale, max_scale


def _fp8_exclude(models, props, exclude):
    if props.fp8:
        float8.require()
        return float8.check_exclude(models, exclude)
    if exclude is not None:
        warnings.warn(f"initialize(fp8_exclude=...) has no effect at {props.opt_level}: fp8 is off.", NoEffectWarning, stacklevel=4)
    return exclude
