"""The user-facing calls: ``initialize``, ``scale_loss``, ``state_dict`` and friends."""
import contextlib
import itertools
import logging
import warnings
from typing import List, Optional

import torch
from torch import nn

from . import float8, opt_levels, transient_update
from .casting import cast_module_
from .errors import NoEffectWarning
from .model_state import ModelState, attach as attach_model
from .optimizer_state import OptimizerState
from .scaler import LossScaler
from .stochastic_rounding import StochasticRounder

logger = logging.getLogger("ampkit")

_current = None  # the Session of the latest initialize()
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
            if logger.level == logging.NOTSET:
                logger.setLevel(logging.INFO)
            if not logger.hasHandlers():
                logger.addHandler(logging.StreamHandler())
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
            self.scaler.update(overflow)
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
        params = [p for g in opt.param_groups for p in g["params"]]
        foreign = [i for i, p in enumerate(params) if id(p) not in owned]
        if foreign:
            raise ValueError(
                f"initialize(optimizers=...): {type(opt).__name__} holds {len(foreign)} parameter(s) that belong "
                f"to none of the models passed to initialize (first at index {foreign[0]}); pass every model "
                f"whose parameters the optimizer trains."
            )
        session.check_devices(params, use_masters)


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
    update_rounding=None,
    optimizer_state_dtype=None,
    fp8=None,
    fp8_exclude=None,
):
    """Prepare models and optimizers for mixed precision at ``opt_level`` (see ``ampkit levels``).

    Returns the same structure it was given: a model or a list of models, and (when
    optimizers were passed) an optimizer or a list of them. Every argument is checked
    before anything is modified, so a bad value leaves models and optimizers untouched.
    """
    global _current
    if not isinstance(enabled, bool):
        raise TypeError(f"initialize(enabled={enabled!r}): expected True or False.")
    model_list, single_model = _as_list(
        [] if models is None else models, "initialize(models=...)", (nn.Module,), "an nn.Module or a list of them"
    )
    opt_list, _ = _as_list(
        [] if optimizers is None else optimizers, "initialize(optimizers=...)", (torch.optim.Optimizer,),
        "a torch.optim.Optimizer or a list of them",
    )
    if not model_list:
        raise ValueError("initialize(models=...): expected at least one model.")
    if not enabled:
        _current = Session(enabled=False, verbosity=verbosity)
        return _returned(models, optimizers)

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
    if props.fp8:
        float8.require()
        fp8_exclude = float8.check_exclude(model_list, fp8_exclude)
    elif fp8_exclude is not None:
        warnings.warn(f"initialize(fp8_exclude=...) has no effect at {props.opt_level}: fp8 is off.", NoEffectWarning, stacklevel=2)

    cast_to_half = props.cast_model_type in opt_levels.HALF_DTYPES
    use_masters = bool(props.master_weights) and cast_to_half
    device_type = _device_type(model_list[0])
    session = Session(True, props, verbosity=verbosity, device_type=device_type)
    _check_optimizers(opt_list, model_list, session, use_masters)

    # Everything is valid: from here on, modify. Masters start from the fp32 values, not
    # from the rounded half copies: keep the pre-cast tensors (no copy; the cast rebinds .data).
    originals = {p: p.data for m in model_list for p in m.parameters()} if use_masters else {}
    for m in model_list:
        if props.fp8:
            float8.convert_(m, props.fp8, fp8_exclude, session.log)
        _prepare_model(m, props, cast_model_outputs)
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
    _report(session, defaults, applied, notes, opt_list, use_masters)
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
    if session.verbosity == 0:
        return
    props = session.properties
    lines = [f"Selected optimization level {defaults.opt_level}:  {opt_levels.BRIEF[defaults.opt_level]}",
             "Defaults for this optimization level are:"]
    lines += [f"{k:24}: {opt_levels._show(v)}" for k, v in defaults.rows()]
    lines.append("Overrides applied: " + (", ".join(f"{k}={opt_levels._show(v)}" for k, v in applied.items()) or "none"))
    lines.append("After processing overrides, optimization options are:")
    lines += [f"{k:24}: {opt_levels._show(v)}" for k, v in props.rows()]
    lines += ["Note: " + n for n in notes]
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


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False, delay_overflow_check: bool = False):
    """Yield ``loss.float() * scale``; on exit unscale the optimizers' gradients and check them.

    An overflow (inf/NaN in any gradient) makes the next ``step()`` of each given
    optimizer a no-op and, for a dynamic scaler, halves the scale. With
    ``delay_unscale=True`` gradients stay scaled (accumulation: the last backward of the
    window unscales them all). With ``delay_overflow_check=True`` the host sync that
    decides the skip is postponed to ``optimizer.step()``.
    """
    opts, _ = _as_list(optimizers, "scale_loss(optimizers=...)", (torch.optim.Optimizer,), "an optimizer or a list of optimizers")
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
    states = [o._ampkit for o in opts]
    for st in states:
        if st.scaled_by is not None and st.scaled_by is not scaler:
            raise RuntimeError(
                f"scale_loss(loss_id={loss_id}): the optimizer still holds gradients scaled by another loss's "
                f"scaler (delay_unscale=True); finish that accumulation window first."
            )
        st.before_backward()
    scale = scaler.loss_scale()
    yield loss.float() * scale if scale != 1.0 else loss.float()
    if delay_unscale:
        window = list({id(w): w for st in states for w in st.window + [st]}.values())
        for st in window:
            st.window = window
        for st in states:
            st.scaled_by = scaler
        return
    check = OverflowCheck(session, scaler, states)
    for st in states:
        st.unscale(1.0 / scale, check.found_inf)
        st.pending.append(check)
        st.window = [st]
    if not delay_overflow_check:
        check.resolve()


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
    """Yield the parameters ``optimizer`` steps on: fp32 masters where they exist."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None) -> dict:
    """Every loss scaler's state, in Apex's format: ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``,
    plus ``"stochastic_rounding"`` (the rounding generators) at update_rounding="stochastic"."""
    session = current_session("ampkit.state_dict()")
    out = {} if destination is None else destination
    for i, s in enumerate(session.scalers):
        out[f"loss_scaler{i}"] = s.state_dict()
    if session.rounding is not None:
        out[ROUNDING_KEY] = session.rounding.state_dict()
    return out


def load_state_dict(state: dict) -> None:
    """Restore loss scalers from :func:`state_dict` output (or Apex's ``amp.state_dict()``)."""
    session = current_session("ampkit.load_state_dict()")
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
