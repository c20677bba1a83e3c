"""The run's health (ampkit/health.py) and several runs in one process: loss scales that
float32 cannot hold, one-time warnings on persistent overflow and underflowing scales,
non-finite weights, casts after initialize, reading the scale / skipped steps, and which
run ``ampkit.state_dict()`` refers to."""
import gc
import logging
import re

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run import health

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def build(level="O2", seed=0, **kw):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("verbosity", 0)
    return ampkit.initialize(model, opt, opt_level=level, **kw)


def step(model, opt, poisoned=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    with ampkit.scale_loss(loss * float("nan") if poisoned else loss, opt) as s:
        s.backward()
    opt.step()


# --- loss scales float32 cannot hold ------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(loss_scale=1e39), dict(loss_scale=1e-39), dict(min_loss_scale=1e-40),
                                dict(max_loss_scale=1e39)])
def test_scales_outside_float32_are_refused(kw):
    name, value = next(iter(kw.items()))
    with pytest.raises(ValueError, match=re.escape(f"initialize({name}={value!r}): expected") + ".*positive finite number"):
        build("O2", **kw)
    with pytest.raises(ValueError, match="positive finite number"):
        ampkit.LossScaler(1e39)


@pytest.mark.parametrize("scale", [1e-300, 1e39, float("inf")])
def test_a_loaded_scale_outside_float32_is_refused(scale):
    model, opt = build("O2")
    with pytest.raises(ValueError, match=r"loss_scaler0\['loss_scale'\]=.*float32"):
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}}, optimizer=opt)
    assert ampkit.loss_scalers(opt)[0].loss_scale() == 2.0**16


def test_a_loaded_dynamic_scale_is_clamped_into_min_max():
    model, opt = build("O2", min_loss_scale=4.0, max_loss_scale=2.0**10)
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**20, "unskipped": 3}}, optimizer=opt)
    assert ampkit.state_dict(optimizer=opt) == {"loss_scaler0": {"loss_scale": 2.0**10, "unskipped": 3}}
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 0.5, "unskipped": 0}}, optimizer=opt)
    assert ampkit.loss_scalers(opt)[0].loss_scale() == 4.0
    model, opt = build("O5", loss_scale=128.0)  # a static scale is the configured one; loading keeps its value
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-100, "unskipped": 0}}, optimizer=opt)
    assert ampkit.loss_scalers(opt)[0].loss_scale() == 2.0**-100


# --- one-time warnings -------------------------------------------------------------------

def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "ampkit" and r.levelno >= logging.WARNING]


def test_persistent_overflow_warns_once_about_skips_and_once_about_underflow(caplog):
    model, opt = build("O2")  # verbosity=0: these warnings are not silenced by it
    before = [p.detach().clone() for p in ampkit.master_params(opt)]
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for i in range(health.CONSECUTIVE_SKIPS + 5):
            step(model, opt, poisoned=True)
            warned = _warnings(caplog)
            if i < 16:  # 2**16 halved 16 times is 1.0: not yet below it
                assert warned == []
    assert all(torch.equal(a, b) for a, b in zip(before, ampkit.master_params(opt)))
    assert len(warned) == 2, warned
    assert "dynamic loss scale has fallen to 0.5 (below 1.0): float16 gradients smaller than" in warned[0]
    assert f"has skipped {health.CONSECUTIVE_SKIPS} steps in a row" in warned[1]
    step(model, opt)  # training recovers; no more warnings
    assert len(_warnings(caplog)) == 2 and not ampkit.step_was_skipped(opt)


@pytest.mark.parametrize("level", LEVELS)
def test_persistent_overflow_warnings_per_level(level, caplog):
    """Every level warns once about the skips; only a dynamic float16 scale (O1/O2) also
    about underflow (static scales do not move; bfloat16 would need 2**-109)."""
    model, opt = build(level)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for _ in range(health.CONSECUTIVE_SKIPS + 3):
            step(model, opt, poisoned=True)
    warned = _warnings(caplog)
    assert sum("skipped 20 steps in a row" in w for w in warned) == 1
    assert sum("flush to zero" in w for w in warned) == (1 if level in ("O1", "O2") else 0)
    assert len(warned) == (2 if level in ("O1", "O2") else 1)
    assert ampkit.loss_scalers(opt)[0].skipped_steps == health.CONSECUTIVE_SKIPS + 3


def test_underflow_threshold_per_half_dtype():
    assert health.underflow_scale(torch.float16) == 1.0
    assert health.underflow_scale(torch.bfloat16) == 2.0**-109


def test_bfloat16_dynamic_scale_warns_only_far_lower(caplog):
    model, opt = build("O2", half_dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-20, "unskipped": 0}}, optimizer=opt)
        step(model, opt, poisoned=True)
        assert _warnings(caplog) == []
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**-109, "unskipped": 0}}, optimizer=opt)
        step(model, opt, poisoned=True)
    assert len(_warnings(caplog)) == 1 and "bfloat16" in _warnings(caplog)[0]


# --- weights: not finite at initialize, cast after initialize ------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_initialize(bad):
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.fc2.weight[0, 0] = bad
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameter fc2.weight already holds inf/NaN"):
        ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not hasattr(model, "_ampkit") and model.fc1.weight.dtype == torch.float32


CASTS = {
    "half": lambda m: m.half(), "float": lambda m: m.float(), "bfloat16": lambda m: m.bfloat16(),
    "to(float64)": lambda m: m.to(torch.float64), "to(cpu)": lambda m: m.to("cpu"),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("level", LEVELS)
def test_a_cast_after_initialize_fails_clearly_at_forward_and_step(level, cast):
    model, opt = build(level)
    step(model, opt)
    dtypes = [t.dtype for t in model.state_dict(keep_vars=True).values()]
    CASTS[cast](model)
    if [t.dtype for t in model.state_dict(keep_vars=True).values()] == dtypes:
        step(model, opt)  # nothing changed (a device move, .float() of a float32 model): trains on
        return
    with pytest.raises(RuntimeError, match=r"was cast after ampkit.initialize .* ampkit casts the model itself"):
        model(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"was cast after ampkit.initialize"):
        opt.step()


# --- reading the scale, the skipped steps, whether the last step was skipped -----------------

@pytest.mark.parametrize("level", LEVELS)
def test_reading_scale_skips_and_step_was_skipped(level):
    model, opt = build(level)
    scaler = ampkit.loss_scalers(opt)[0]
    assert ampkit.loss_scalers() == [scaler] and ampkit.loss_scalers(model=model) == [scaler]
    assert not ampkit.step_was_skipped(opt)
    scale = scaler.loss_scale()
    step(model, opt, poisoned=True)
    assert ampkit.step_was_skipped(opt) and scaler.skipped_steps == 1
    assert scaler.loss_scale() == (scale / 2 if scaler.dynamic else scale)
    step(model, opt)
    assert not ampkit.step_was_skipped(opt) and scaler.skipped_steps == 1


def test_step_was_skipped_drives_an_lr_scheduler_like_grad_scaler():
    """Advance the scheduler only on applied steps; GradScaler users compare get_scale()."""
    model, opt = build("O1")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for poisoned in (False, True, False):
        step(model, opt, poisoned=poisoned)
        if not ampkit.step_was_skipped(opt):
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


# --- several runs in one process -------------------------------------------------------------

def test_a_teacher_without_optimizer_does_not_take_over_the_checkpoint_calls():
    model, opt = build("O2")
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}})
    torch.manual_seed(3)
    teacher = ampkit.initialize(Tiny(), opt_level="O2", num_losses=2, verbosity=0)
    assert ampkit.state_dict() == {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}}
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 64.0, "unskipped": 0}})
    assert ampkit.loss_scalers(opt)[0].loss_scale() == 64.0
    assert ampkit.loss_scalers(model=teacher)[0].loss_scale() == 2.0**16  # its own, untouched


def test_two_training_runs_use_the_most_recent_and_warn_once(caplog):
    m1, o1 = build("O2", seed=1)
    m2, o2 = build("O5", seed=2)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        assert ampkit.state_dict() == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}  # O5's, the newest
        ampkit.state_dict()
    warned = [r.getMessage() for r in caplog.records if "training runs" in r.getMessage()]
    assert len(warned) == 1 and "ampkit.state_dict(): 2 training runs" in warned[0]
    assert "initialize at O5 with SGD" in warned[0] and "Pass optimizer=..." in warned[0]
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})  # the newest again
    assert ampkit.loss_scalers(o2)[0].loss_scale() == 8.0 and ampkit.loss_scalers(o1)[0].loss_scale() == 2.0**16
    assert ampkit.state_dict(optimizer=o1)["loss_scaler0"]["loss_scale"] == 2.0**16
    assert ampkit.state_dict(model=m2)["loss_scaler0"]["loss_scale"] == 8.0
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}}, optimizer=o1)
    assert ampkit.loss_scalers(o1)[0].loss_scale() == 8.0
    del m2, o2
    gc.collect()
    assert ampkit.state_dict() == {"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}}  # one run left
    with pytest.raises(ValueError, match="did not go through ampkit.initialize"):
        ampkit.state_dict(optimizer=torch.optim.SGD(Tiny().parameters(), lr=0.1))
