"""The run object: what one ``initialize`` call set up, reached from its models and optimizers.

A `Run` holds the resolved properties, one loss scaler per loss, the stochastic
rounder (O7, O8: the seed and step of the counter bits) and the logging settings. Its state
(``state_dict``) is Apex's ``amp.state_dict()`` plus, at O7 and O8, the rounder's.
"""
import logging
import warnings
from typing import List, Optional

from .._common.errors import NoEffectWarning
from .._common.logs import logger
from .._kernels.rounding import StochasticRounder
from .scaler import LossScaler

ROUNDING_KEY = "stochastic_rounding"  # state_dict() entry of the rounder (seed, step)


class Run:
    """The outcome of one ``initialize`` call."""

    def __init__(self, enabled: bool, properties=None, scalers=(), verbosity: int = 1, device_type: str = "cpu",
                 rounder: Optional[StochasticRounder] = None, optimizer_names=()):
        self.id = 0  # set by registry.register
        self.enabled = enabled
        self.properties = properties
        self.scalers: List[LossScaler] = list(scalers)
        self.verbosity = verbosity
        self.device_type = device_type
        self.rounder = rounder  # at update_rounding="stochastic", and with 8-bit optimizer state
        self.optimizer_names = tuple(optimizer_names)
        self.trains = bool(optimizer_names)
        self.floor_warned = set()  # loss ids whose min_loss_scale warning was logged
        self.nonfinite: List[str] = []  # parameters whose gradients overflowed in the last decided step

    def log(self, msg: str, *args, level: int = logging.INFO) -> None:
        if self.verbosity > 0:
            logger.log(level, msg, *args)

    def describe(self) -> str:
        level = self.properties.opt_level if self.properties is not None else "disabled"
        return f"run {self.id} (initialize at {level} with {', '.join(self.optimizer_names) or 'no optimizer'})"

    def state_dict(self, destination: Optional[dict] = None) -> dict:
        out = {} if destination is None else destination
        for i, s in enumerate(self.scalers):
            out[f"loss_scaler{i}"] = s.state_dict()
        if self.rounder is not None:
            out[ROUNDING_KEY] = self.rounder.state_dict()
        return out

    def load_state_dict(self, state: dict, caller: str = "ampkit.load_state_dict") -> None:
        """Restore `state_dict` output, checked whole first: on any error nothing changes."""
        scalers, rounding = self.check_state(state, caller)
        for scaler, value in zip(self.scalers, scalers):
            scaler.load_state_dict(value)
        if rounding is not None and self.rounder is not None:
            self.rounder.load_state_dict(rounding)

    def check_state(self, state, caller: str):
        """The scaler states (in loss order) and the rounding state of ``state``; errors name the key."""
        if not isinstance(state, dict):
            raise TypeError(f"{caller}(state): expected a dict, got {type(state).__name__}.")
        rounding = state.get(ROUNDING_KEY)
        rest = {k: v for k, v in state.items() if k != ROUNDING_KEY}
        bad = [k for k in rest if not (isinstance(k, str) and k.startswith("loss_scaler") and k[11:].isdigit())]
        if bad:
            raise ValueError(f"{caller}: unexpected key(s) {bad}; expected 'loss_scaler0', 'loss_scaler1', ..., {ROUNDING_KEY!r}")
        n = len(self.scalers)
        if len(rest) != n or any(f"loss_scaler{i}" not in rest for i in range(n)):
            raise ValueError(
                f"{caller}: the state dict holds {len(rest)} loss scaler(s) ({sorted(rest)}), "
                f"but initialize was called with num_losses={n}."
            )
        for key, value in rest.items():
            LossScaler.check_state(key, value)
        if rounding is not None:
            StochasticRounder.check_state(ROUNDING_KEY, rounding)
            if self.rounder is None:
                warnings.warn(f"{caller}: {ROUNDING_KEY!r} has no effect: nothing rounds updates "
                              f"stochastically in this run.", NoEffectWarning, stacklevel=4)
        return [rest[f"loss_scaler{i}"] for i in range(n)], rounding
