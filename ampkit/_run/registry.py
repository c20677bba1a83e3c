"""The one process-wide state: the runs alive, and the rule for "the current run".

A run lives as long as one of its models. The current run is the most recent
``initialize`` **with optimizers** (as Apex's amp had it); an ``initialize`` without
optimizers (a teacher, an EMA copy) becomes it only while no training run is alive. With
several training runs alive, calls that take no ``optimizer=`` use the most recent one
and log a one-time warning naming it; they never raise for that. A run kept alive only by a
reference cycle is garbage, never current: with several training runs alive, such a call
runs the cycle collector before choosing (a full ``gc.collect()``, tenths of a second on a
large heap; with one training run, the common case, nothing is collected). Only
``ampkit.autocast()``, entered every step, collects just before its first warning.
"""
import gc
import itertools
import logging
import weakref
from typing import Set, Tuple

logger = logging.getLogger("ampkit")

_ids = itertools.count(1)
_by_model = weakref.WeakKeyDictionary()  # initialized model -> its run
_latest = None  # the run of the latest initialize (also a disabled one: it has no models)
_warned: Set[Tuple[str, int]] = set()


def register(run, models) -> None:
    """Record ``run`` (from the ``initialize`` that prepared ``models``) as the newest."""
    global _latest
    run.id = next(_ids)
    for model in models:
        _by_model[model] = run
    _latest = run


def models_of(run) -> list:
    """The live models of ``run``, in the order ``initialize`` got them."""
    return [m for m, r in list(_by_model.items()) if r is run]


def latest():
    """The run of the latest ``initialize`` of any kind, or ``None``."""
    return _latest


def _training_runs(collect: bool) -> list:
    if collect:
        gc.collect()  # runs that are only garbage still waiting for the cycle collector
    runs = {id(r): r for r in list(_by_model.values()) if r.enabled and r.trains}
    return sorted(runs.values(), key=lambda r: r.id)


def current(caller: str, collect: bool = True):
    """The current run (see the module docstring); RuntimeError before any ``initialize``.
    ``collect=False``: with several training runs, collect garbage only before the first warning."""
    runs = _training_runs(collect=False)
    if len(runs) > 1 and (collect or (caller, runs[-1].id) not in _warned):
        runs = _training_runs(collect=True)
        if len(runs) > 1 and (caller, runs[-1].id) not in _warned:
            _warned.add((caller, runs[-1].id))
            logger.warning(
                "%s: %d training runs (initialize calls with optimizers) are alive; using the most recent, "
                "%s. Pass optimizer=... (or model=...) to choose another.", caller, len(runs), runs[-1].describe())
    if runs:
        return runs[-1]
    if _latest is None:
        raise RuntimeError(
            f"{caller} was called before ampkit.initialize(); call "
            f"model, optimizer = ampkit.initialize(model, optimizer, opt_level=...) first."
        )
    return _latest


def run_of(caller: str, optimizer=None, model=None):
    """The run ``optimizer`` (else ``model``) belongs to; without either, `current`."""
    if optimizer is not None:
        return of_optimizer(caller, optimizer)
    if model is not None:
        return of_model(caller, model)
    return current(caller)


def of_optimizer(caller: str, optimizer):
    """The run of an optimizer returned by ``initialize``; a clear error for anything else."""
    if not hasattr(optimizer, "param_groups"):
        raise TypeError(f"{caller}: optimizer= expects an optimizer returned by ampkit.initialize, got "
                        f"{_kind(optimizer)}.")
    state = getattr(optimizer, "_ampkit", None)
    if state is None:
        raise ValueError(f"{caller}: optimizer={type(optimizer).__name__} did not go through ampkit.initialize.")
    return state.run


def of_model(caller: str, model):
    """The run of a model prepared by ``initialize`` (or of the module a wrapper holds)."""
    if not (hasattr(model, "parameters") and hasattr(model, "named_modules")):
        raise TypeError(f"{caller}: model= expects an nn.Module prepared by ampkit.initialize, got {_kind(model)}.")
    run = _by_model.get(getattr(model, "module", model)) or _by_model.get(model)
    if run is None:
        raise ValueError(f"{caller}: model={type(model).__name__} did not go through ampkit.initialize.")
    return run


def _kind(obj) -> str:
    name = type(obj).__name__
    if hasattr(obj, "named_modules"):
        return f"a {name} (an nn.Module: pass it as model=...)"
    return f"a {name}"

