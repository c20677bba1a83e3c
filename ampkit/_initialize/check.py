"""Step 3, check (pure): the models, the optimizers and the weights, against the plan."""
import inspect

from torch import nn

from .._config.levels import HALF_DTYPES, UpdateKind
from .._model.casting import check_sparse_embeddings
from .._optim.optimizer_state import check_devices
from .._parallel.distributed import DistributedDataParallel as AmpDDP
from .._run import health
from .plan import Plan

WRAPPER_TYPES = (nn.parallel.DistributedDataParallel, nn.DataParallel, AmpDDP)


def check(plan: Plan) -> None:
    """Raise before anything is modified if a model or optimizer cannot take the plan."""
    models = plan.request.models
    check_models(models)
    check_optimizers(plan.request.optimizers, models, plan.use_masters)
    health.check_finite_weights(models)
    if plan.props.cast_model_type in HALF_DTYPES:
        check_sparse_embeddings(models, plan.props.cast_model_type)
    if plan.props.update in (UpdateKind.ROUNDED, UpdateKind.EIGHT_BIT):
        check_no_sparse_gradients(models, f"update_rounding={plan.props.update_rounding!r} ({plan.props.opt_level}) "
                                          f"cannot apply: it steps dense fp32 copies of the half weights")
    if plan.props.update is UpdateKind.REMAINDER:
        check_no_sparse_gradients(models, "master_weights='remainder' cannot apply: it steps each fp32 master rebuilt "
                                          "densely from the bf16 weight and its 16-bit remainder")


def check_no_sparse_gradients(models, why: str) -> None:
    """Refuse embeddings with sparse gradients where the update steps dense copies (O7, remainder masters):
    ``why`` says which, in the error."""
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                where = (name or type(module).__name__) if len(models) == 1 else f"models[{i}].{name}"
                raise ValueError(
                    f"initialize(models=...): {where}.weight has sparse gradients (sparse=True), which {why}. "
                    f"Use sparse=False, or O5 with master_weights=True (fp32 masters), which trains sparse embeddings."
                )


def check_models(models) -> None:
    seen = set()
    for m in models:
        if isinstance(m, WRAPPER_TYPES):
            raise RuntimeError(
                f"initialize(models=...): the model is already wrapped in {type(m).__module__}.{type(m).__name__}. "
                f"Call ampkit.initialize on the bare model first, then wrap it (or pass ddp=True)."
            )
        if getattr(m, "_ampkit", None) is not None:
            raise RuntimeError("initialize(models=...): this model was already passed through ampkit.initialize; call it once per model.")
        if id(m) in seen:
            raise ValueError("initialize(models=...): the same model appears twice in the list.")
        seen.add(id(m))
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.device.type == "meta":
                raise RuntimeError(
                    f"initialize(models=...): {name} is on the meta device; materialize the model first "
                    f"(e.g. model.to_empty(device='cpu') and load or initialize its weights)."
                )


def check_optimizers(optimizers, models, use_masters: bool) -> None:
    owned = {id(p) for m in models for p in m.parameters()}
    seen = set()
    for opt in optimizers:
        if getattr(opt, "_ampkit", None) is not None:
            raise RuntimeError("initialize(optimizers=...): this optimizer was already passed through ampkit.initialize; call it once per optimizer.")
        if id(opt) in seen:
            raise ValueError("initialize(optimizers=...): the same optimizer appears twice in the list.")
        seen.add(id(opt))
        if _needs_closure(opt):
            raise ValueError(
                f"initialize(optimizers=...): {type(opt).__name__}.step(closure) needs a closure (it "
                f"re-evaluates the loss itself, several times per step); ampkit scales one loss per backward "
                f"in `with ampkit.scale_loss(...)` and cannot run inside a closure. Use an optimizer whose "
                f"step() takes no closure, or train this one without ampkit."
            )
        params = [p for g in opt.param_groups for p in g["params"]]
        foreign = [i for i, p in enumerate(params) if id(p) not in owned]
        if foreign:
            raise ValueError(
                f"initialize(optimizers=...): {type(opt).__name__} holds {len(foreign)} parameter(s) that belong "
                f"to none of the models passed to initialize (first at index {foreign[0]}); pass every model "
                f"whose parameters the optimizer trains."
            )
        check_devices(params, use_masters)


def _needs_closure(opt) -> bool:
    """Whether ``opt.step`` has a ``closure`` argument without a default (``LBFGS``)."""
    try:
        closure = inspect.signature(type(opt).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty
