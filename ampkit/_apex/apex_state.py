"""Apex's ``amp._amp_state``, as far as it can be honestly provided, and clear errors for
the parts of Apex's amp that ampkit does not have (the pre-``initialize`` handle API).

``_amp_state.loss_scalers[i]`` and ``_amp_state.opt_properties`` are views of the
current run (the latest ``ampkit.initialize`` with optimizers); the loss scale is changed through
``ampkit.load_state_dict`` (or Apex's ``amp.load_state_dict``), never by assignment.
"""
import warnings

from .._common.errors import NoEffectWarning
from .._run import registry
from .._run.scaler import LossScaler

__all__ = ["_amp_state", "removed_attribute"]

_SET_SCALE = ("ampkit.load_state_dict({'loss_scaler0': {'loss_scale': 1024.0, 'unskipped': 0}}) "
              "(one entry per loss; the same call as Apex's amp.load_state_dict)")

_REMOVED = {
    "init": "amp.init() and its handle belong to Apex's pre-2019 API, which ampkit does not provide",
    "handle": "Apex's amp handle (amp.init()) is not provided by ampkit",
    "AmpHandle": "Apex's amp handle (amp.init()) is not provided by ampkit",
    "NoOpHandle": "Apex's amp handle (amp.init()) is not provided by ampkit",
    "wrap_optimizer": "handle.wrap_optimizer() belongs to Apex's pre-2019 amp.init() API",
}
_INSTEAD = ("use model, optimizer = ampkit.initialize(model, optimizer, opt_level='O1') and "
            "`with ampkit.scale_loss(loss, optimizer) as scaled: scaled.backward()`")


def removed_attribute(owner: str, name: str) -> AttributeError:
    """The AttributeError for ``owner.name``: a migration hint for Apex's removed names."""
    if name in _REMOVED:
        return AttributeError(f"{owner}.{name}: {_REMOVED[name]}; {_INSTEAD}.")
    return AttributeError(f"module {owner!r} has no attribute {name!r}")


def _run():
    """The current run (see ``ampkit._run.registry``), or None before any ``initialize``."""
    return registry.current("amp._amp_state") if registry.latest() is not None else None


class LossScalerView:
    """Read-only view of one loss scaler of the current run, with Apex's attribute names."""

    def __init__(self, index: int, scaler):
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def _unskipped(self) -> int:
        return self._scaler.unskipped

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _min_loss_scale(self):
        return self._scaler.min_loss_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.growth_interval

    def __setattr__(self, name, value):
        if name == "_loss_scale":  # Apex's tests and some scripts set the scale this way
            where = f"amp._amp_state.loss_scalers[{self._index}]"
            state = dict(self._scaler.state_dict(), loss_scale=value)
            LossScaler.check_state(where, state)  # the same validation as a loaded scale
            self._scaler.load_state_dict(state)
            return
        raise AttributeError(
            f"amp._amp_state.loss_scalers[{self._index}].{name} is read-only in ampkit; to set the loss "
            f"scale assign _loss_scale or use {_SET_SCALE}."
        )

    def __getattr__(self, name):
        raise AttributeError(
            f"amp._amp_state.loss_scalers[{self._index}].{name}: ampkit's view of Apex's LossScaler offers "
            f"loss_scale(), _loss_scale, _unskipped, dynamic, _min_loss_scale, _max_loss_scale and "
            f"_scale_seq_len; unscaling and scale updates happen inside ampkit.scale_loss."
        )

    def __repr__(self):
        return f"LossScalerView(loss_scale={self.loss_scale()}, unskipped={self._unskipped}, dynamic={self.dynamic})"


class PropertiesView:
    """Read-only view of the current run's options, with Apex's ``enabled`` and ``options``."""

    def __init__(self, run):
        object.__setattr__(self, "_run", run)

    @property
    def enabled(self) -> bool:
        return self._run is not None and self._run.enabled

    @property
    def options(self) -> dict:
        props = None if self._run is None else self._run.properties
        rows = dict(props.rows()) if props is not None else {}
        return {"enabled": self.enabled, **rows}

    def __getattr__(self, name):
        options = self.options
        if name in options:
            return options[name]
        raise AttributeError(f"amp._amp_state.opt_properties has no option {name!r}; options: {sorted(options)}.")

    def __setattr__(self, name, value):
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name} is read-only in ampkit; pass {name}=... to ampkit.initialize."
        )

    def __repr__(self):
        return f"PropertiesView({self.options})"


class AmpState:
    """``amp._amp_state``: the latest ``initialize`` call's loss scalers and options."""

    _FLAGS = ("hard_override", "allow_incoming_model_not_fp32")

    def __init__(self):
        object.__setattr__(self, "_flags", {name: False for name in self._FLAGS})

    @property
    def loss_scalers(self) -> list:
        s = _run()
        if s is None or not s.enabled:
            return []
        return [LossScalerView(i, scaler) for i, scaler in enumerate(s.scalers)]

    @property
    def opt_properties(self) -> PropertiesView:
        return PropertiesView(_run())

    @property
    def verbosity(self) -> int:
        s = _run()
        return 1 if s is None else s.verbosity

    @property
    def min_loss_scale(self):
        s = _run()
        return s.scalers[0].min_loss_scale if s is not None and s.scalers else None

    @property
    def max_loss_scale(self) -> float:
        s = _run()
        return s.scalers[0].max_loss_scale if s is not None and s.scalers else 2.0**24

    def __getattr__(self, name):
        if name in self._flags:
            return self._flags[name]
        raise removed_attribute("amp._amp_state", name)

    def __setattr__(self, name, value):
        if name in self._FLAGS:
            warnings.warn(
                f"amp._amp_state.{name} has no effect in ampkit: models in any dtype and on any device are "
                f"accepted, and option checks are always errors.", NoEffectWarning, stacklevel=2,
            )
            self._flags[name] = value
            return
        raise AttributeError(
            f"amp._amp_state.{name} is read-only in ampkit; options are set through ampkit.initialize, "
            f"and the loss scale through {_SET_SCALE}."
        )


_amp_state = AmpState()
