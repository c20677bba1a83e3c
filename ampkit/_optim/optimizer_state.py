"""What ``initialize`` attaches to an optimizer: fp32 master weights and the step protocol.

The optimizer keeps its identity and class; ``step``, ``zero_grad`` and
``add_param_group`` are wrapped on the instance (as LR schedulers do), and everything
ampkit needs lives in ``optimizer._ampkit``, an `OptimizerState`.

The step protocol is a stage per optimizer (`Stage`), changed only by the
state's methods: ``begin_backward`` (entering ``scale_loss``), ``hold_scaled`` (gradients
left scaled: ``delay_unscale``), ``unscale`` (scaled gradients made clean and checked),
``step`` and ``clear_grads``. A loop that breaks the order gets an error naming the call.
"""
import enum
import functools
import inspect
import types
from typing import Dict, List, Optional

import torch

from .._config.levels import HALF_DTYPES
from .._common.dynamo import eager_under_compile
from .._kernels.unscale import copy_unscale_and_check_, unscale_and_check_
from .._parallel.ddp_windows import mark_windows, reduce_windows
from .._run.overflow import OverflowCheck
from .._update.masters import MastersUpdate
from .step_hooks import hooks_set_aside, run_post_hooks, run_pre_hooks, unhooked_step


def _by_device(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups.values()


REUSED_GRADS_BYTES = 32 * 2**20  # fp32 master gradients at least this large reuse buffers


def _make_master(param: torch.Tensor, original: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An fp32 leaf copy of ``param``; from its pre-cast fp32 value when one is given."""
    if original is not None and original.dtype == torch.float32 and original.shape == param.shape:
        master = original.detach()
    else:
        master = param.detach().clone().float()
    master.requires_grad_(param.requires_grad)
    return master


def _state_to_fp32(state: dict) -> dict:
    return {
        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
        for k, v in state.items()
    }


class Stage(enum.Enum):
    """Where one optimizer is in its step."""

    READY = "ready"  # no scaled gradients and no unscale since the last step() or zero_grad()
    IN_BLOCK = "inside scale_loss"  # inside a `with ampkit.scale_loss(...)` block
    SCALED = "scaled"  # gradients still carry a loss scale (delay_unscale=True)
    UNSCALED = "unscaled"  # gradients unscaled and checked: step() comes next


class OptimizerState:
    """ampkit's record on one optimizer.

    * ``masters`` maps each half model parameter the optimizer holds to its fp32 master
      (the tensor that sits in ``param_groups``); ``owner`` maps back.
    * ``stage`` (`Stage`); at ``SCALED`` (or inside a block that continues a
      window) ``scaled_by`` is the scaler whose scale the gradients still carry, and
      ``window`` the optimizers whose gradients that same scaled backward wrote.
    * ``stash`` holds clean gradients set aside while a new backward writes scaled ones
      (gradient accumulation without ``delay_unscale``); with ``delay_unscale`` the half
      gradients are summed, still scaled, into the fp32 master gradients
      (``masters_scaled``), so a window accumulates in fp32 either way.
    * ``pending`` lists overflow checks not yet resolved (``delay_overflow_check``);
      ``skip`` is the id of the loss whose overflow cancels the next ``step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, run, use_masters: bool, model_states, originals=None):
        self.optimizer = optimizer
        self.run = run
        self.stage = Stage.READY
        self.use_masters = use_masters
        self.model_states = model_states
        self.originals = {} if originals is None else originals  # param -> its fp32 tensor before the cast
        self.window: List["OptimizerState"] = [self]  # optimizers sharing a delay_unscale window
        self.masters: Dict[torch.Tensor, torch.Tensor] = {}
        self.owner: Dict[torch.Tensor, torch.Tensor] = {}
        self.scaled_by = None
        self.stash: Dict[torch.Tensor, torch.Tensor] = {}
        self.masters_scaled = False  # the master gradients carry scaled_by's scale
        self._grad_buffers: Dict[torch.Tensor, torch.Tensor] = {}  # master -> its fp32 grad, when reused
        self._spent: List[torch.Tensor] = []  # half grads already moved to the masters
        self.pending: List = []
        self.skip: Optional[int] = None
        self.unstepped: List = []  # resolved overflow checks no step() has consumed yet
        self.last_step_skipped = False  # ampkit.step_was_skipped(optimizer)
        self.nonfinite: List[str] = []  # ampkit.nonfinite_gradients(optimizer): the last decided check's
        self.keep_grads = False  # zero_grad(set_to_none=False) was used: master grads persist
        unhooked = unhooked_step(optimizer)
        self.runs_hooks = unhooked is not None  # torch's step hooks run around the whole step (step_hooks.py)
        self.own_step = unhooked or optimizer.step
        self.update = None  # how the step reaches the weights (`ampkit._update`), set by `attach`
        self._zero_grad = optimizer.zero_grad
        self._zero_grad_takes_set_to_none = _takes(optimizer.zero_grad, "set_to_none")
        self._add_param_group = optimizer.add_param_group

    # -- setup -------------------------------------------------------------------------
    def attach(self, update=MastersUpdate) -> None:
        """Create masters for the half parameters, wrap the optimizer's methods, and attach
        ``update`` (a class of ``ampkit._update`` for the level's ``Properties.update``;
        FP16_Optimizer's masters by default)."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"], new = self._with_masters(group["params"])
            self._register_all(new)
        opt._ampkit = self
        if self.masters:
            # torch.amp.GradScaler.step then hands its scale to step() (see _step), instead of
            # failing on "No inf checks were recorded" against the masters' empty gradients.
            opt._step_supports_amp_scaling = True
        # torch's step hooks can neither skip nor replace the step, and torch has no hooks for
        # zero_grad or add_param_group: these three are wrapped on the instance.
        self.update = update(self)
        opt.step = _wrapped_step(opt, opt.step, _eager_step if self.update.eager_under_compile else _step)
        opt.zero_grad = types.MethodType(_zero_grad, opt)
        opt.add_param_group = types.MethodType(_add_param_group, opt)
        self.update.attach()

    def _existing_master(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The master another optimizer of the same models already made for ``param``."""
        for ms in self.model_states:
            master = ms.masters.get(param)
            if master is not None:
                return master
        return None

    def _with_masters(self, params: List[torch.Tensor]):
        """``params`` with every half parameter replaced by its fp32 master, and the new
        ``(param, master)`` pairs; nothing is registered yet (see `_register_all`).

        A parameter listed twice gets one master; one that another optimizer of the same
        models already masters shares that master (as two optimizers would share a plain
        parameter). Optimizer state the parameter already has moves to the master, in fp32.
        """
        if not self.use_masters:
            return list(params), []
        out, new, made = [], [], {}
        for p in params:
            if p.is_floating_point() and p.dtype in HALF_DTYPES:
                master = made.get(p)
                if master is None:
                    master = self._existing_master(p)
                    if master is None:
                        master = _make_master(p, self.originals.pop(p, None))
                    made[p] = master
                    new.append((p, master))
                out.append(master)
            else:
                out.append(p)
        return out, new

    def _register_all(self, pairs) -> None:
        opt_state = self.optimizer.state
        for p, master in pairs:
            if p in opt_state and master not in opt_state:
                opt_state[master] = _state_to_fp32(opt_state.pop(p))
            self._register(p, master)

    def _register(self, param, master) -> None:
        self.masters[param] = master
        self.owner[master] = param
        for ms in self.model_states:
            if ms.owns(param):
                ms.masters[param] = master

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Module surgery replaced model parameter ``old`` with ``new``: follow it.

        A mastered parameter keeps its master (and with it the optimizer state). The master
        keeps its fp32 value when ``new`` holds the same (rounded) values as ``old`` did, and
        takes ``new``'s values when the replacement changed them. The models that owned
        ``old`` now own ``new``, so checkpoints and loads keep going through the master.
        """
        for ms in self.model_states:
            if ms.owns(old):
                ms.replace_param(old, new)
        master = self.masters.pop(old, None)
        if master is not None:
            del self.owner[master]
            with torch.no_grad():
                same = new.shape == master.shape and new.device == master.device
                if not (same and torch.equal(master.to(new.dtype), new.detach())):
                    master.copy_(new.detach())
            self._register(new, master)
            return
        for group in self.optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p is old:
                    group["params"][i] = new
                    if old in self.optimizer.state:
                        self.optimizer.state[new] = self.optimizer.state.pop(old)

    # -- the gradient life cycle ------------------------------------------------------
    def step_params(self) -> List[torch.Tensor]:
        """Parameters the optimizer steps on (masters where they exist)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # -- the step protocol ---------------------------------------------------------------
    @staticmethod
    def begin_backward(states, scaler, caller: str = "scale_loss") -> None:
        """Enter ``scale_loss`` (checked for every state first): clean gradients are set aside
        so the coming backward writes only scaled ones."""
        for st in states:
            if st.stage is Stage.IN_BLOCK:
                raise RuntimeError(
                    f"{caller}: {type(st.optimizer).__name__} is already inside an enclosing "
                    f"`with ampkit.scale_loss(...)` block; nested blocks on one optimizer would unscale its "
                    f"gradients twice. Finish the outer block first, or use delay_unscale=True to accumulate."
                )
            if st.scaled_by is not None and st.scaled_by is not scaler:
                raise RuntimeError(
                    f"{caller}(loss_id={st.run.scalers.index(scaler)}): the optimizer still holds gradients "
                    f"scaled by another loss's scaler (delay_unscale=True); finish that accumulation window first."
                )
        for st in states:
            st._set_aside()
            st.stage = Stage.IN_BLOCK
        mark_windows(states)

    @staticmethod
    def hold_scaled(states, scaler, widen: bool = False) -> None:
        """Leave the block with the gradients still scaled by ``scaler`` (``delay_unscale``, or
        an error inside the block): one window, unscaled together later. With ``widen``
        (``delay_unscale``) the half gradients are summed, still scaled, into the fp32 master
        gradients, so the window accumulates in fp32."""
        window = list({id(w): w for st in states for w in st.window + [st]}.values())
        for st in window:
            st.window = window
        for st in states:
            st.scaled_by = scaler
            st.stage = Stage.SCALED
            if widen:
                st._sum_scaled_into_masters()

    def _sum_scaled_into_masters(self) -> None:
        """Add the half gradients, still scaled, to the fp32 master gradients (checked at the unscale)."""
        if any(p.grad is not None for p in self.masters):
            self._move_half_grads(1.0, {})
            self.masters_scaled = True

    def unscale(self, check: OverflowCheck, inv_scale: float) -> None:
        """Turn the scaled gradients of the last backward into clean ones, checked by ``check``."""
        self.scaled_by = None
        plain = [_coalesced(p) for p in self.step_params() if p.grad is not None and p not in self.owner]
        if self.masters_scaled:
            self.masters_scaled = False
            unscale_and_check_([m.grad for m in self.owner if m.grad is not None], inv_scale, check.found_inf)
        self._move_half_grads(inv_scale, check.found_inf)
        unscale_and_check_(plain, inv_scale, check.found_inf)
        self._restore_stash()
        self.pending.append(check)
        self.window = [self]
        self.stage = Stage.UNSCALED

    def received_gradients(self) -> bool:
        """Whether a gradient reached this optimizer's parameters since ``begin_backward``."""
        return (any(p.grad is not None for p in self.masters)
                or any(p.grad is not None for p in self.step_params() if p not in self.owner))

    def record(self, check: OverflowCheck, overflow: bool, nonfinite=()) -> None:
        """``check`` was resolved: kept until a step consumes it; an overflow skips the next step."""
        self.unstepped.append(check)
        self.nonfinite = list(nonfinite)
        if overflow:
            self.skip = check.loss_id

    def finish_backward(self) -> None:
        """Before ``step``: unscale a window still scaled, check gradients made outside
        ``scale_loss`` (adopting half ones into the masters), and resolve the pending
        overflow checks."""
        unchecked = self.stage is Stage.READY  # no scale_loss since the last step: a plain backward's
        if self.scaled_by is not None:
            scaler = self.scaled_by
            window = [st for st in self.window if st.scaled_by is scaler]
            check = OverflowCheck(self.run, scaler, window)
            for st in window:
                st.unscale(check, 1.0 / scaler.loss_scale())
        check = OverflowCheck(self.run, None, [self])
        if self.masters and any(p.grad is not None for p in self.masters):
            self._move_half_grads(1.0, check.found_inf)
        if unchecked:  # one fused pass over the rest, only then (inside scale_loss, unscale checked them)
            plain = [_coalesced(p) for p in self.step_params() if p.grad is not None and p not in self.owner]
            unscale_and_check_(plain, 1.0, check.found_inf)
        if check.found_inf:
            self.pending.append(check)
        reduce_windows([self])
        for check in self.pending:
            check.resolve()
        self.pending.clear()

    def _set_aside(self) -> None:
        if self.scaled_by is not None:
            return
        for p in self.step_params():
            if p.grad is not None and p not in self.owner:
                self.stash[p] = p.grad
                p.grad = None
        for p in self.masters:
            p.grad = None
        self._spent = []

    def _restore_stash(self) -> None:
        """Add the set-aside clean gradients back to the fresh ones."""
        restored, add_to, add_from = [], [], []
        for p, g in self.stash.items():
            if p.grad is None:
                restored.append((p, g))
            elif p.grad.is_sparse or g.is_sparse:
                restored.append((p, p.grad + g))
            else:
                add_to.append(p.grad)
                add_from.append(g)
        for p, g in restored:
            p.grad = g
        if add_to:
            for dst, src in zip(_by_device(add_to), _by_device(add_from)):
                torch._foreach_add_(dst, src)
        self.stash.clear()

    def _move_half_grads(self, inv_scale: float, found_inf: dict) -> None:
        """Move the model's half gradients into the masters' fp32 gradients, times
        ``inv_scale`` and checked for inf/NaN.

        Where the fp32 gradients come from depends on their total size. Below
        ``REUSED_GRADS_BYTES`` they are fresh tensors every step: the allocator serves them
        from memory the backward has just freed, still in cache. Above it, each master
        keeps one buffer across steps: that much fresh memory would be handed back to the
        system between steps and page-faulted in again, which costs more than the copy. A
        master already holding a gradient (accumulation) gets a fresh one to add to it.

        The half gradients leave the model but stay alive until the next
        `clear_grads` or `before_backward`: freed here, just before the optimizer
        step, they would let the allocator trim the heap and the next backward would fault
        the pages back in.
        """
        half, targets, numel, sparse = [], [], 0, []
        for p, m in self.masters.items():
            g = p.grad
            if g is not None:
                if g.is_sparse:
                    sparse.append((m, g))
                else:
                    half.append(g)
                    targets.append(m)
                    numel += m.numel()
                p.grad = None
        self._spent = half
        for m, g in sparse:  # widened before coalescing: duplicate rows could overflow the half sum
            g = g.float().coalesce()
            unscale_and_check_([g], inv_scale, found_inf)
            m.grad = g if m.grad is None else m.grad + g
        reuse = 4 * numel >= REUSED_GRADS_BYTES
        out, add_to, add_from = [], [], []
        for m in targets:
            if m.grad is None:
                m.grad = self._buffer(m) if reuse else torch.empty_like(m)
                out.append(m.grad)
            else:
                out.append(torch.empty_like(m))
                add_to.append(m.grad)
                add_from.append(out[-1])
        copy_unscale_and_check_(out, half, inv_scale, found_inf)
        if add_to:
            torch._foreach_add_(add_to, add_from)

    def _buffer(self, master: torch.Tensor) -> torch.Tensor:
        buf = self._grad_buffers.get(master)
        if buf is None:
            buf = self._grad_buffers[master] = torch.empty_like(master)
        return buf

    def clear_grads(self, set_to_none: bool = True) -> None:
        """Clear model and master gradients alike, and forget set-aside or scaled ones.

        Called without a ``step()`` since the last backward (a dropped batch), it also
        forgets that batch's overflow checks: no pending skip, and the scaler moves back
        to where it was, as if the batch had never been seen.
        """
        for check in reversed(self.unstepped):
            check.rollback()
        self.unstepped = []
        self.pending = []
        self.skip = None
        self.window = [self]
        if self._zero_grad_takes_set_to_none:
            self._zero_grad(set_to_none=set_to_none)
        else:  # a wrapper whose zero_grad() takes no argument (Apex's LARC, vendored in many repositories)
            self._zero_grad()
        for p in self.masters:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        if not set_to_none:  # from now on master gradients persist, zero-filled, as plain ones do
            self.keep_grads = True
        self.stash.clear()
        self.scaled_by = None
        self.masters_scaled = False
        self._spent = []
        if self.stage is not Stage.IN_BLOCK:
            self.stage = Stage.READY

    def step(self):
        """``optimizer.step()``: skipped after an overflow; masters copied into the model after."""
        if self.stage is Stage.IN_BLOCK:
            raise RuntimeError(
                f"{type(self.optimizer).__name__}.step() was called inside `with ampkit.scale_loss(...)`; the "
                f"gradients are still scaled there. Call optimizer.step() after the block."
            )
        self.finish_backward()
        for check in self.unstepped:
            check.consumed = True
        self.unstepped = []
        self.last_step_skipped = self.skip is not None
        if self.skip is not None:
            self.skip = None
            self.clear_grads(set_to_none=not self.keep_grads)
            return None
        if self.runs_hooks:
            run_pre_hooks(self.optimizer)
            with hooks_set_aside(self.optimizer):
                result, written = self.update.step()
        else:
            result, written = self.update.step()
        self.copy_masters_to_model(written)
        if self.runs_hooks:
            run_post_hooks(self.optimizer)
        if not self.keep_grads:
            for m in self.owner:
                m.grad = None
        self.stage = Stage.READY
        return result

    def update_skipped(self) -> None:
        """The step left weights and state as they were (its update would have written
        non-finite weights, see ``_update/eight_bit.py``): ``step_was_skipped`` says so."""
        self.last_step_skipped = True

    def copy_masters_to_model(self, written=()) -> None:
        """One fused copy: with master weights the optimizer is on one device. Model
        parameters in ``written`` (the fused update's) already hold their masters."""
        pairs = [(p, m) for p, m in self.masters.items() if p not in written]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


def _takes(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_devices(params, use_masters: bool) -> None:
    """With master weights the optimizer's parameters must be on one device."""
    if use_masters:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"master_weights=True: the optimizer's parameters must be on one device, found "
                f"{sorted(str(d) for d in devices)}; use one optimizer per device."
            )


def _coalesced(param: torch.Tensor) -> torch.Tensor:
    """``param.grad``, coalesced first when it is a sparse half gradient (so the unscale check
    sees the sums that the optimizer will apply, as torch.amp.GradScaler does)."""
    grad = param.grad
    if grad.is_sparse and grad.dtype in HALF_DTYPES and not grad.is_coalesced():
        grad = param.grad = grad.coalesce()
    return grad


def _wrapped_step(optimizer, previous, step_fn):
    """``optimizer.step`` for the instance: ``step_fn`` bound, unless an LR scheduler created
    before ``initialize`` had already wrapped ``step``; then a function that keeps the
    scheduler's marker, so the scheduler still sees ``step`` as called (skipped steps too)
    and does not warn that ``step`` was overridden."""
    if not getattr(previous, "_wrapped_by_lr_sched", False):
        return types.MethodType(step_fn, optimizer)

    @functools.wraps(_step)
    def step(closure=None):
        optimizer._opt_called = True
        return step_fn(optimizer, closure)

    step._wrapped_by_lr_sched = True
    return step


def _step(optimizer, closure=None):
    """``optimizer.step()``: skipped after an overflow; masters copied into the model after."""
    state: OptimizerState = optimizer._ampkit
    if closure is not None:
        raise RuntimeError(
            "optimizer.step(closure): closures are not supported by ampkit; compute the loss, "
            "run it through ampkit.scale_loss, then call optimizer.step()."
        )
    if getattr(optimizer, "grad_scale", None) is not None:
        raise RuntimeError(
            "torch.amp.GradScaler.step(optimizer): this optimizer steps on ampkit's fp32 master weights, "
            "which GradScaler cannot unscale. Drop the GradScaler and use `with ampkit.scale_loss(loss, "
            "optimizer) as scaled_loss: scaled_loss.backward()` then optimizer.step(); to keep a GradScaler "
            "checkpoint's scale, ampkit.load_state_dict({'loss_scaler0': {'loss_scale': scaler.get_scale(), "
            "'unskipped': 0}})."
        )
    for ms in state.model_states:
        if ms.dtype_error is not None:
            raise RuntimeError(ms.dtype_error)
    return state.step()



# The chunked updates (O7, O8, remainder masters) step eagerly inside a compiled step: their
# per-step gradient and state swaps in Python would re-trace every step.
_eager_step = eager_under_compile(_step)


@eager_under_compile
def _zero_grad(optimizer, set_to_none: Optional[bool] = None):
    """``optimizer.zero_grad()``: clears model and master gradients alike (to None unless the
    optimizer says otherwise: Apex's FusedSGD stand-in zeroes them, ``set_grad_none=False``)."""
    if set_to_none is None:
        set_to_none = bool(getattr(optimizer, "set_grad_none", True))
    optimizer._ampkit.clear_grads(set_to_none)


def _add_param_group(optimizer, param_group: dict):
    """``optimizer.add_param_group()``: half parameters of the new group get masters too.

    Everything is checked before anything changes: the devices (with master weights the
    whole optimizer must stay on one device), parameters the optimizer already holds
    (PyTorch's own duplicate check cannot see them once they are behind masters), and
    then PyTorch's own checks; the masters are registered only once the group is in.
    """
    state: OptimizerState = optimizer._ampkit
    if not isinstance(param_group, dict):
        raise TypeError(f"add_param_group(param_group=...): expected a dict, got {type(param_group).__name__}.")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "add_param_group(params=set): parameters need an ordered collection (a list); "
            "the order of a set changes between runs."
        )
    else:
        params = list(params)
    named = [isinstance(p, tuple) for p in params]
    tensors = [p[1] if is_named else p for p, is_named in zip(params, named)]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(t))
    held = set(state.step_params()) | set(state.masters)
    if any(t in held for t in tensors):
        raise ValueError("some parameters appear in more than one parameter group")
    check_devices(state.step_params() + tensors, state.use_masters)
    stepped, new = state._with_masters(tensors)
    stepped = [(p[0], s) if is_named else s for p, s, is_named in zip(params, stepped, named)]
    result = state._add_param_group(dict(param_group, params=stepped))
    state._register_all(new)
    return result
