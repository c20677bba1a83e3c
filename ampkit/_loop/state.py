"""The run's state from outside the loop: loss-scaler checkpoints, scales and skipped steps.

Each call takes the run from ``optimizer=`` (or ``model=``), else the current run (see
``ampkit._run.registry``).
"""
from .._optim.optimizer_wrappers import unwrap
from .._run import registry


def state_dict(destination=None, optimizer=None, model=None) -> dict:
    """Every loss scaler's state, in Apex's format: ``{"loss_scaler0": {"loss_scale", "unskipped"}, ...}``.

    At update_rounding="stochastic" (O7) and with 8-bit optimizer state (O8) also
    ``"stochastic_rounding"``: the rounder's seed and step.

    Args:
        destination: a dict to fill (and return) instead of a new one.
        optimizer: the run whose scalers are meant, by its optimizer (else the current run).
        model: the run whose scalers are meant, by its model.
    """
    return registry.run_of("ampkit.state_dict()", _unwrapped(optimizer), model).state_dict(destination)


def load_state_dict(state: dict, optimizer=None, model=None) -> None:
    """Restore loss scalers from `state_dict` output (or Apex's ``amp.state_dict()``).

    Args:
        state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}`` with one
            entry per loss of the run; checked whole before anything loads.
        optimizer: choose the run by its optimizer, as in `state_dict`.
        model: choose the run by its model.
    """
    registry.run_of("ampkit.load_state_dict()", _unwrapped(optimizer), model).load_state_dict(state, "ampkit.load_state_dict")


def loss_scalers(optimizer=None, model=None) -> list:
    """The `ampkit.LossScaler` of each loss (``loss_id`` order) of one training run.

    Read ``s.loss_scale()``, ``s.skipped_steps`` (steps skipped for an overflow in this
    loss so far) and ``s.consecutive_overflows``.

    Args:
        optimizer: the run, by its optimizer (else the current run).
        model: the run, by its model.
    """
    return list(registry.run_of("ampkit.loss_scalers()", _unwrapped(optimizer), model).scalers)


def step_was_skipped(optimizer) -> bool:
    """Whether ``optimizer``'s last ``step()`` was skipped because gradients overflowed
    (an LR scheduler should then not advance). False before its first step."""
    optimizer = _unwrapped(optimizer)
    registry.of_optimizer("ampkit.step_was_skipped()", optimizer)
    return optimizer._ampkit.last_step_skipped


def nonfinite_gradients(optimizer=None) -> list:
    """The parameters (named as ``model.named_parameters()`` names them) whose gradients held
    inf/NaN in the last step whose overflow check was decided: the layers behind a skipped
    step. Empty after a clean step. Looked for only when an overflow was found, so a clean
    step costs nothing. The run is ``optimizer``'s, else the current run."""
    if optimizer is not None:
        optimizer = _unwrapped(optimizer)
        registry.of_optimizer("ampkit.nonfinite_gradients()", optimizer)
        return list(optimizer._ampkit.nonfinite)
    return list(registry.current("ampkit.nonfinite_gradients()").nonfinite)


def _unwrapped(optimizer):
    """A framework's optimizer wrapper as the optimizer behind it (see ``optimizer_wrappers``)."""
    return None if optimizer is None else unwrap(optimizer)
