"""``ampkit.initialize``: a short body of named steps over the pipeline's modules."""
from .._config.levels import HALF_DTYPES
from .._config.options import SIGNATURE, args_doc
from .._parallel.distributed import DistributedDataParallel
from .._run import registry
from .._run.run import Run
from .apply import apply, attach_optimizer
from .check import check, check_optimizers
from .plan import make_plan
from .report import report
from .request import parse


def initialize(*args, **kwargs):
    request = parse(args, kwargs)  # 1. parse: the arguments bound to the one option list
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
    kwargs.setdefault("allreduce_always_fp32", plan.props.cast_model_type in HALF_DTYPES and not plan.props.master_weights)
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
    masters = props.master_weights is True and props.cast_model_type in HALF_DTYPES and not any(s.sharded for s in states)
    check_optimizers(optimizers, models, masters)
    for opt in optimizers:
        attach_optimizer(opt, run, masters, states, {})
    run.optimizer_names += tuple(type(o).__name__ for o in optimizers)
    run.trains = True


initialize.__signature__ = SIGNATURE
initialize.__doc__ = f"""Prepare models and optimizers for mixed precision at ``opt_level`` (see ``ampkit levels``).

    Returns the same structure it was given: a model or a list of models, and (when
    optimizers were passed) an optimizer or a list of them. The objects keep their identity
    and class. Every argument is checked before anything is modified, so a bad value raises
    a ``TypeError``/``ValueError`` naming the argument and leaves models and optimizers
    untouched. Options left at ``None`` take the level's default from the property table.

    Args:
        models: an ``nn.Module`` or a list of them, on one device type, not yet wrapped in
            DistributedDataParallel (pass ``ddp=True`` to wrap after preparing).
        optimizers: a ``torch.optim.Optimizer`` or a list of them, holding only parameters
            of ``models``; ``None`` for inference-only models.
        enabled: ``False`` turns ampkit off: models and optimizers are returned unchanged and
            ``scale_loss`` yields the loss as it is.
        opt_level: ``"O0"``..``"O8"``: fp32; autocast fp16 (O1); fp16 model + fp32 masters
            (O2); pure fp16 (O3); autocast bf16 (O4); bf16 model + fp32 masters (O5); O5 with
            fp8 linear layers (O6); pure bf16 with stochastically rounded updates (O7); O7 with
            8-bit optimizer state (O8); or
            ``"auto"``: the fastest safe level for the model's device (see ``ampkit.capabilities``).
{args_doc()}
    """
