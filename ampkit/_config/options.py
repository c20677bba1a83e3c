"""``initialize``'s options as data: the one list of names, defaults and meanings.

The signature of ``ampkit.initialize`` and its docstring are built from `OPTIONS`;
options marked ``level=True`` are properties of the opt level table (``None``: the level's
default) and go through ``levels.resolve``; the others configure the run.
"""
import dataclasses
import inspect
from typing import Any, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    doc: str
    level: bool = False  # a property of the level table, resolved by levels.resolve
    annotation: Any = inspect.Parameter.empty


OPTIONS: Tuple[Option, ...] = (
    Option("cast_model_type", None, "dtype the model's floating parameters and buffers are cast to "
           "(``torch.float16``/``bfloat16``/``float32``/``float64``), or ``False`` for no cast.", level=True),
    Option("patch_torch_functions", None, "``True`` runs the model's forward under ``torch.autocast`` in "
           "``half_dtype`` (Apex O1's op-level casting).", level=True),
    Option("keep_batchnorm_fp32", None, "keep BatchNorm parameters and statistics in fp32 when the model is "
           "cast to half (also the strings ``\"True\"``/``\"False\"``, as Apex scripts pass).", level=True),
    Option("master_weights", None, "keep fp32 master copies of half parameters; the optimizer steps on them "
           "and copies the result back into the model.", level=True),
    Option("loss_scale", None, "``\"dynamic\"``, or a positive number (static scale; numeric strings too).", level=True),
    Option("cast_model_outputs", None, "dtype the model's floating outputs are cast to; by default float32 "
           "whenever the model or its ops run in half."),
    Option("num_losses", 1, "number of losses with their own loss scaler (``scale_loss(loss_id=...)``).", annotation=int),
    Option("verbosity", 1, "0 silent; 1 one line on the chosen level (rank 0 only); 2 the full property "
           "table. Messages go to the ``\"ampkit\"`` logger.", annotation=int),
    Option("min_loss_scale", None, "lower bound for the dynamic loss scale (default: none)."),
    Option("max_loss_scale", 2.0**24, "upper bound for the dynamic loss scale (default 2**24)."),
    Option("half_dtype", None, "the half dtype of the level (``torch.float16`` or ``torch.bfloat16``).", level=True),
    Option("low_precision_layernorm", None, "at autocast levels, run LayerNorm in the half dtype too "
           "(``ampkit.normalization.LPLayerNorm``).", level=True),
    Option("loss_scale_hysteresis", 1, "consecutive overflows needed before the dynamic scale drops.", annotation=int),
    Option("ddp", False, "wrap each prepared model in ``ampkit.parallel.DistributedDataParallel`` (the default "
           "process group must be initialized).", annotation=bool),
    Option("ddp_kwargs", None, "keyword arguments for that wrapper.", annotation=Optional[dict]),
    Option("fsdp", False, "shard each model with FSDP2 (``torch.distributed.fsdp.fully_shard``), the level "
           "mapped onto FSDP2's ``MixedPrecisionPolicy`` (see \"Beyond one GPU's memory\").", annotation=bool),
    Option("fsdp_kwargs", None, "``{\"blocks\": [module classes sharded one group each], \"mesh\": ..., "
           "\"reshard_after_forward\": ..., \"offload_policy\": CPUOffloadPolicy(...)}``.", annotation=Optional[dict]),
    Option("update_rounding", None, "``\"stochastic\"`` or ``\"nearest\"``: half weights without masters take "
           "an fp32 update computed per step and rounded back (O7: stochastic).", level=True),
    Option("optimizer_state_dtype", None, "``torch.bfloat16`` keeps the optimizer state in bf16, ``\"8bit\"`` in "
           "8-bit codes with per-block scales (O8) (with ``update_rounding``).", level=True),
    Option("fp8", None, "``True`` (or ``\"emulate\"``) converts eligible ``nn.Linear`` layers to torchao's "
           "Float8Linear (O6; needs ``pip install 'ampkit[fp8]'``).", level=True),
    Option("fp8_exclude", None, "module names, or a callable ``(name, module) -> bool``, kept out of fp8."),
)

LEVEL_OPTIONS = tuple(o.name for o in OPTIONS if o.level)

_P = inspect.Parameter
SIGNATURE = inspect.Signature(
    [_P("models", _P.POSITIONAL_OR_KEYWORD), _P("optimizers", _P.POSITIONAL_OR_KEYWORD, default=None),
     _P("enabled", _P.POSITIONAL_OR_KEYWORD, default=True, annotation=bool),
     _P("opt_level", _P.POSITIONAL_OR_KEYWORD, default=None, annotation=Optional[str])]
    + [_P(o.name, _P.POSITIONAL_OR_KEYWORD, default=o.default, annotation=o.annotation) for o in OPTIONS]
)


def args_doc(indent: str = "        ") -> str:
    """The ``Args:`` lines of the options, for ``initialize``'s docstring."""
    return "\n".join(f"{indent}{o.name}: {o.doc}" for o in OPTIONS)
