"""Step 4, apply: the only step that changes models and optimizers. It runs after every
check passed, and returns the `ampkit._run.run.Run` it set up."""
import torch
from torch import nn

from .._config.levels import HALF_DTYPES, UpdateKind
from .._kernels.rounding import StochasticRounder
from .._model import float8
from .._model.batchnorm import enable_mixed_input_batchnorm
from .._model.casting import cast_module_
from .._model.layer_norm import apply_low_precision_layernorm
from .._model.model_state import ModelState, attach
from .._model.recurrent import float32_recurrent_layers
from .._optim.optimizer_state import OptimizerState
from .._parallel import fsdp
from .._run.run import Run
from .._run.scaler import LossScaler
from .._update.base import OptimizerUpdate
from .._update.eight_bit import EightBitUpdate
from .._update.masters import MastersUpdate
from .._update.remainder import RemainderUpdate
from .._update.rounded import RoundedUpdate
from .plan import Plan, device_type


UPDATES = {  # how each kind of update reaches the weights: the class the optimizer state holds as .update
    UpdateKind.OPTIMIZER: OptimizerUpdate,
    UpdateKind.MASTERS: MastersUpdate,
    UpdateKind.REMAINDER: RemainderUpdate,
    UpdateKind.ROUNDED: RoundedUpdate,
    UpdateKind.EIGHT_BIT: EightBitUpdate,
}


def apply(plan: Plan) -> Run:
    """Cast and hook the models, shard them (FSDP2), attach masters and the step protocol."""
    opts, props = plan.request.options, plan.props
    run = Run(True, props, verbosity=opts["verbosity"], device_type=plan.device_type,
              rounder=StochasticRounder() if _rounds_stochastically(props) else None,
              optimizer_names=[type(o).__name__ for o in plan.request.optimizers])
    # Masters start from the fp32 values, not from the rounded half copies: keep the
    # pre-cast tensors (no copy; the cast rebinds .data).
    remainder = props.update is UpdateKind.REMAINDER  # levels.resolve allows it only for a bf16 model
    keep = plan.use_masters or remainder
    originals = {p: p.data for m in plan.request.models for p in m.parameters()} if keep else {}
    for m in plan.request.models:
        _prepare(m, plan, run, originals)
    model_states = [m._ampkit for m in plan.request.models]
    run.scalers = [
        LossScaler(props.loss_scale, min_loss_scale=plan.min_scale, max_loss_scale=plan.max_scale,
                   hysteresis=opts["loss_scale_hysteresis"])
        for _ in range(opts["num_losses"])
    ]
    for opt in plan.request.optimizers:
        attach_optimizer(opt, run, plan.use_masters, model_states, originals)
    originals.clear()
    return run


def attach_optimizer(opt, run: Run, use_masters: bool, model_states: list, originals: dict) -> None:
    """The step protocol on ``opt``, with the masters (or remainders) its parameters already
    have in ``model_states``, else new ones from ``originals``."""
    OptimizerState(opt, run, use_masters, model_states, originals).attach(UPDATES[run.properties.update])


def _rounds_stochastically(props) -> bool:
    """Whether the run needs a stochastic rounder: stochastic updates (O7), or 8-bit state (O8)."""
    return props.update_rounding == "stochastic" or props.update is UpdateKind.EIGHT_BIT


def _prepare(model: nn.Module, plan: Plan, run: Run, originals: dict) -> None:
    if plan.props.fp8:
        float8.convert_(model, plan.props.fp8, plan.fp8_exclude, run.log)
    sharding = plan.sharding
    _cast_and_hook(model, plan.props if sharding is None else sharding.model_props, plan.request.options["cast_model_outputs"])
    if sharding is not None:
        sharded = sharding.shard(model)
        for opt in plan.request.optimizers:
            fsdp.adopt_sharded(opt, sharded)
        for old in [p for p in sharded if p in originals]:  # remainders: cut from the first rank's fp32 values
            originals[sharded[old]] = originals.pop(old)


def _cast_and_hook(model: nn.Module, props, cast_model_outputs) -> None:
    """Cast ``model`` as ``props`` say and attach its `ModelState` (class swap, hooks)."""
    cast = props.cast_model_type
    keep_bn = bool(props.keep_batchnorm_fp32) if cast in HALF_DTYPES else False
    if cast is not None:
        cast_module_(model, cast, keep_bn)
    if keep_bn:
        enable_mixed_input_batchnorm(model)
    device = device_type(model)
    if props.low_precision_layernorm and props.patch_torch_functions:
        apply_low_precision_layernorm(model, props.half_dtype)
    autocast = props.patch_torch_functions and float32_recurrent_layers(model, device)
    output_dtype = cast_model_outputs or (torch.float32 if (cast is not None or autocast) else None)
    state = ModelState(
        model,
        input_dtype=cast,
        output_dtype=output_dtype,
        autocast_device=device if autocast else None,
        autocast_dtype=props.half_dtype if autocast else None,
    )
    attach(model, state)
