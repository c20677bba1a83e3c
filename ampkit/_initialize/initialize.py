"""``ampkit.initialize``: a short body of named steps over the pipeline's modules."""
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .._config.levels import UpdateKind
from .._parallel.distributed import DistributedDataParallel
from .._run import registry
from .._run.run import Run
from .apply import apply, attach_optimizer
from .check import check, check_optimizers
from .plan import make_plan
from .report import report
from .request import parse


def initialize(
    models: Union[nn.Module, Sequence[nn.Module]],
    optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
    enabled: bool = True,
    opt_level: Optional[str] = None,
    cast_model_type: Union[torch.dtype, bool, None] = None,
    patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32: Union[bool, str, None] = None,
    master_weights: Union[bool, str, None] = None,
    loss_scale: Union[float, str, None] = None,
    cast_model_outputs: Optional[torch.dtype] = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: float = 2.0**24,
    half_dtype: Optional[torch.dtype] = None,
    low_precision_layernorm: Optional[bool] = None,
    loss_scale_hysteresis: int = 1,
    ddp: bool = False,
    ddp_kwargs: Optional[Dict[str, Any]] = None,
    fsdp: bool = False,
    fsdp_kwargs: Optional[Dict[str, Any]] = None,
    update_rounding: Union[str, bool, None] = None,
    optimizer_state_dtype: Union[torch.dtype, str, None] = None,
    fp8: Union[bool, str, None] = None,
    fp8_exclude: Union[Sequence[str], Callable[[str, nn.Module], bool], None] = None,
) -> Any:
    """Prepare models and optimizers for mixed precision at `opt_level`.

    Every value is checked before anything is modified: a bad one raises an error that names
    the argument and the values it accepts, and leaves models and optimizers untouched. The
    options marked (level) are properties of the opt level: left at `None`, they take the
    value in the level's row of the table (`python -m ampkit levels`, or
    [Choosing a level](../choosing-a-level.md)); a value overrides it.

    Args:
        models: an `nn.Module` or a list of them, on one device type, not yet wrapped in
            DistributedDataParallel (pass `ddp=True` to wrap after preparing).
        optimizers: a `torch.optim.Optimizer` (or a wrapper exposing its `param_groups` and
            `state`, such as [LARC][ampkit.parallel.LARC]) or a list of them, holding only
            parameters of `models`; `None` for inference-only models.
        enabled: `False` turns ampkit off: models and optimizers are returned unchanged and
            [ampkit.scale_loss][] yields the loss as it is.
        opt_level: `"O0"` fp32; `"O1"` autocast fp16; `"O2"` fp16 model + fp32 masters;
            `"O3"` pure fp16; `"O4"` autocast bf16; `"O5"` bf16 model + fp32 masters; `"O6"`
            O5 with fp8 linear layers; `"O7"` pure bf16 with stochastically rounded updates;
            `"O8"` O7 with 8-bit optimizer state; or `"auto"`, the fastest safe level for the
            model's device (see [ampkit.capabilities][]). Required when `enabled` is True.
        cast_model_type: (level) the dtype floating parameters and buffers are cast to:
            `torch.float16`, `torch.bfloat16`, `torch.float32` or `torch.float64`; `False`
            for no cast.
        patch_torch_functions: (level) `True` runs the model's forward under `torch.autocast`
            in `half_dtype` (Apex O1's op-level casting); `False` does not.
        keep_batchnorm_fp32: (level) `True` keeps BatchNorm parameters and statistics in fp32
            when the model is cast to half; `False` casts them too. The strings `"True"` and
            `"False"`, as Apex scripts pass them, are accepted.
        master_weights: (level) `True` keeps fp32 master copies of the half parameters: the
            optimizer steps on them and the result is copied back into the model; `"remainder"`
            holds the same masters as the bf16 weight plus a 16-bit remainder (12 bytes per
            parameter with AdamW, O5's numbers); `False` keeps none.
        loss_scale: (level) `"dynamic"`, or a positive number for a static scale (a numeric
            string such as `"128.0"` too); `1.0` does no scaling arithmetic.
        cast_model_outputs: the floating dtype the model's floating outputs are cast to;
            `None` casts them to float32 whenever the model or its ops run in half.
        num_losses: the number of losses with their own loss scaler (an integer >= 1;
            `scale_loss(..., loss_id=i)`).
        verbosity: `0` silent; `1` one line on the chosen level (rank 0 only); `2` the full
            property table. Messages go to the `"ampkit"` logger.
        min_loss_scale: lower bound for the dynamic loss scale, a positive number; `None` for
            none.
        max_loss_scale: upper bound for the dynamic loss scale, a positive number (2**24).
        half_dtype: (level) the level's half dtype, `torch.float16` or `torch.bfloat16`.
        low_precision_layernorm: (level) `True` runs LayerNorm in the half dtype too at the
            autocast levels ([LPLayerNorm][ampkit.normalization.LPLayerNorm]); `False` keeps it
            in fp32.
        loss_scale_hysteresis: consecutive overflows needed before the dynamic scale drops (an
            integer >= 1).
        ddp: `True` wraps each prepared model in
            [DistributedDataParallel][ampkit.parallel.DistributedDataParallel] (the default
            process group must be initialized); `False` does not.
        ddp_kwargs: a dict of keyword arguments for that wrapper, or `None`.
        fsdp: `True` shards each model with FSDP2 (`torch.distributed.fsdp.fully_shard`), the
            level mapped onto FSDP2's `MixedPrecisionPolicy`; `False` does not.
        fsdp_kwargs: with `fsdp=True`, a dict with any of `"blocks"` (module classes sharded
            one group each), `"mesh"`, `"reshard_after_forward"` and `"offload_policy"`
            (`CPUOffloadPolicy(...)`); `None` for FSDP2's defaults.
        update_rounding: (level) `"stochastic"` or `"nearest"`: half weights without masters
            take an update computed in fp32 each step and rounded back that way (O7:
            stochastic); `False` lets the optimizer update the half weights itself.
        optimizer_state_dtype: (level) with `update_rounding`, where the optimizer's
            elementwise state lives between steps: `torch.float32` (the optimizer's own),
            `torch.bfloat16`, or `"8bit"`, 8-bit codes with a scale per block of 256 (O8).
        fp8: (level) `True` converts eligible `nn.Linear` layers to torchao's `Float8Linear`
            (fp8 matmuls, emulated where the device has none; O6, needs torchao:
            `pip install -e ".[fp8]"`); `"emulate"` always emulates; `False` keeps them.
        fp8_exclude: module names (e.g. `["blocks.0"]`), or a callable
            `(name, module) -> bool`, kept out of fp8; `None` excludes none but the output head.

    Returns:
        The structure it was given: a model or a list of models (wrapped in
        DistributedDataParallel with `ddp=True`), and, when `optimizers` was passed, the pair
        `(models, optimizers)`. The objects keep their identity and class.

    Raises:
        TypeError: an argument of the wrong kind (a model that is not an `nn.Module`, an
            unknown keyword, `enabled="O2"`), naming the argument and the accepted values.
        ValueError: a value outside what the argument accepts, or one that conflicts with the
            level (an unknown `opt_level`, `loss_scale=0`, 8-bit state with fp32 masters).
        RuntimeError: a model already wrapped or already initialized, or `ddp=True`/`fsdp=True`
            without an initialized default process group.
        ImportError: fp8 without torchao installed.
    """
    request = parse(locals())  # 1. parse: the arguments (locals() holds exactly them here) as a request
    if not request.enabled:
        run = Run(False, verbosity=request.options["verbosity"], optimizer_names=[type(o).__name__ for o in request.optimizers])
        registry.register(run, ())
        return request.returned(request.given_models)
    plan = make_plan(request)  # 2. plan (pure): level, auto, fsdp plan, fp8, masters
    check(plan)  # 3. check (pure): models, optimizers, weights
    run = apply(plan)  # 4. apply: the only mutation
    registry.register(run, request.models)  # 5. register: the run becomes reachable
    report(plan, run)  # 6. report
    return request.returned(wrap(plan))  # 7. wrap


def wrap(plan):
    """The models as returned: wrapped in DistributedDataParallel with ``ddp=True``."""
    request = plan.request
    if not request.options["ddp"]:
        return request.given_models
    kwargs = dict(request.options["ddp_kwargs"] or {})
    kwargs.setdefault("allreduce_always_fp32", plan.props.reduces_in_fp32)
    models = [DistributedDataParallel(m, **kwargs) for m in request.models]
    return models[0] if request.single_model else models


def add_optimizers(models: list, optimizers: list, caller: str) -> None:
    """Optimizers made after ``initialize`` for ``models`` (a framework's next ``fit``), checked as
    ``initialize`` checks them; they step on the masters (or remainders) the models have, with
    the models' run (its loss scalers, its rounding)."""
    runs = {id(r): r for r in (registry.of_model(caller, m) for m in models)}
    if len(runs) != 1:
        raise ValueError(f"{caller}: the models were initialized by {len(runs)} different ampkit.initialize calls; "
                         f"expected one.")
    run = next(iter(runs.values()))
    props, states = run.properties, [m._ampkit for m in models]
    masters = props.update is UpdateKind.MASTERS and not any(s.sharded for s in states)
    check_optimizers(optimizers, models, masters)
    for opt in optimizers:
        attach_optimizer(opt, run, masters, states, {})
    run.optimizer_names += tuple(type(o).__name__ for o in optimizers)
    run.trains = True
