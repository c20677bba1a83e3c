"""The user-facing calls: ``initialize``, ``scale_loss``, ``state_dict`` and friends."""
import contextlib
import gc
import inspect
import itertools
import logging
import warnings
import weakref
from typing import List, Optional

import torch
from torch import nn

from . import float8, health, opt_levels, transient_update
from .casting import cast_module_, check_sparse_embeddings
from .errors import NoEffectWarning
from .logs import is_main_process, logger
from .model_state import ModelState, attach as attach_model
from .optimizer_state import OptimizerState
from .optimizer_wrappers import OptimizerLike
from .scaler import LossScaler
from .stochastic_rounding import StochasticRounder

_current = None  # the Session of the latest initialize()
_runs = weakref.WeakKeyDictionary()  # initialized model -> its Session (alive as long as the model)
ROUNDING_KEY = "stochastic_rounding"  # ampkit.state_dict() entry of the rounding generators
_reported = set()  # one-time notes already logged in this process


def _wrapper_types():
    types = [nn.parallel.DistributedDataParallel, nn.DataParallel]
    try:
        from .parallel import DistributedDataParallel as AmpDDP

        types.append(AmpDDP)
    except ImportError:
        pass
    return tuple(types)


class Session:
    """The outcome of one ``initialize`` call: properties, loss scalers, logging."""

    def __init__(self, enabled: bool, properties=None, scalers=(), verbosity: int = 1, device_type: str = "cpu"):
        self.enabled = enabled
        self.properties = properties
        self.scalers: List[LossScaler] = list(scalers)
        self.verbosity = verbosity
        self.device_type = device_type
        self.floor_warned = set()
        self.rounding: Optional[StochasticRounder] = None  # at update_rounding="stochastic"

    def log(self, msg: str, *args, level: int = logging.INFO) -> None:
        if self.verbosity > 0:
            logger.log(level, msg, *args)

    def check_devices(self, params, use_masters: bool) -> None:
        if use_masters:
            devices = {p.device for p in params}
            if len(devices) > 1:
                raise ValueError(
                    f"master_weights=True: the optimizer's parameters must be on one device, found "
                    f"{sorted(str(d) for d in devices)}; use one optimizer per device."
                )

    def finish_backward(self, state: OptimizerState) -> None:
        """Before ``step``: unscale delayed gradients and resolve pending overflow checks."""
        if state.scaled_by is not None:
            scaler = state.scaled_by
            window = [st for st in state.window if st.scaled_by is scaler]
            check = OverflowCheck(self, scaler, window)
            for st in window:
                st.unscale(1.0 / scaler.loss_scale(), check.found_inf)
                st.pending.append(check)
                st.window = [st]
        if state.masters and any(p.grad is not None for p in state.masters):
            check = OverflowCheck(self, None, [state])
            state.adopt_raw_grads(check.found_inf)
            state.pending.append(check)
        for check in state.pending:
            check.resolve()
        state.pending.clear()


class OverflowCheck:
    """One overflow decision: a found-inf flag per device, reduced to one host sync."""

    def __init__(self, session: Session, scaler: Optional[LossScaler], states):
        self.session = session
        self.scaler = scaler
        self.states = states
        self.found_inf = {}
        self.done = False
        self.consumed = False  # an optimizer stepped after this check
        self.before = self.after = None  # the scaler's state around its update

    def rollback(self) -> None:
        """The batch was dropped (``zero_grad`` with no ``step``): undo the scaler update,
        unless a later check has moved the scaler since."""
        if not self.consumed and self.after is not None and self.scaler.snapshot() == self.after:
            self.scaler.restore(self.before)
        self.consumed = True

    def resolve(self) -> bool:
        if self.done:
            return False
        self.done = True
        flags = list(self.found_inf.values())
        if not flags:
            flags = [torch.zeros(1, device=self.session.device_type)]
        found = flags[0] if len(flags) == 1 else sum(f.to(flags[0].device) for f in flags)
        found = _all_ranks_max(found)
        overflow = bool(found.item())
        pinned = self.scaler is not None and self.scaler.at_floor
        if self.scaler is not None:
            self.before = self.scaler.snapshot()
            self.scaler.update(overflow)
            self.after = self.scaler.snapshot()
            health.after_update(self.session, self.loss_id, self.scaler)
        for st in self.states:
            st.unstepped.append(self)
        if overflow:
            for st in self.states:
                st.skip = self.loss_id
            self._report(pinned)
        return overflow

    @property
    def loss_id(self) -> int:
        return self.session.scalers.index(self.scaler) if self.scaler is not None else -1

    def _report(self, pinned: bool) -> None:
        s = self.session
        if self.scaler is None:
            s.log("Gradient overflow in gradients computed outside scale_loss. Skipping step.")
        elif self.scaler.dynamic:
            s.log("Gradient overflow. Skipping step, loss scaler %d reducing loss scale to %s",
                  self.loss_id, self.scaler.loss_scale())
            if pinned and self.loss_id not in s.floor_warned:
                s.floor_warned.add(self.loss_id)
                s.log("Loss scaler %d is pinned at min_loss_scale=%s and gradients still overflow: "
                      "training is not progressing. Look for inf/NaN in the forward pass.",
                      self.loss_id, self.scaler.min_loss_scale, level=logging.WARNING)
        else:
            s.log("Gradient overflow. Skipping step, loss scaler %d keeps its static loss scale %s "
                  "(non-finite gradients are never applied)", self.loss_id, self.scaler.loss_scale())


def _all_ranks_max(flag: torch.Tensor) -> torch.Tensor:
    """MAX-reduce ``flag`` over the default process group, so every rank skips together."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def current_session(caller: str) -> Session:
    if _current is None:
        raise RuntimeError(
            f"{caller} was called before ampkit.initialize(); call "
            f"model, optimizer = ampkit.initialize(model, optimizer, opt_level=...) first."
        )
    return _current


def _as_list(obj, label: str, allowed: tuple, expected: str):
    """``obj`` (one object or a list/tuple of them) as a list, and whether it was one object."""
    if isinstance(obj, allowed):
        return [obj], True
    if isinstance(obj, (list, tuple)) and all(isinstance(o, allowed) for o in obj):
        return list(obj), False
    raise TypeError(f"{label}: expected {expected}, got {type(obj).__name__}.")


def _device_type(model: nn.Module) -> str:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return "cpu" if first is None else first.device.type


def _check_models(models) -> None:
    seen = set()
    for m in models:
        if isinstance(m, _wrapper_types()):
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


def _check_optimizers(optimizers, models, session: Session, use_masters: bool) -> None:
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
        session.check_devices(params, use_masters)


def _needs_closure(opt) -> bool:
    """Whether ``opt.step`` has a ``closure`` argument without a default (``LBFGS``)."""
    try:
        closure = inspect.signature(type(opt).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"initialize({name}={value!r}): expected an integer >= {low}.")


def initialize(
    models,
    optimizers=None,
    enabled: bool = True,
    opt_level: Optional[str] = None,
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
    half_dtype=None,
    low_precision_layernorm=None,
    loss_scale_hysteresis: int = 1,
    ddp: bool = False,
    ddp_kwargs: Optional[dict] = None,
    fsdp: bool = False,
    fsdp_kwargs: Optional[dict] = None,
    update_rounding=None,
    optimizer_state_dtype=None,
    fp8=None,
    fp8_exclude=None,
):
    """Prepare models and optimizers for mixed precision at ``opt_level`` (see ``ampkit levels``).

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
        opt_level: ``"O0"``..``"O7"``: fp32; autocast fp16 (O1); fp16 model + fp32 masters
            (O2); pure fp16 (O3); autocast bf16 (O4); bf16 model + fp32 masters (O5); O5 with
            fp8 linear layers (O6); pure bf16 with stochastically rounded updates (O7); or
            ``"auto"``: the fastest safe level for the model's device (see ``ampkit.capabilities``).
        cast_model_type: dtype the model's floating parameters and buffers are cast to
            (``torch.float16``/``bfloat16``/``float32``/``float64``), or ``False`` for no cast.
        patch_torch_functions: ``True`` runs the model's forward under ``torch.autocast``
            in ``half_dtype`` (Apex O1's op-level casting).
        keep_batchnorm_fp32: keep BatchNorm parameters and statistics in fp32 when the model
            is cast to half (also the strings ``"True"``/``"False"``, as Apex scripts pass).
        master_weights: keep fp32 master copies of half parameters; the optimizer steps on
            them and copies the result back into the model.
        loss_scale: ``"dynamic"``, or a positive number (static scale; numeric strings too).
        cast_model_outputs: dtype the model's floating outputs are cast to; by default
            float32 whenever the model or its ops run in half.
        num_losses: number of losses with their own loss scaler (``scale_loss(loss_id=...)``).
        verbosity: 0 silent; 1 one line on the chosen level (rank 0 only); 2 the full
            property table. Messages go to the ``"ampkit"`` logger.
        min_loss_scale: lower bound for the dynamic loss scale (default: none).
        max_loss_scale: upper bound for the dynamic loss scale (default 2**24).
        half_dtype: the half dtype of the level (``torch.float16`` or ``torch.bfloat16``).
        low_precision_layernorm: at autocast levels, run LayerNorm in the half dtype too
            (``ampkit.normalization.LPLayerNorm``).
        loss_scale_hysteresis: consecutive overflows needed before the dynamic scale drops.
        ddp: wrap each prepared model in ``ampkit.parallel.DistributedDataParallel``
            (the default process group must be initialized).
        ddp_kwargs: keyword arguments for that wrapper.
        fsdp: shard each model with FSDP2 (``torch.distributed.fsdp.fully_shard``), the
            level mapped onto FSDP2's ``MixedPrecisionPolicy`` (see "Beyond one GPU's memory").
        fsdp_kwargs: ``{"blocks": [module classes sharded one group each], "mesh": ...,
            "reshard_after_forward": ...}``.
        update_rounding: ``"stochastic"`` or ``"nearest"``: half weights without masters take
            an fp32 update computed per step and rounded back (O7: stochastic).
        optimizer_state_dtype: ``torch.bfloat16`` keeps the optimizer state in bf16 (with
            ``update_rounding``).
        fp8: ``True`` (or ``"emulate"``) converts eligible ``nn.Linear`` layers to torchao's
            Float8Linear (O6; needs ``pip install 'ampkit[fp8]'``).
        fp8_exclude: module names, or a callable ``(name, module) -> bool``, kept out of fp8.
    """
    global _current
    if not isinstance(enabled, bool):
        raise TypeError(f"initialize(enabled={enabled!r}): expected True or False.")
    model_list, single_model = _as_list(
        [] if models is None else models, "initialize(models=...)", (nn.Module,), "an nn.Module or a list of them"
    )
    opt_list, _ = _as_list(
        [] if optimizers is None else optimizers, "initialize(optimizers=...)", (torch.optim.Optimizer, OptimizerLike),
        "a torch.optim.Optimizer (or a wrapper exposing its param_groups and state, such as LARC) or a list of them",
    )
    if not model_list:
        raise ValueError("initialize(models=...): expected at least one model.")
    if not enabled:
        _current = Session(enabled=False, verbosity=verbosity)
        return _returned(models, optimizers)

    auto_note = None
    if opt_level == "auto":
        from .hardware import auto_level, model_device

        opt_level, auto_note = auto_level(model_device(model_list[0]) or "cpu")
    defaults, props, applied, notes = opt_levels.resolve(
        opt_level,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        half_dtype=half_dtype,
        low_precision_layernorm=low_precision_layernorm,
        update_rounding=update_rounding,
        optimizer_state_dtype=optimizer_state_dtype,
        fp8=fp8,
    )
    if cast_model_outputs is not None and not (
        isinstance(cast_model_outputs, torch.dtype) and cast_model_outputs in opt_levels.FLOAT_DTYPES
    ):
        raise TypeError(f"initialize(cast_model_outputs={cast_model_outputs!r}): expected a floating dtype or None.")
    _check_int("num_losses", num_losses, 1)
    if verbosity not in (0, 1, 2):
        raise ValueError(f"initialize(verbosity={verbosity!r}): expected 0, 1 or 2.")
    max_scale = opt_levels.positive_finite("max_loss_scale", max_loss_scale)
    min_scale = None if min_loss_scale is None else opt_levels.positive_finite("min_loss_scale", min_loss_scale)
    if min_scale is not None and min_scale > max_scale:
        raise ValueError(f"initialize(min_loss_scale={min_loss_scale!r}): must not exceed max_loss_scale={max_loss_scale!r}.")
    _check_int("loss_scale_hysteresis", loss_scale_hysteresis, 1)
    if not isinstance(ddp, bool):
        raise TypeError(f"initialize(ddp={ddp!r}): expected True or False.")
    if ddp_kwargs is not None and not isinstance(ddp_kwargs, dict):
        raise TypeError(f"initialize(ddp_kwargs={ddp_kwargs!r}): expected a dict or None.")
    if ddp and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            "initialize(ddp=True): the default process group is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment)."
        )
    _check_models(model_list)
    from .parallel import fsdp as fsdp_

    sharding = fsdp_.plan(model_list, opt_list, props, fsdp, fsdp_kwargs, ddp, cast_model_outputs)
    if props.fp8:
        float8.require()
        fp8_exclude = float8.check_exclude(model_list, fp8_exclude)
    elif fp8_exclude is not None:
        warnings.warn(f"initialize(fp8_exclude=...) has no effect at {props.opt_level}: fp8 is off.", NoEffectWarning, stacklevel=2)

    cast_to_half = props.cast_model_type in opt_levels.HALF_DTYPES
    use_masters = bool(props.master_weights) and cast_to_half and sharding is None  # else FSDP's shards are the masters
    device_type = _device_type(model_list[0])
    session = Session(True, props, verbosity=verbosity, device_type=device_type)
    _check_optimizers(opt_list, model_list, session, use_masters)
    health.check_finite_weights(model_list)
    if cast_to_half:
        check_sparse_embeddings(model_list, props.cast_model_type)

    # Everything is valid: from here on, modify. Masters start from the fp32 values, not
    # from the rounded half copies: keep the pre-cast tensors (no copy; the cast rebinds .data).
    originals = {p: p.data for m in model_list for p in m.parameters()} if use_masters else {}
    for m in model_list:
        if props.fp8:
            float8.convert_(m, props.fp8, fp8_exclude, session.log)
        _prepare_model(m, props if sharding is None else sharding.model_props, cast_model_outputs)
        if sharding is not None:
            sharded = sharding.shard(m)
            for opt in opt_list:
                fsdp_.adopt_sharded(opt, sharded)
    model_states = [m._ampkit for m in model_list]
    session.scalers = [
        LossScaler(props.loss_scale, min_loss_scale=min_scale, max_loss_scale=max_scale, hysteresis=loss_scale_hysteresis)
        for _ in range(num_losses)
    ]
    if props.update_rounding == "stochastic":
        session.rounding = StochasticRounder()
    for opt in opt_list:
        OptimizerState(opt, session, use_masters, model_states, originals).attach()
        if props.update_rounding:
            transient_update.attach(opt._ampkit, props.update_rounding, session.rounding, props.optimizer_state_dtype)
    originals.clear()
    _current = session
    session.trains = bool(opt_list)
    for m in model_list:
        _runs[m] = session
    _report(session, defaults, applied, notes, opt_list, use_masters)
    if verbosity > 0 and is_main_process():
        for info in ([auto_note] if auto_note is not None else []) + (sharding.notes if sharding is not None else []):
            session.log("%s", info)
    if ddp:
        model_list = [_wrap_ddp(m, props, ddp_kwargs or {}) for m in model_list]
        models = model_list[0] if single_model else model_list
    return _returned(models, optimizers)


def _returned(models, optimizers):
    return models if optimizers is None else (models, optimizers)


def _prepare_model(model: nn.Module, props, cast_model_outputs) -> None:
    cast = props.cast_model_type
    keep_bn = bool(props.keep_batchnorm_fp32) if cast in opt_levels.HALF_DTYPES else False
    if cast is not None:
        cast_module_(model, cast, keep_bn)
    if keep_bn:
        from .normalization import enable_mixed_input_batchnorm

        enable_mixed_input_batchnorm(model)
    device_type = _device_type(model)
    if props.low_precision_layernorm and props.patch_torch_functions:
        from .normalization import apply_low_precision_layernorm

        apply_low_precision_layernorm(model, props.half_dtype)
    autocast = props.patch_torch_functions
    if autocast:
        from .recurrent import float32_recurrent_layers

        autocast = float32_recurrent_layers(model, device_type)
    output_dtype = cast_model_outputs or (torch.float32 if (cast is not None or autocast) else None)
    state = ModelState(
        model,
        input_dtype=cast,
        output_dtype=output_dtype,
        autocast_device=device_type if autocast else None,
        autocast_dtype=props.half_dtype if autocast else None,
    )
    attach_model(model, state)


def _wrap_ddp(model, props, ddp_kwargs):
    from .parallel import DistributedDataParallel

    kwargs = dict(ddp_kwargs)
    no_masters = props.cast_model_type in opt_levels.HALF_DTYPES and not props.master_weights
    kwargs.setdefault("allreduce_always_fp32", no_masters)
    return DistributedDataParallel(model, **kwargs)


def _report(session: Session, defaults, applied, notes, optimizers, use_masters: bool) -> None:
    for note in notes:
        warnings.warn(note, NoEffectWarning, stacklevel=3)
    if session.verbosity == 0:
        return
    props = session.properties
    if is_main_process():
        if session.verbosity == 1:
            session.log("ampkit %s: %s", defaults.opt_level, summary(props, use_masters))
        else:
            lines = [f"Selected optimization level {defaults.opt_level}:  {opt_levels.BRIEF[defaults.opt_level]}",
                     "Defaults for this optimization level are:"]
            lines += [f"{k:24}: {opt_levels._show(v)}" for k, v in defaults.rows()]
            lines.append("Overrides applied: " + (", ".join(f"{k}={opt_levels._show(v)}" for k, v in applied.items()) or "none"))
            lines.append("After processing overrides, optimization options are:")
            lines += [f"{k:24}: {opt_levels._show(v)}" for k, v in props.rows()]
            session.log("\n".join(lines))
    half = props.cast_model_type if props.cast_model_type in opt_levels.HALF_DTYPES else None
    if half is not None and not use_masters and not props.update_rounding:  # update_rounding: the step is fp32
        for opt in optimizers:
            eps = [g["eps"] for g in opt.param_groups if isinstance(g.get("eps"), float)]
            if eps and torch.tensor(min(eps), dtype=half).item() == 0.0:
                session.log("%s eps=%s rounds to 0 in %s and the optimizer steps on %s weights (no master "
                            "weights at %s): expect inf/NaN updates; use master_weights=True or a larger eps.",
                            type(opt).__name__, min(eps), half, half, props.opt_level, level=logging.WARNING)
    uses_fp16 = props.cast_model_type == torch.float16 or (props.patch_torch_functions and props.half_dtype == torch.float16)
    key = (session.device_type, "float16")
    if uses_fp16 and session.device_type != "cuda" and key not in _reported:
        _reported.add(key)
        session.log(
            "float16 on %s is honoured as requested, but it is usually slow there (no fast float16 "
            "kernels); bfloat16 (O4/O5, or half_dtype=torch.bfloat16) is the fast path on CPUs.",
            session.device_type,
        )


def summary(props, use_masters: bool) -> str:
    """One line on what a resolved level does: model dtype, autocast, masters, loss scale."""
    cast = props.cast_model_type
    parts = [f"model {opt_levels._show(cast)}" if cast is not None else "model dtype unchanged"]
    if cast in opt_levels.HALF_DTYPES and props.keep_batchnorm_fp32:
        parts[0] += " (BatchNorm float32)"
    if props.patch_torch_functions:
        parts.append(f"autocast to {opt_levels._show(props.half_dtype)}")
    parts.append("fp32 master weights" if use_masters else "no master weights")
    scale = props.loss_scale
    parts.append("dynamic loss scale" if scale == "dynamic" else f"static loss scale {scale}")
    return ", ".join(parts)


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False, delay_overflow_check: bool = False):
    """Yield ``loss.float() * scale``; on exit unscale the optimizers' gradients and check them.

    An overflow (inf/NaN in any gradient) makes the next ``step()`` of each given
    optimizer a no-op and, for a dynamic scaler, lowers the scale.

    Args:
        loss: a one-element tensor.
        optimizers: the optimizer (or list of optimizers) returned by ``initialize`` whose
            parameters this loss's backward reaches.
        loss_id: which loss scaler to use, in ``[0, num_losses)``.
        model: accepted for Apex compatibility; unused.
        delay_unscale: keep gradients scaled on exit (gradient accumulation across several
            ``scale_loss`` blocks; the last block of the window unscales them all).
        delay_overflow_check: postpone the host sync that decides the skip to
            ``optimizer.step()``.
    """
    opts, _ = _as_list(optimizers, "scale_loss(optimizers=...)", (torch.optim.Optimizer, OptimizerLike), "an optimizer or a list of optimizers")
    session = _session_of(opts)
    if not session.enabled:
        yield loss
        return
    if not torch.is_tensor(loss) or loss.numel() != 1:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"scale_loss(loss=...): expected a scalar (one-element) tensor, got {shape}; reduce it first (e.g. loss.mean()).")
    n = len(session.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ValueError(f"scale_loss(loss_id={loss_id!r}): expected an integer in [0, {n - 1}] (initialize got num_losses={n}).")
    scaler = session.scalers[loss_id]
    states = list({id(o): o._ampkit for o in opts}.values())  # an optimizer listed twice counts once
    for st in states:
        if st.in_scale_loss:
            raise RuntimeError(
                f"scale_loss: {type(st.optimizer).__name__} is already inside an enclosing "
                f"`with ampkit.scale_loss(...)` block; nested blocks on one optimizer would unscale its "
                f"gradients twice. Finish the outer block first, or use delay_unscale=True to accumulate."
            )
        if st.scaled_by is not None and st.scaled_by is not scaler:
            raise RuntimeError(
                f"scale_loss(loss_id={loss_id}): the optimizer still holds gradients scaled by another loss's "
                f"scaler (delay_unscale=True); finish that accumulation window first."
            )
        st.before_backward()
    scale = scaler.loss_scale()
    for st in states:
        st.in_scale_loss = True
    try:
        yield loss.float() * scale if scale != 1.0 else loss.float()
    except BaseException:
        # A batch dropped inside the block: whatever backward wrote still carries the
        # scale. Record it, so zero_grad() discards it and a later backward unscales it.
        _leave_scaled(states, scaler)
        raise
    finally:
        for st in states:
            st.in_scale_loss = False
    if delay_unscale:
        _leave_scaled(states, scaler)
        return
    check = OverflowCheck(session, scaler, states)
    for st in states:
        st.unscale(1.0 / scale, check.found_inf)
        st.pending.append(check)
        st.window = [st]
    if not delay_overflow_check:
        check.resolve()


def _leave_scaled(states, scaler) -> None:
    """The states' gradients stay scaled by ``scaler`` (an open accumulation window)."""
    window = list({id(w): w for st in states for w in st.window + [st]}.values())
    for st in window:
        st.window = window
    for st in states:
        st.scaled_by = scaler


def _session_of(opts) -> Session:
    states = [getattr(o, "_ampkit", None) for o in opts]
    sessions = {id(st.session): st.session for st in states if st is not None}
    if len(sessions) > 1:
        raise RuntimeError("scale_loss: the optimizers come from different ampkit.initialize calls; pass them to one initialize.")
    if sessions and all(st is not None for st in states):
        return next(iter(sessions.values()))
    if not sessions and _current is not None and not _current.enabled:
        return _current
    raise RuntimeError(
        "scale_loss was called with an optimizer that did not go through ampkit.initialize; call "
        "model, optimizer = ampkit.initialize(model, optimizer, opt_level=...) before `with ampkit.scale_loss(...)`."
    )


def master_params(optimizer):
    """Yield the parameters ``optimizer`` steps on: fp32 masters where they exist.

    Args:
        optimizer: an optimizer returned by ``initialize`` (for gradient clipping:
            ``clip_grad_norm_(ampkit.master_params(optimizer), max_norm)`` after ``scale_loss``).
    """
    for group in optimizer.param_groups:
        yield from group["params"]


def training_session(caller: str, optimizer=None, model=None) -> Session:
    """The run ``optimizer`` or ``model`` belongs to; without either, the one training run
    (``initialize`` with optimizers) alive in this process. An ``initialize`` without
    optimizers (a teacher, an EMA model) never becomes the default."""
    if optimizer is not None:
        state = getattr(optimizer, "_ampkit", None)
        if state is None:
            raise ValueError(f"{caller}: optimizer={type(optimizer).__name__} did not go through ampkit.initialize.")
        return state.session
    if model is not None:
        session = _runs.get(getattr(model, "module", model)) or _runs.get(model)
        if session is None:
            raise ValueError(f"{caller}: model={type(model).__name__} did not go through ampkit.initialize.")
        return session
    runs = _training_runs()
    if len(runs) > 1:
        gc.collect()  # runs that are only garbage still waiting for the cycle collector
        runs = _training_runs()
    if len(runs) > 1:
        raise RuntimeError(
            f"{caller}: {len(runs)} training runs (initialize calls with optimizers) are alive in this "
            f"process, so which loss scalers are meant is ambiguous; pass optimizer=... (or model=...) "
            f"of the run you mean."
        )
    if runs:
        return runs[0]
    return current_session(caller)


def _training_runs() -> list:
    return list({id(s): s for s in list(_runs.values()) if s.enabled and getattr(s, "trains", False)}.values())


def state_dict(destination=None, optimizer=None, model=None) -> dict:
    """Every loss scaler's state, in Apex's format: ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``.

    The scalers of the run ``optimizer`` (or ``model``) belongs to; see :func:`training_session`.
    At update_rounding="stochastic" (O7) also ``"stochastic_rounding"``: the rounding generators.

    Args:
        destination: a dict to fill (and return) instead of a new one.
        optimizer, model: the run whose scalers are meant (needed when several runs are alive).
    """
    session = training_session("ampkit.state_dict()", optimizer, model)
    out = {} if destination is None else destination
    for i, s in enumerate(session.scalers):
        out[f"loss_scaler{i}"] = s.state_dict()
    if session.rounding is not None:
        out[ROUNDING_KEY] = session.rounding.state_dict()
    return out


def load_state_dict(state: dict, optimizer=None, model=None) -> None:
    """Restore loss scalers from :func:`state_dict` output (or Apex's ``amp.state_dict()``).

    Args:
        state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}`` with one
            entry per loss of the run; checked whole before anything loads.
        optimizer, model: choose the run as in :func:`state_dict`.
    """
    session = training_session("ampkit.load_state_dict()", optimizer, model)
    if not isinstance(state, dict):
        raise TypeError(f"ampkit.load_state_dict(state): expected a dict, got {type(state).__name__}.")
    rounding = state.get(ROUNDING_KEY)
    state = {k: v for k, v in state.items() if k != ROUNDING_KEY}
    bad = [k for k in state if not (isinstance(k, str) and k.startswith("loss_scaler") and k[11:].isdigit())]
    if bad:
        raise ValueError(f"ampkit.load_state_dict: unexpected key(s) {bad}; expected 'loss_scaler0', 'loss_scaler1', ..., {ROUNDING_KEY!r}")
    n = len(session.scalers)
    if len(state) != n or any(f"loss_scaler{i}" not in state for i in range(n)):
        raise ValueError(
            f"ampkit.load_state_dict: the state dict holds {len(state)} loss scaler(s) ({sorted(state)}), "
            f"but initialize was called with num_losses={n}."
        )
    for key, value in state.items():
        LossScaler.check_state(key, value)
    if rounding is not None:
        StochasticRounder.check_state(ROUNDING_KEY, rounding)
        if session.rounding is None:
            warnings.warn(f"ampkit.load_state_dict: {ROUNDING_KEY!r} has no effect: nothing rounds updates "
                          f"stochastically in this run.", NoEffectWarning, stacklevel=2)
    for i, s in enumerate(session.scalers):
        s.load_state_dict(state[f"loss_scaler{i}"])
    if rounding is not None and session.rounding is not None:
        session.rounding.load_state_dict(rounding)
