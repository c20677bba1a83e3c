"""ampkit as a Lightning ``Trainer`` precision plugin: ``Trainer(plugins=[AmpkitPrecision("O8")])``.

The plugin calls ``ampkit.initialize`` in ``connect`` (the one hook that sees the model and the
optimizers together, after ``configure_optimizers``; Lightning calls it for every stage: a module
cast before is evaluated as it is, and a later fit's new optimizers join its run), runs
``backward`` inside ``scale_loss``, steps through ampkit's optimizer (a skipped step skips),
clips the masters (``gradient_clip_val``), holds step-interval LR schedulers after a skipped step, logs the loss
scale and the skipped steps, and saves the loss scalers in Lightning's checkpoints.

What is initialized: the LightningModule's child modules that hold parameters, each as its own
model, so a ``training_step`` that calls ``self.net(x)`` casts as one calling ``self(x)``
does; a LightningModule with parameters of its own is initialized whole. Under the DDP
strategy the model torch's DDP wrapped (still float32) is rewrapped in ampkit's
``DistributedDataParallel`` once cast, reducing as ``initialize(..., ddp=True)`` does.

``PrecisionReportCallback`` writes ``ampkit.precision_report``'s HTML for the first batches of fit.
"""
import contextlib
import copy
import gc
import logging
from typing import Any, Callable, List, Optional

from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from .._initialize.initialize import add_optimizers, initialize
from .._loop.state import load_state_dict, loss_scalers, state_dict
from .._loop.training import master_params, scale_loss
from .._optim.optimizer_wrappers import unwrap
from .._precision import precision_report
from .._run import registry
from ..parallel import DistributedDataParallel
from .mixins import with_mixin
from .schedulers import hold_on_skipped_steps

__all__ = ["AmpkitPrecision", "PrecisionReportCallback"]

logger = logging.getLogger(__name__)


class AmpkitPrecision(Precision):
    """Train at ampkit's ``opt_level`` ("O0".."O8" or "auto"); ``options`` go to ``ampkit.initialize``
    (``master_weights="remainder"``, ``loss_scale=...``, ...). One plugin per ``Trainer``."""

    def __init__(self, opt_level: str = "O5", **options):
        super().__init__()
        options.setdefault("verbosity", 0)
        self.opt_level, self.options = opt_level, options
        self.optimizers: List[Any] = []  # the optimizers ampkit.initialize prepared
        self._module = None

    def connect(self, model: nn.Module, optimizers: list, lr_schedulers: list):
        wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
        module = model.module if wrapped else model
        models = _models(module)
        new = [o for o in optimizers if getattr(unwrap(o), "_ampkit", None) is None]
        if not any(getattr(m, "_ampkit", None) is not None for m in models):
            initialize(models, new or None, opt_level=self.opt_level, **self.options)
        elif new:  # a later fit of a module cast before (by a fit, or an evaluation)
            self._check_cast(module, models)
            add_optimizers(models, new, "AmpkitPrecision")
        self.optimizers, self._module = list(optimizers), with_mixin(module, _Toggling)
        for config in lr_schedulers:
            if config.interval == "step" or not module.automatic_optimization:
                hold_on_skipped_steps(config.scheduler)
        if wrapped:  # the DDP strategy wrapped the float32 model: wrap the cast one as ampkit.initialize(ddp=True) does
            model = _rewrapped(model, self.optimizers)
        return model, optimizers, lr_schedulers

    def _check_cast(self, module: nn.Module, models: list) -> None:
        """A module cast before goes on at its level, with every child that holds parameters cast."""
        fresh = [type(m).__name__ for m in models if getattr(m, "_ampkit", None) is None]
        if fresh:
            raise RuntimeError(f"AmpkitPrecision: {type(module).__name__} was cast by ampkit before, but not its "
                               f"{fresh} (added since); build the whole module before its first fit or evaluation.")
        level = registry.of_model("AmpkitPrecision", models[0]).properties.opt_level
        if self.opt_level not in ("auto", level):
            raise ValueError(f"AmpkitPrecision(opt_level={self.opt_level!r}): {type(module).__name__} was cast at "
                             f"{level} before; continue it with opt_level={level!r} or 'auto', or build a fresh module.")

    @contextlib.contextmanager
    def train_step_context(self):
        if self._module is not None:  # the LightningOptimizers exist now: their zero_grad is ampkit's
            opts = self._module.optimizers()
            for opt in opts if isinstance(opts, list) else [opts]:
                unwrap(opt)
        with super().train_step_context():
            yield

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        optimizers = [optimizer] if optimizer is not None else self.optimizers
        with scale_loss(tensor, optimizers) as scaled:
            model.backward(scaled, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs):
        result = closure()  # training_step and backward: ampkit's step takes no closure
        self._after_closure(model, optimizer)  # on_before_optimizer_step, then clipping (of main_params)
        if result is None and model.automatic_optimization:
            return None  # training_step returned None: nothing to step
        output = optimizer.step(**kwargs)
        scalers = loss_scalers(optimizer=optimizer)
        model.log("ampkit/loss_scale", float(scalers[0].loss_scale()), on_step=True, on_epoch=False)
        model.log("ampkit/skipped_steps", float(sum(s.skipped_steps for s in scalers)), on_step=True, on_epoch=False)
        return output

    def main_params(self, optimizer):
        """What gradient clipping clips: the parameters the optimizer steps on (fp32 masters)."""
        return master_params(optimizer)

    def state_dict(self) -> dict:
        return state_dict(optimizer=self.optimizers[0]) if self.optimizers else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            load_state_dict(state, optimizer=self.optimizers[0])


class _Toggling:
    """A LightningModule whose ``toggle_optimizer``/``untoggle_optimizer`` (which set ``requires_grad``
    on the optimizers' ``param_groups``: fp32 masters) reach the model parameters behind the masters."""

    def toggle_optimizer(self, optimizer) -> None:
        super().toggle_optimizer(optimizer)
        _mirror_masters(self.trainer.optimizers)

    def untoggle_optimizer(self, optimizer) -> None:
        super().untoggle_optimizer(optimizer)
        _mirror_masters(self.trainer.optimizers)


def _mirror_masters(optimizers) -> None:
    """Each model parameter that has an fp32 master requires a gradient as its master does."""
    for opt in optimizers:
        for param, master in unwrap(opt)._ampkit.masters.items():
            param.requires_grad_(master.requires_grad)


def _rewrapped(ddp: nn.parallel.DistributedDataParallel, optimizers: list) -> nn.Module:
    """ampkit's DistributedDataParallel around ``ddp.module`` with ``ddp``'s options, reducing as
    ``initialize(ddp=True)`` would (in float32 where a half model has no masters); torch's wrapper,
    built on the float32 model, goes."""
    module, options = ddp.module, _ddp_options(ddp)
    fp32 = registry.of_optimizer("AmpkitPrecision", unwrap(optimizers[0])).properties.reduces_in_fp32
    del ddp  # its reducer (and the autograd hooks it put on the parameters) goes with it
    gc.collect()
    return DistributedDataParallel(module, allreduce_always_fp32=fp32, **options)


def _ddp_options(ddp: nn.parallel.DistributedDataParallel) -> dict:
    """The keywords the strategy built ``ddp`` with: its ``_ddp_kwargs`` (``find_unused_parameters``,
    ``static_graph``, ...) and ``ddp``'s devices."""
    options = dict(getattr(ddp.module.trainer.strategy, "_ddp_kwargs", None) or {})
    if ddp.device_ids:
        options.update(device_ids=ddp.device_ids, output_device=ddp.output_device)
    return options


def _models(module: nn.Module) -> list:
    """The modules to initialize: the children that hold parameters, or ``module`` itself when it
    holds parameters of its own."""
    if next(module.parameters(recurse=False), None) is not None:
        return [module]
    children = [c for c in module.children() if next(c.parameters(), None) is not None]
    return children or [module]


class PrecisionReportCallback(Callback):
    """Write ``ampkit.precision_report``'s HTML for the first ``batches`` batches of ``fit``.

    The report is measured on a float32 copy of the LightningModule taken at ``setup`` (before
    ``AmpkitPrecision`` casts it), with ``loss_fn(module, batch)``; by default the module's own
    ``training_step(batch, 0)``. ``levels`` as in ``precision_report``. ``self.report`` holds it.
    """

    def __init__(self, path="precision_report.html", batches: int = 2, loss_fn: Optional[Callable] = None,
                 levels=None):
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"PrecisionReportCallback(batches={batches!r}): expected a positive integer.")
        self.path, self.batches, self.levels = path, batches, levels
        self.loss_fn = loss_fn or (lambda module, batch: module.training_step(batch, 0))
        self.report = None
        self._copy, self._seen = None, []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and self.report is None:
            self._copy = copy.deepcopy(pl_module)  # float32 still: the plugin initializes in connect, later

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._copy is None:
            return
        self._seen.append(copy.deepcopy(batch))
        if len(self._seen) == self.batches:
            self.report = precision_report(self._copy, self.loss_fn, self._seen, levels=self.levels)
            if trainer.is_global_zero:
                written = self.report.to_html(self.path)
                logger.info("precision report for the first %d batches written to %s", self.batches, written)
            self._copy, self._seen = None, []
