"""ampkit.integrations.lightning: the Lightning Trainer at every level equals the hand-written ampkit loop."""
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install ampkit[lightning])")
# Lightning 2.6's own pytree helper uses torch 2.13's deprecated LeafSpec: the framework's warning, not ampkit's.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")

import ampkit  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402

from ._models import (  # noqa: E402
    LEVELS, level_options, loss_of, make_batches, make_net, make_optimizer, reference, same, weights)


class Lit(pl.LightningModule):
    """A LightningModule around ``make_net()``; ``training_step`` calls ``self.net(x)`` or ``self(x)``."""

    def __init__(self, via_self=False, schedule=False, manual=False):
        super().__init__()
        self.net = make_net()
        self.via_self, self.schedule = via_self, schedule
        self.automatic_optimization = not manual
        self.seen = []  # the batches training_step saw, in order

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        loss = loss_of(self(x) if self.via_self else self.net(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.schedule:
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = make_optimizer(self.parameters())
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.loggers.Logger):
    """A logger that keeps every metric it is given."""

    def __init__(self):
        super().__init__()
        self.metrics = []

    name = "recorder"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def plugin(level):
    options = level_options(level)
    return AmpkitPrecision(options.pop("opt_level"), **options)


def fit(lit, batches, level, ckpt_path=None, steps=None, **trainer_kwargs):
    trainer_kwargs.setdefault("logger", False)
    trainer = pl.Trainer(max_steps=steps or len(batches), accelerator="cpu", devices=1, plugins=[plugin(level)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_equals_the_hand_written_loop(level):
    batches = make_batches(4)
    lit = Lit()
    trainer = fit(lit, batches, level)
    assert same(weights(lit.net), reference(level, batches)[0])
    scaler = ampkit.loss_scalers(optimizer=trainer.optimizers[0])[0]
    assert float(trainer.callback_metrics["ampkit/loss_scale"]) == scaler.loss_scale()
    assert lit.net[0].weight.dtype == {"O0": torch.float32, "O1": torch.float32, "O4": torch.float32}.get(
        level, lit.net[0].weight.dtype)


@pytest.mark.parametrize("level", ["O1", "O5", "O7"])
def test_a_training_step_calling_self_casts_as_one_calling_self_net(level):
    batches = make_batches(3)
    lit = Lit(via_self=True)
    fit(lit, batches, level)
    assert same(weights(lit.net), reference(level, batches)[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
def test_gradient_clip_val_clips_the_masters(level):
    batches = make_batches(3)
    lit = Lit()
    fit(lit, batches, level, gradient_clip_val=0.05)
    clipped = reference(level, batches, clip=0.05)[0]
    assert same(weights(lit.net), clipped)
    assert not same(clipped, reference(level, batches)[0])  # the clip changed the update


@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
def test_accumulate_grad_batches(level):
    batches = make_batches(6)
    lit = Lit()
    fit(lit, batches, level, steps=3, accumulate_grad_batches=2)
    assert same(weights(lit.net), reference(level, batches, accumulate=2)[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
def test_manual_optimization(level):
    batches = make_batches(4)
    lit = Lit(manual=True, schedule=True)
    fit(lit, batches, level)
    assert same(weights(lit.net), reference(level, batches, schedule=True)[0])


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_skipped_step_holds_the_scheduler_and_reaches_the_logger(manual):
    batches = make_batches(5, bad=[2])  # batch 2 overflows fp16: its step is skipped, the scale halves
    lit, logger = Lit(schedule=True, manual=manual), Recorder()
    trainer = fit(lit, batches, "O2", logger=logger, log_every_n_steps=1)
    expected, lrs = reference("O2", batches, schedule=True)
    assert same(weights(lit.net), expected)
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == lrs[-1] == 1e-2 * 0.5 ** 4  # five steps, one skipped: four halvings
    scaler = ampkit.loss_scalers(optimizer=opt)[0]
    assert scaler.skipped_steps == 1
    logged = [m for m in logger.metrics if "ampkit/skipped_steps" in m]
    assert [m["ampkit/skipped_steps"] for m in logged] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert logged[-1]["ampkit/loss_scale"] == scaler.loss_scale() == 2.0 ** 15


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")  # on purpose
@pytest.mark.parametrize("level", ["O2", "O5", "O7", "O8", "remainder"])
def test_checkpoint_and_fit_ckpt_path_resume_bit_exact(level, tmp_path):
    batches = make_batches(6, bad=[1])
    first = Lit(schedule=True)
    trainer = fit(first, batches, level, steps=3)
    path = tmp_path / "three.ckpt"
    trainer.save_checkpoint(path)
    assert "AmpkitPrecision" in torch.load(path, weights_only=False)
    resumed = Lit(schedule=True)
    fit(resumed, batches, level, ckpt_path=str(path), steps=6)
    seen = first.seen + resumed.seen  # Lightning's resume does not replay the batch order: compare on what it saw
    assert len(seen) == 6
    expected, lrs = reference(level, seen, schedule=True)
    assert same(weights(resumed.net), expected)
    assert resumed.trainer.optimizers[0].param_groups[0]["lr"] == lrs[-1]


def test_precision_report_callback_writes_the_html_for_the_first_batches(tmp_path):
    from ampkit.integrations.lightning import PrecisionReportCallback

    batches = make_batches(4)
    report = PrecisionReportCallback(tmp_path / "report.html", batches=2, levels=["O2", "O5"])
    lit = Lit()
    fit(lit, batches, "O5", callbacks=[report])
    html = (tmp_path / "report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "O5" in html
    # measured on float32 copies with the first two batches: the same report as one made by hand before fit
    expected = ampkit.precision_report(Lit(), lambda m, b: m.training_step(b, 0), batches[:2], levels=["O2", "O5"])
    assert report.report.to_dict() == expected.to_dict()
    assert lit.net[0].weight.dtype == torch.bfloat16  # and the fit itself went on at O5
    with pytest.raises(ValueError, match="batches=0"):
        PrecisionReportCallback(batches=0)


class Dropping(Lit):
    """Manual optimization whose batch 1 fails halfway through backward (after the last layer's scaled
    gradients were written): the next zero_grad(), the LightningOptimizer's, must clear them as ampkit's does."""

    def __init__(self):
        super().__init__(manual=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        hook = self.net[0].register_forward_hook(lambda m, i, out: out.register_hook(self.fail) and None)
        if batch_idx != 1:
            hook.remove()
        loss = loss_of(self.net(x), y)
        hook.remove()
        try:
            self.manual_backward(loss)
        except KeyboardInterrupt:
            return None  # the batch is dropped
        opt.step()

    @staticmethod
    def fail(grad):
        raise KeyboardInterrupt


@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
def test_a_batch_dropped_in_manual_optimization_is_forgotten_by_the_lightning_optimizers_zero_grad(level):
    batches = make_batches(4)
    lit = Dropping()
    fit(lit, batches, level, steps=3)
    assert same(weights(lit.net), reference(level, batches[:1] + batches[2:])[0])


class Evaluated(Lit):
    """``Lit`` with a BatchNorm, and the three evaluation steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 16))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss_of(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", loss_of(self.net(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")  # fit without one
@pytest.mark.parametrize("same_trainer", [True, False], ids=["same-trainer", "new-trainer"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5", "O7", "remainder"])
def test_validate_test_and_predict_after_fit(level, same_trainer):
    batches = make_batches(3)
    lit = Evaluated()
    trainer = fit(lit, batches, level)
    if not same_trainer:
        trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin(level)], logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trained, stats = weights(lit.net), lit.net[1].running_mean.clone()
    val = trainer.validate(lit, loader, verbose=False)[0]["val_loss"]
    test = trainer.test(lit, loader, verbose=False)[0]["test_loss"]
    predicted = trainer.predict(lit, loader)
    lit.eval()
    with torch.no_grad():
        by_hand = [lit.net(x) for x, _ in batches]
    assert all(p.dtype == torch.float32 and torch.equal(p, h) for p, h in zip(predicted, by_hand))
    assert val == test == pytest.approx(sum(loss_of(h, y).item() for h, (_, y) in zip(by_hand, batches)) / 3)
    assert torch.equal(lit.net[1].running_mean, stats)  # BatchNorm evaluated with its running statistics
    assert same(weights(lit.net), trained)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")  # on purpose
@pytest.mark.parametrize("level", ["O2", "O5", "O7", "O8", "remainder"])
def test_a_second_fit_of_the_same_module_resumes_bit_exact(level, tmp_path):
    batches = make_batches(6, bad=[1])
    lit = Lit(schedule=True)
    trainer = fit(lit, batches, level, steps=3)
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    trainer = fit(lit, batches, level, ckpt_path=str(tmp_path / "three.ckpt"), steps=6)
    assert len(lit.seen) == 6
    expected, lrs = reference(level, lit.seen, schedule=True)
    assert same(weights(lit.net), expected)
    assert trainer.optimizers[0].param_groups[0]["lr"] == lrs[-1]


def test_a_second_fit_at_another_level_is_refused_with_the_level_to_use():
    lit = Lit()
    fit(lit, make_batches(2), "O5")
    with pytest.raises(ValueError, match="opt_level='O2'.*cast at O5.*opt_level='O5' or 'auto'"):
        fit(lit, make_batches(2), "O2")


class TutorialGan(pl.LightningModule):
    """A G step then a D step under manual optimization; with ``toggle``, as Lightning's GAN tutorial
    (``toggle_optimizer``, zero_grad after the step), else zero_grad before each backward."""

    def __init__(self, toggle):
        super().__init__()
        torch.manual_seed(0)
        self.G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        self.D = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.toggle, self.automatic_optimization = toggle, False

    def training_step(self, batch, batch_idx):
        real, z = batch
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        g_opt, d_opt = self.optimizers()
        steps = ((g_opt, lambda: bce(self.D(self.G(z)).float(), ones)),
                 (d_opt, lambda: bce(self.D(real).float(), ones) + bce(self.D(self.G(z).detach()).float(), zeros)))
        for opt, loss in steps:
            self.toggle_optimizer(opt) if self.toggle else opt.zero_grad()
            self.manual_backward(loss())
            opt.step()
            if self.toggle:
                opt.zero_grad()
                self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        return make_optimizer(self.G.parameters()), make_optimizer(self.D.parameters())


@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
def test_toggle_optimizer_freezes_the_other_models_parameters_behind_the_masters(level):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    toggled, plain = TutorialGan(toggle=True), TutorialGan(toggle=False)
    for gan in (toggled, plain):
        fit(gan, batches, level, steps=6)
    assert same(weights(toggled), weights(plain))
    assert all(p.requires_grad for p in toggled.parameters())  # untoggled
