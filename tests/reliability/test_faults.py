"""Fault injection: inf/NaN gradients at chosen steps and loss ids, at every opt level.

A poisoned step must leave weights, fp32 masters and optimizer state bit-identical; the
loss scale must follow the scaler's rules exactly; after the faults the run must be where
a clean run of (length - skipped steps) is; every skip is reported at verbosity 1, with a
dynamic or a static scale (ampkit's policy: non-finite gradients are never applied).
"""
import logging

import pytest
import torch

import ampkit

from ._harness import (
    DYNAMIC_LEVELS, FLT_TINY, LEVELS, Poison, ReferenceScaler, all_finite, assert_unchanged, diff,
    eval_loss, expected_scales, fixed_batch, make, scalers, snapshot, train,
)

mse = torch.nn.functional.mse_loss

STEPS = 12
# (step, loss_id): the first step (no optimizer state yet), two steps in a row, both losses
# of one step, loss 1 alone.
SCHEDULE = {(0, 0), (3, 1), (4, 0), (7, 0), (7, 1), (10, 1)}
SKIPPED = len({s for s, _ in SCHEDULE})


def _default_scale(level):
    return "dynamic" if level in DYNAMIC_LEVELS else 1.0


def _check_step(model, opt):
    def on_step(step, poisoned, before, after):
        if poisoned:
            assert_unchanged(before, after, f"poisoned step {step}")
        else:  # a clean step really trains: model weights and the weights stepped on move
            changed = diff(before, after)
            assert "model.params" in changed and "opt.params" in changed, (step, changed)
        assert all_finite(model, opt), f"non-finite weights after step {step}"
    return on_step


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("level", LEVELS)
def test_poisoned_steps_change_nothing_and_the_run_recovers(level, opt_name, kind):
    x, y = fixed_batch()
    model, opt = make(opt_name)
    model, opt = ampkit.initialize(model, opt, opt_level=level, num_losses=2, verbosity=0)
    poison = Poison(model.fc1.weight)
    schedule = {key: kind for key in SCHEDULE}
    seq = train(model, opt, x, y, STEPS, schedule, num_losses=2, poison=poison, on_step=_check_step(model, opt))
    assert poison.fired == len(SCHEDULE)

    expected, refs = expected_scales(schedule, STEPS, 2, loss_scale=_default_scale(level))
    assert seq == expected
    assert [s.skipped_steps for s in scalers()] == [r.skipped for r in refs] == [3, 3]

    # Same place as a clean run of STEPS - SKIPPED steps (same batch every step).
    def clean(steps):
        m, o = make(opt_name)
        m, o = ampkit.initialize(m, o, opt_level=level, num_losses=2, verbosity=0)
        train(m, o, x, y, steps, num_losses=2)
        assert [s.skipped_steps for s in scalers()] == [0, 0]  # no natural overflow muddies this
        return m

    short, full = eval_loss(clean(STEPS - SKIPPED), x, y), eval_loss(clean(STEPS), x, y)
    got = eval_loss(model, x, y)
    tol = 1e-3 * short
    assert abs(got - short) <= tol, (got, short)
    assert abs(full - short) > 10 * tol  # the comparison can tell a skipped step from a taken one


@pytest.mark.parametrize("hysteresis", [1, 3])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exact_scale_sequence_with_growth_clamp_and_hysteresis(level, hysteresis):
    x, y = fixed_batch()
    model, opt = make("sgd")
    model, opt = ampkit.initialize(model, opt, opt_level=level, num_losses=2, verbosity=0,
                                   max_loss_scale=2.0**17, loss_scale_hysteresis=hysteresis)
    for s in scalers():
        s.growth_interval = 3
    schedule = {(1, 0): "inf", (2, 0): "nan", (3, 0): "inf", (4, 1): "nan", (9, 0): "inf",
                (10, 0): "inf", (16, 0): "nan", (16, 1): "inf"}
    steps = 24
    poison = Poison(model.fc2.bias)
    seq = train(model, opt, x, y, steps, schedule, num_losses=2, poison=poison, on_step=_check_step(model, opt))
    expected, refs = expected_scales(schedule, steps, 2, interval=3, max_scale=2.0**17, hysteresis=hysteresis)
    assert seq == expected
    assert max(max(s) for s in seq) == 2.0**17  # the run did reach the clamp
    assert [s.skipped_steps for s in scalers()] == [r.skipped for r in refs]


@pytest.mark.parametrize("delay", ["delay_overflow_check", "delay_unscale"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_faults_through_delayed_checks_and_accumulation(level, delay):
    """The overflow decision made at step() (delay_overflow_check) or for a whole
    accumulation window (delay_unscale on the first micro-batch) still skips the step."""
    x, y = fixed_batch()
    model, opt = make("adamw")
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    poison = Poison(model.fc1.bias)
    on_step = _check_step(model, opt)
    for step in range(5):
        if delay == "delay_unscale":
            poison.kind = "nan" if step in (1, 3) else None  # first micro-batch of the window
            with ampkit.scale_loss(mse(model(x[:8]), y[:8]), opt, delay_unscale=True) as s:
                s.backward()
            poison.kind = None
            with ampkit.scale_loss(mse(model(x[8:]), y[8:]), opt) as s:
                s.backward()
        else:
            poison.kind = "inf" if step in (1, 3) else None
            with ampkit.scale_loss(mse(model(x), y), opt, delay_overflow_check=True) as s:
                s.backward()
            poison.kind = None
        before = snapshot(model, opt)
        opt.step()
        on_step(step, step in (1, 3), before, snapshot(model, opt))
        opt.zero_grad()
    assert scalers()[0].skipped_steps == 2
    ref = ReferenceScaler(_default_scale(level))
    for step in range(5):
        ref.step(step in (1, 3))
    assert scalers()[0].loss_scale() == ref.scale


# --- reporting: dynamic and static scales ----------------------------------------------------

def _overflow_messages(caplog):
    return [r for r in caplog.records if r.name == "ampkit" and "Gradient overflow" in r.getMessage()]


@pytest.mark.parametrize(
    "level,overrides,scale",
    [("O0", {}, 1.0), ("O3", {}, 1.0), ("O4", {}, 1.0), ("O5", {}, 1.0),
     ("O2", {"loss_scale": 128.0}, 128.0), ("O1", {"loss_scale": "8.0"}, 8.0)],
    ids=["O0", "O3", "O4", "O5", "O2-static128", "O1-static8"],
)
def test_static_scale_still_skips_and_reports(level, overrides, scale, caplog):
    x, y = fixed_batch()
    model, opt = make("sgd")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=1, **overrides)
        caplog.clear()
        poison = Poison(model.fc1.weight)
        schedule = {(1, 0): "nan", (2, 0): "inf", (5, 0): "-inf"}
        seq = train(model, opt, x, y, 7, schedule, poison=poison, on_step=_check_step(model, opt))
    assert seq == [(scale,)] * 7  # a static scale never moves
    assert scalers()[0].skipped_steps == 3
    msgs = [r.getMessage() for r in _overflow_messages(caplog)]
    assert len(msgs) == 3, msgs
    for m in msgs:
        assert m.startswith("Gradient overflow. Skipping step, loss scaler 0"), m
        assert str(scale) in m, m


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_dynamic_skip_message(level, caplog):
    x, y = fixed_batch()
    model, opt = make("sgd")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=1, num_losses=2)
        caplog.clear()
        train(model, opt, x, y, 3, {(1, 1): "inf"}, num_losses=2, poison=Poison(model.fc1.weight))
    msgs = [r.getMessage() for r in _overflow_messages(caplog)]
    assert msgs == ["Gradient overflow. Skipping step, loss scaler 1 reducing loss scale to 32768.0"]


def test_verbosity_zero_still_skips_silently(caplog):
    x, y = fixed_batch()
    model, opt = make("sgd")
    with caplog.at_level(logging.DEBUG, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level="O5", verbosity=0)
        train(model, opt, x, y, 3, {(1, 0): "nan"}, poison=Poison(model.fc1.weight), on_step=_check_step(model, opt))
    assert scalers()[0].skipped_steps == 1
    assert [r for r in caplog.records if r.name == "ampkit"] == []


def test_nan_loss_from_a_bad_batch_is_skipped_and_reported(caplog):
    """Policy: a non-finite loss is not an exception (one bad batch must not end a long
    run); its non-finite gradients make it an overflow: skipped, reported, scale backed off."""
    x, y = fixed_batch()
    model, opt = make("adamw")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=1)
        train(model, opt, x, y, 2)
        bad = x.clone()
        bad[3, 1] = float("nan")
        loss = torch.nn.functional.mse_loss(model(bad), y)
        assert torch.isnan(loss)
        with ampkit.scale_loss(loss, opt) as s:
            s.backward()
        before = snapshot(model, opt)
        opt.step()
        assert_unchanged(before, snapshot(model, opt), "NaN-loss step")
    assert scalers()[0].skipped_steps == 1 and scalers()[0].loss_scale() == 2.0**15
    assert len(_overflow_messages(caplog)) == 1
    train(model, opt, x, y, 2)  # and training goes on
    assert all_finite(model, opt)


# --- long run, floor, no zero scale --------------------------------------------------------

def _long_run_faults(steps=5000, every=300, quiet=(1600, 3700)):
    faults, step, k = {}, every, 0
    while step < steps:
        if not quiet[0] <= step < quiet[1]:  # a quiet stretch > growth_interval: the scale grows back
            faults[(step, 0)] = ("inf", "nan", "-inf")[k % 3]
            k += 1
        step += every + (17 * k) % 41 - 20  # "about every 300 steps"
    return faults


@pytest.mark.slow
def test_long_float16_O2_run_with_periodic_overflow():
    steps = 5000
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0, min_loss_scale=1.0)
    assert model.weight.dtype == torch.float16
    poison = Poison(model.weight)
    faults = _long_run_faults(steps)
    g = torch.Generator().manual_seed(0)
    x, y = 0.3 * torch.randn(8, 4, generator=g), 0.3 * torch.randn(8, 4, generator=g)
    scaler = scalers()[0]
    ref = ReferenceScaler("dynamic", min_scale=1.0)
    master = list(ampkit.master_params(opt))
    nonfinite = torch.zeros((), dtype=torch.bool)
    lo, hi = float("inf"), 0.0
    first = None
    for step in range(steps):
        poison.kind = faults.get((step, 0))
        loss = torch.nn.functional.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as s:
            s.backward()
        poison.kind = None
        opt.step()
        opt.zero_grad()
        ref.step((step, 0) in faults)
        scale = scaler.loss_scale()
        assert scale == ref.scale, (step, scale, ref.scale)
        lo, hi = min(lo, scale), max(hi, scale)
        for t in (model.weight, model.bias, *master):  # no host sync per step: one flag, read at the end
            nonfinite |= ~torch.isfinite(t).all()
        if step == 10:
            first = loss.item()
    assert not bool(nonfinite), "a NaN/inf reached the weights"
    assert poison.fired == len(faults) >= 10
    assert scaler.skipped_steps == len(faults)
    assert 1.0 <= lo <= hi <= 2.0**24 and 0 < lo and hi < float("inf")
    assert hi == 2.0**16 and lo < 2.0**10  # it backed off and grew back in the quiet stretch
    assert loss.item() < 0.5 * first  # and it kept learning


def test_min_loss_scale_pinned_by_persistent_overflow_warns_once(caplog):
    x, y = fixed_batch()
    model, opt = make("sgd")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=1, min_loss_scale=2.0**12)
        first = snapshot(model, opt)
        train(model, opt, x, y, 40, {(s, 0): "nan" for s in range(40)}, poison=Poison(model.fc1.weight))
    assert_unchanged(first, snapshot(model, opt), "40 poisoned steps")
    assert scalers()[0].loss_scale() == 2.0**12 and scalers()[0].skipped_steps == 40
    warnings = [r for r in caplog.records if r.name == "ampkit" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert "min_loss_scale" in text and "not progressing" in text
    assert len(_overflow_messages(caplog)) == 40


def test_persistent_overflow_without_floor_never_reaches_zero():
    x, y = fixed_batch()
    model, opt = make("sgd")
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    train(model, opt, x, y, 300, {(s, 0): "inf" for s in range(300)}, poison=Poison(model.fc1.weight))
    scale = scalers()[0].loss_scale()
    assert FLT_TINY <= scale < 1e-30 and 1.0 / scale < float("inf")
    train(model, opt, x, y, 3)  # clean steps at a tiny scale: nothing non-finite appears
    assert all_finite(model, opt)


def test_reaching_the_floor_once_is_not_reported_as_stuck(caplog):
    """One overflow that happens to land the scale on min_loss_scale, followed by clean
    steps, is ordinary: "training is not progressing" is for an overflow that meets a scale
    already at the floor (backing off no longer helps), and then it is said once."""
    x, y = fixed_batch()
    model, opt = make("sgd")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=1, min_loss_scale=2.0**15)
        poison = Poison(model.fc1.weight)
        train(model, opt, x, y, 6, {(1, 0): "inf"}, poison=poison)  # 2**16 -> 2**15 = the floor
        assert scalers()[0].loss_scale() == 2.0**15
        stuck = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert stuck == [], [r.getMessage() for r in stuck]
        train(model, opt, x, y, 6, {(s, 0): "nan" for s in range(6)}, poison=poison)  # now it is pinned
    stuck = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(stuck) == 1 and "pinned at min_loss_scale" in stuck[0], stuck


class WithBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_fault_in_a_float32_batchnorm_parameter_next_to_masters(level, opt_name):
    """At O2/O5 BatchNorm stays float32 and is stepped directly, beside the fp32 masters of
    the half layers: a fault there must skip the step for everything, running stats aside."""
    x, y = fixed_batch()
    model, opt = make(opt_name, model_cls=WithBN)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    assert model.bn.weight.dtype == torch.float32 and model.fc1.weight.dtype != torch.float32

    def on_step(step, poisoned, before, after):
        if poisoned:
            assert_unchanged(before, after, f"poisoned step {step}")
        assert all_finite(model, opt)

    schedule = {(1, 0): "nan", (2, 0): "inf"}
    train(model, opt, x, y, 4, schedule, poison=Poison(model.bn.weight), on_step=on_step)
    assert scalers()[0].skipped_steps == 2
