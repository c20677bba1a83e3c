"""``initialize``'s options as data: the one list of names, defaults and which are level properties.

Options marked ``level=True`` are properties of the opt level table (``None``: the level's
default) and go through ``levels.resolve``; the others configure the run. The signature of
``ampkit.initialize`` is written out in ``_initialize/initialize.py`` and describes each option in
its docstring; ``tests/initialize/test_signature.py`` holds that signature equal to this list.
"""
import dataclasses
from typing import Any, Tuple


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    level: bool = False  # a property of the level table, resolved by levels.resolve


OPTIONS: Tuple[Option, ...] = (
    Option("cast_model_type", None, level=True),
    Option("patch_torch_functions", None, level=True),
    Option("keep_batchnorm_fp32", None, level=True),
    Option("master_weights", None, level=True),
    Option("loss_scale", None, level=True),
    Option("cast_model_outputs", None),
    Option("num_losses", 1),
    Option("verbosity", 1),
    Option("min_loss_scale", None),
    Option("max_loss_scale", 2.0**24),
    Option("half_dtype", None, level=True),
    Option("low_precision_layernorm", None, level=True),
    Option("loss_scale_hysteresis", 1),
    Option("ddp", False),
    Option("ddp_kwargs", None),
    Option("fsdp", False),
    Option("fsdp_kwargs", None),
    Option("update_rounding", None, level=True),
    Option("optimizer_state_dtype", None, level=True),
    Option("fp8", None, level=True),
    Option("fp8_exclude", None),
)

LEVEL_OPTIONS = tuple(o.name for o in OPTIONS if o.level)
