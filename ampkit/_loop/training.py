"""``scale_loss`` and ``master_params``: the calls inside a training loop."""
import contextlib

import torch

from .._common.dynamo import eager_under_compile
from .._common.logs import logger
from .._initialize.request import as_list
from .._optim.optimizer_state import OptimizerState
from .._optim.optimizer_wrappers import OptimizerLike, unwrap
from .._parallel.ddp_windows import reduce_windows
from .._run import registry
from .._run.overflow import OverflowCheck


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
    block = _open_block(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)
    if block is None:
        yield loss
        return
    states, scaler, scale = block
    try:
        yield loss.float() * scale if scale != 1.0 else loss.float()
    except BaseException:
        # A batch dropped inside the block: whatever backward wrote still carries the
        # scale. Record it, so zero_grad() discards it and a later backward unscales it.
        _drop_block(states, scaler)
        raise
    _close_block(states, scaler, scale, delay_unscale, delay_overflow_check)


@eager_under_compile
def _open_block(loss, optimizers, loss_id, delay_unscale, delay_overflow_check):
    """The arguments checked and the optimizers' stages moved into the block: ``(states, scaler,
    scale)``, or None where ampkit is disabled (the loss goes through as it is)."""
    opts, _ = as_list(optimizers, "scale_loss(optimizers=...)", (torch.optim.Optimizer, OptimizerLike), "an optimizer or a list of optimizers")
    _notice_plain_accelerators(opts)
    opts = [unwrap(o) for o in opts]
    run = _run_of(opts)
    if not run.enabled:
        return None
    scaler = run.scalers[_check_args(run, loss, loss_id, delay_unscale, delay_overflow_check)]
    states = list({id(o): o._ampkit for o in opts}.values())  # an optimizer listed twice counts once
    OptimizerState.begin_backward(states, scaler)
    return states, scaler, scaler.loss_scale()


@eager_under_compile
def _drop_block(states, scaler) -> None:
    """The block left by an exception: its gradients held, still scaled."""
    OptimizerState.hold_scaled(states, scaler)


@eager_under_compile
def _close_block(states, scaler, scale, delay_unscale, delay_overflow_check) -> None:
    """The block's gradients unscaled and checked (held scaled with ``delay_unscale``)."""
    if delay_unscale:
        OptimizerState.hold_scaled(states, scaler, widen=True)
        return
    if not any(st.received_gradients() for st in states):
        if any(ms.holds_gradients_back() for st in states for ms in st.model_states):
            OptimizerState.hold_scaled(states, scaler, widen=True)
            return  # FSDP2 accumulates them unsharded (no sync): the synchronizing backward's block unscales
        OptimizerState.hold_scaled(states, scaler)
        raise RuntimeError(_unreached(states, scale))
    check = OverflowCheck(states[0].run, scaler, states)
    for st in states:
        st.unscale(check, 1.0 / scale)
    reduce_windows(states)
    if not delay_overflow_check:
        check.resolve()


def _notice_plain_accelerators(wrappers) -> None:
    """Say once per wrapper that accelerate's ``AcceleratedOptimizer`` comes from an Accelerator
    ampkit was not attached to (``ampkit.integrations.accelerate`` marks those it adopts)."""
    for w in wrappers:
        state = getattr(unwrap(w), "_ampkit", None)
        if (type(w).__name__ != "AcceleratedOptimizer" or getattr(w, "_ampkit_adopted", False)
                or vars(w).get("_ampkit_noticed") or state is None or not state.run.enabled):
            continue
        w._ampkit_noticed = True
        clip = ("its clip_grad_norm_/clip_grad_value_(model.parameters()) clip nothing (the gradients are in the "
                "fp32 masters the optimizer steps on); " if state.masters else "")
        logger.warning("ampkit: %s was prepared by an accelerate Accelerator that ampkit is not attached to: %s"
                       "its optimizer_step_was_skipped misses ampkit's skipped steps (prepared LR schedulers do not "
                       "hold) and its save_state the loss scalers. Use ampkit.integrations.accelerate."
                       "AmpkitAccelerator(...), or attach(accelerator).", type(state.optimizer).__name__, clip)


def _unreached(states, scale) -> str:
    names = " and ".join(f"{type(st.optimizer).__name__} ({len(st.step_params())} parameters)" for st in states)
    return (f"scale_loss(loss, optimizers=...): the backward inside the block reached none of the parameters of "
            f"{names}: the loss does not depend on this optimizer's model (another experiment's optimizer?), or "
            f"scaled_loss.backward() was not called in the block. Gradients it wrote elsewhere carry the loss "
            f"scale {scale:g}; zero them (optimizer.zero_grad() of their optimizer) before stepping.")


def _check_args(run, loss, loss_id, delay_unscale, delay_overflow_check) -> int:
    if not torch.is_tensor(loss) or loss.numel() != 1:
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ValueError(f"scale_loss(loss=...): expected a scalar (one-element) tensor, got {shape}; reduce it first (e.g. loss.mean()).")
    n = len(run.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < n:
        raise ValueError(f"scale_loss(loss_id={loss_id!r}): expected an integer in [0, {n - 1}] (initialize got num_losses={n}).")
    for name, value in (("delay_unscale", delay_unscale), ("delay_overflow_check", delay_overflow_check)):
        if not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
            raise TypeError(f"scale_loss({name}={value!r}): expected True or False.")
    return loss_id


def _run_of(opts):
    states = [getattr(o, "_ampkit", None) for o in opts]
    runs = {id(st.run): st.run for st in states if st is not None}
    if len(runs) > 1:
        raise RuntimeError("scale_loss: the optimizers come from different ampkit.initialize calls; pass them to one initialize.")
    if runs and all(st is not None for st in states):
        return next(iter(runs.values()))
    latest = registry.latest()
    if not runs and latest is not None and not latest.enabled:
        return latest
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
    for group in unwrap(optimizer).param_groups:
        yield from group["params"]
